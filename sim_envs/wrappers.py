"""Task wrappers for rollouts that learn: reward mode, privileged scene state, oracle labels.

    env = wrap_task(gymnasium.make("robopolicy/ArmPickPlace-v0"), reward="sparse", privileged=True, oracle=True)

Stack, inside out: task env ─► :class:`PrivilegedState` ─► :class:`OracleLabels` ─► :class:`RewardMode`
(the oracle labels an observation that already holds the privileged state). No torch: vector-env
worker processes build these.
"""

from __future__ import annotations

import math
from collections import deque

import gymnasium
import numpy as np

ENV_STATE = "observation.environment_state"
"""Observation key of the privileged scene state (LeRobot's name)."""
LABEL_FLAGS = ("target_lost", "near_collision", "target_unseen", "near_obstacle")
NEAR_PERSON = 0.7
"""m: a person this close raises ``near_collision`` (the collision distance is 0.5 m)."""
NEAR_OBSTACLE = 0.5
"""m: the robot's rim this close to an obstacle or wall raises ``near_obstacle``."""


def privileged_state(env: gymnasium.Env, info: dict) -> np.ndarray:
    """The scene state an oracle sees, flattened. Arm tasks: the env's own
    ``environment_state()`` (tcp, goal cube and target, their offsets, the other objects; see
    ``sim_envs.arm.env.ArmEnv.environment_state``); PersonFollow: target distance, bearing
    (cos, sin), visibility."""
    base = env.unwrapped
    if hasattr(base, "environment_state"):
        return base.environment_state()
    if "target_distance" in info:
        b = float(info["target_bearing"])
        return np.array([info["target_distance"], math.cos(b), math.sin(b), float(info["target_visible"])], np.float32)
    raise ValueError(f"privileged_state: {type(base).__name__} has no environment_state() and its info no "
                     f"tracking (target_distance) keys")


def label_flags(info: dict) -> np.ndarray:
    """Per-state reasons an oracle label may be unreliable, as floats in :data:`LABEL_FLAGS` order:
    the target is out of sight and beyond following range (not recoverable from here); a
    person is within 0.7 m, near the 0.5 m collision distance (obstacles and walls are not checked:
    a collision with them is left to the ``unrecoverable`` probe); the
    target is not visible in the camera (occluded or outside the field of view), so the label
    steers toward a person the policy's current frame does not show; the robot's rim is within
    0.5 m of an obstacle or wall (``info["robot_clearance"]``), where the label brakes or turns
    away (a flag to weight by, not a sign of a bad label)."""
    m = info.get("metrics")
    if not isinstance(m, dict):
        return np.zeros(len(LABEL_FLAGS), np.float32)
    unseen = not m.get("visible", True)
    lost = unseen and float(m.get("distance", 0.0)) > 3.0 or int(m.get("lost_counter", 0)) > 10
    near = float(m.get("min_person_distance", 9.0)) < NEAR_PERSON
    walled = float(info.get("robot_clearance", np.inf)) < NEAR_OBSTACLE
    return np.array([float(lost), float(near), float(unseen), float(walled)], np.float32)


class RewardMode(gymnasium.Wrapper):
    """``sparse``: reward 1 on the step that ends an episode successfully, else 0; ``dense``: the
    task's own shaped reward. Either way ``info["success"]`` is 1 on a successful episode's last step."""

    def __init__(self, env: gymnasium.Env, reward: str = "sparse"):
        super().__init__(env)
        if reward not in ("sparse", "dense"):
            raise ValueError(f"reward must be 'sparse' or 'dense', got {reward!r}")
        self.reward_mode = reward

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self.reward_mode == "sparse":
            reward = float(bool(terminated) and bool(info.get("is_success", False)))
        info = dict(info)
        info["success"] = float(bool(info.get("is_success", False)) and (terminated or truncated))
        return obs, reward, terminated, truncated, info


class PrivilegedState(gymnasium.Wrapper):
    """Adds :data:`ENV_STATE` ``(D,)`` (:func:`privileged_state`) to the observation, unless the
    env observes it already."""

    def __init__(self, env: gymnasium.Env):
        super().__init__(env)
        self._own_state = ENV_STATE in env.observation_space.spaces
        if not self._own_state:
            base = env.unwrapped
            dim = base.env_state_dim if hasattr(base, "environment_state") else 4  # see privileged_state
            spaces_ = dict(env.observation_space.spaces)
            spaces_[ENV_STATE] = gymnasium.spaces.Box(-np.inf, np.inf, (dim,), np.float32)
            self.observation_space = gymnasium.spaces.Dict(spaces_)

    def _add(self, obs: dict, info: dict) -> dict:
        if self._own_state:
            return obs
        return dict(obs, **{ENV_STATE: privileged_state(self.env, info)})

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return self._add(obs, info), info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return self._add(obs, info), reward, terminated, truncated, info


class OracleLabels(gymnasium.Wrapper):
    """The privileged oracle's clean label for the *returned* observation in ``info["oracle_label"]``
    ``(A,)`` (``info["oracle_waypoints"]`` ``(K, 3)`` for tracking) and the label-reliability flags
    (:func:`label_flags`) in ``info["label_flags"]``.

    - ``replan``: the oracle re-anchors its plan to the robot's actual state before each label (for
      labelling states a policy drove, see :attr:`sim_envs.core.Oracle.replan`);
    - ``label_chunk`` = H > 0 (envs with ``oracle_chunk``, i.e. the arm tasks): also the oracle's own
      next H labels from the returned state, a counterfactual rollout, in ``info["oracle_chunk"]``
      ``(H, A)`` (the last label repeated past the episode's end) and their number in
      ``info["oracle_chunk_len"]``;
    - ``probe_window`` > 0 (envs with ``oracle_recovers``, i.e. PersonFollow): when an episode ends
      in collision or loss, asks for each of its last ``probe_window`` states whether the oracle
      taking over there would itself fail within ``probe_horizon`` steps, and reports it in the
      final step's ``info["unrecoverable"]`` ``(probe_window,)`` (1: it would fail; oldest first,
      the last entry the state the final action was taken in; 0 where the episode was shorter).
      Only failed episodes pay for the probes.
    """

    def __init__(self, env: gymnasium.Env, replan: bool = False, label_chunk: int = 0, probe_window: int = 0,
                 probe_horizon: int = 20):
        super().__init__(env)
        base = env.unwrapped
        if label_chunk and not hasattr(base, "oracle_chunk"):
            raise ValueError(f"label_chunk needs oracle=True and an env with oracle_chunk(); "
                             f"{type(base).__name__} has none")
        if probe_window and not hasattr(base, "oracle_recovers"):
            raise ValueError(f"probe_window needs oracle=True and an env with oracle_recovers(); "
                             f"{type(base).__name__} has none")
        from sim_envs import make_oracle

        self.oracle = make_oracle(base, noise=0.0)
        self.oracle.replan = bool(replan)
        self.label_chunk = int(label_chunk)
        self.probe_window, self.probe_horizon = int(probe_window), int(probe_horizon)
        self._recent: deque = deque(maxlen=max(self.probe_window, 1))
        self._info: dict = {}

    def _label(self, obs: dict, info: dict, first: bool) -> dict:
        if first:
            self.oracle.reset(obs, info)
        step = self.oracle.label(obs, info)
        info = dict(info)
        info["oracle_label"] = np.asarray(step.label, np.float32)
        if self.label_chunk:
            chunk = self.env.unwrapped.oracle_chunk(self.oracle, step.label, self.label_chunk)
            info["oracle_chunk_len"] = len(chunk)
            info["oracle_chunk"] = np.concatenate(
                [chunk, np.repeat(chunk[-1:], self.label_chunk - len(chunk), 0)]).astype(np.float32)
        if "waypoints" in step.extras:
            info["oracle_waypoints"] = np.asarray(step.extras["waypoints"], np.float32)
        info["label_flags"] = label_flags(info)
        self._info = info
        return info

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self._recent.clear()
        return obs, self._label(obs, info, first=True)

    def step(self, action):
        if self.probe_window:
            self._recent.append((self.env.unwrapped.get_state(), self._info))
        obs, reward, terminated, truncated, info = self.env.step(action)
        info = self._label(obs, info, first=False)
        if self.probe_window:
            info["unrecoverable"] = self._probe(info) if terminated or truncated else np.zeros(self.probe_window, np.float32)
        return obs, reward, terminated, truncated, info

    def _probe(self, info: dict) -> np.ndarray:
        """The ``unrecoverable`` flags of the episode's last states (zeros unless it failed)."""
        out = np.zeros(self.probe_window, np.float32)
        m = info.get("metrics", {})
        if m.get("collision") or m.get("lost"):
            base, recent = self.env.unwrapped, list(self._recent)
            for j, (state, inf) in enumerate(recent):
                out[self.probe_window - len(recent) + j] = float(not base.oracle_recovers(inf, self.probe_horizon, state=state))
        return out


def wrap_task(env: gymnasium.Env, reward: str = "sparse", privileged: bool = False, oracle: bool = False,
              probe_window: int = 0, probe_horizon: int = 20, replan: bool = False,
              label_chunk: int = 0) -> gymnasium.Env:
    """The task wrappers a rollout asks for, in their order (see the module docstring)."""
    if (label_chunk or probe_window) and not oracle:
        what = "label_chunk" if label_chunk else "probe_window"
        raise ValueError(f"{what} needs oracle=True and an env with "
                         f"{'oracle_chunk' if label_chunk else 'oracle_recovers'}(); oracle is off")
    if privileged:
        env = PrivilegedState(env)
    if oracle:
        env = OracleLabels(env, replan=replan, label_chunk=label_chunk, probe_window=probe_window,
                           probe_horizon=probe_horizon)
    return RewardMode(env, reward)
