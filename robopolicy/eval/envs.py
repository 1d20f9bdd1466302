"""The env an evaluation runs: task + observation/action mapping + follower + episode bookkeeping.

No torch here: :func:`make_eval_env` is what each worker process of the vector env unpickles.

Wrapper stack, inside out::

    task env ─► WaypointFollowWrapper (waypoint policies) ─► MappedEnv (LeRobot keys, action
    scale) ─► EvalEpisode (episode summary in info, MP4 of chosen seeds, parks when done)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

from robopolicy.envs import EnvConfig, make_env
from robopolicy.eval.config import EnvMapping

EPISODE_INFO = "eval_episode"
"""Info key holding the finished episode's summary (a JSON string) on its last step."""


def _to_uint8_image(value: np.ndarray) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype == np.uint8:
        return arr
    return np.clip(np.asarray(arr, dtype=np.float32) * 255.0 + 0.5, 0, 255).astype(np.uint8)


class MappedEnv(gymnasium.Wrapper):
    """Present any env with LeRobot observation keys and policy-unit actions.

    Observation: ``{"observation.images.<cam>": uint8 (H, W, 3), "observation.state": (D,),
    "task": str}``. Action: the policy's, turned into the env's by ``* scale + offset``.
    """

    def __init__(self, env: gymnasium.Env, mapping: EnvMapping):
        super().__init__(env)
        self.mapping = mapping
        inner = env.observation_space
        table = dict(mapping.observation)
        if not table:
            if isinstance(inner, spaces.Dict):
                table = {k: k for k in inner.spaces if k != "task"}
                foreign = [k for k in table if not k.startswith("observation.")]
                if foreign:
                    raise ValueError(f"env observation keys {foreign} are not LeRobot keys: map them with "
                                     f"mapping.observation (e.g. {{observation.images.front: {foreign[0]}}})")
            else:
                table = {"observation.state": "."}
        self._table = {k: v for k, v in table.items() if k != "task"}
        self._task_key = table.get("task", "task")
        out: dict[str, spaces.Space] = {}
        for key, src in self._table.items():
            space = self._source_space(inner, src, key)
            if key.startswith("observation.images."):
                if len(space.shape) != 3 or space.shape[-1] != 3:
                    raise ValueError(f"mapping: {key!r} <- {src!r} must be an (H, W, 3) image, got {space.shape}")
                out[key] = spaces.Box(0, 255, space.shape, np.uint8)
            else:
                out[key] = spaces.Box(-np.inf, np.inf, space.shape, np.float32)
        out["task"] = spaces.Text(max_length=512, min_length=0, charset=_TEXT_CHARSET)
        self.observation_space = spaces.Dict(out)

        base = env.action_space
        if not isinstance(base, spaces.Box):
            raise ValueError(f"evaluation needs a Box action space, got {base}")
        dim = base.shape
        self._scale = self._broadcast(mapping.action_scale, dim, 1.0, "action_scale")
        self._offset = self._broadcast(mapping.action_offset, dim, 0.0, "action_offset")
        self._identity = mapping.action_scale is None and mapping.action_offset is None
        self.action_space = base if self._identity else spaces.Box(-np.inf, np.inf, dim, np.float32)

    @staticmethod
    def _source_space(inner: spaces.Space, src: str, key: str) -> spaces.Space:
        if src == ".":
            return inner
        if not isinstance(inner, spaces.Dict) or src not in inner.spaces:
            have = list(inner.spaces) if isinstance(inner, spaces.Dict) else ["."]
            raise ValueError(f"mapping: {key!r} reads env observation key {src!r}, which the env does not have "
                             f"(it has: {have})")
        return inner.spaces[src]

    @staticmethod
    def _broadcast(values, shape, default, name) -> np.ndarray:
        if values is None:
            return np.full(shape, default, np.float32)
        arr = np.asarray(values, np.float32)
        if arr.size not in (1, int(np.prod(shape))):
            raise ValueError(f"mapping.{name} needs 1 or {int(np.prod(shape))} values, got {arr.size}")
        return np.broadcast_to(arr.reshape(-1) if arr.size == 1 else arr.reshape(shape), shape).astype(np.float32)

    def _map(self, obs: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, src in self._table.items():
            value = obs if src == "." else obs[src]
            out[key] = _to_uint8_image(value) if key.startswith("observation.images.") else np.asarray(value, np.float32)
        if self.mapping.task is not None:
            out["task"] = self.mapping.task
        else:
            out["task"] = str(obs.get(self._task_key, "")) if isinstance(obs, dict) else ""
        return out

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return self._map(obs), info

    def step(self, action):
        if not self._identity:
            action = np.asarray(action, np.float32) * self._scale + self._offset
        obs, reward, terminated, truncated, info = self.env.step(action)
        return self._map(obs), reward, terminated, truncated, info


# Printable ASCII plus common accents: instructions of any task fit.
_TEXT_CHARSET = "".join(chr(c) for c in range(32, 127)) + "àâäçéèêëîïôöùûüÀÉÈ’"


class EvalEpisode(gymnasium.Wrapper):
    """One evaluation episode per reset: its summary arrives in ``info[EPISODE_INFO]``.

    The end of an episode is reported in ``info`` (a JSON string with seed, steps, success,
    return, task and the env's ``episode_metrics``), never through terminated/truncated, which
    stay False: the vector env then never auto-resets, and the evaluation loop decides which
    seed each env runs next. After its end the env is parked: steps return the last observation
    without touching the task. Episodes whose seed is in ``videos`` are rendered to that MP4.
    """

    def __init__(self, env: gymnasium.Env, videos: dict[int, str] | None = None, max_steps: int | None = None):
        super().__init__(env)
        self.videos = dict(videos or {})
        self.max_steps = max_steps
        self._done = True
        self._last_obs: Any = None
        self._frames: list[np.ndarray] | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        obs, info = self.env.reset(seed=seed, options=options or None)
        self._seed, self._steps, self._return, self._done = seed, 0, 0.0, False
        self._task = str(obs.get("task", "")) if isinstance(obs, dict) else ""
        self._last_obs = obs
        self._frames = [self.env.render()] if seed in self.videos else None
        return obs, {}

    def step(self, action):
        if self._done:
            return self._last_obs, 0.0, False, False, {}
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._steps += 1
        self._return += float(reward)
        self._last_obs = obs
        if self._frames is not None:
            self._frames.append(self.env.render())
        if self.max_steps is not None and self._steps >= self.max_steps:
            truncated = True
        if not (terminated or truncated):
            return obs, reward, False, False, {}
        self._done = True
        summary = {
            "seed": self._seed,
            "steps": self._steps,
            "success": bool(info.get("is_success", False)),
            "return": self._return,
            "task": self._task,
            "terminated": bool(terminated),
            "episode_metrics": info.get("episode_metrics", {}),
        }
        if self._frames is not None:
            from robopolicy.utils.video import write_mp4

            fps = float(self.env.metadata.get("render_fps", 10))
            summary["video"] = str(write_mp4(self.videos[self._seed], self._frames, fps))
            self._frames = None
        return obs, reward, False, False, {EPISODE_INFO: json.dumps(summary, default=_json_default)}


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


@dataclass
class EvalEnvSpec:
    """Everything a worker process needs to build one evaluation env (picklable)."""

    env: EnvConfig
    mapping: EnvMapping = field(default_factory=EnvMapping)
    waypoints: int | None = None
    """K of a waypoint policy: wrap the task in ``WaypointFollowWrapper``; ``None``: act directly."""
    videos: dict[int, str] = field(default_factory=dict)
    max_steps: int | None = None


def make_eval_env(spec: EvalEnvSpec) -> gymnasium.Env:
    """Build the wrapped evaluation env for ``spec`` (see the module docstring)."""
    env = make_env(spec.env, render_mode="rgb_array")
    if spec.waypoints is not None:
        from sim_envs.person_follow.waypoints import WaypointFollowWrapper

        env = WaypointFollowWrapper(env, num_waypoints=int(spec.waypoints))
    env = MappedEnv(env, spec.mapping)
    return EvalEpisode(env, videos=spec.videos, max_steps=spec.max_steps)


def make_vector_env(spec: EvalEnvSpec, num_envs: int) -> gymnasium.vector.VectorEnv:
    """``num_envs`` copies of the env; worker processes (spawned, no GL state shared) when > 1.

    Autoreset is disabled: :class:`EvalEpisode` reports episode ends in ``info`` and the
    evaluation resets each env itself with the seed it wants.
    """
    from functools import partial

    fns = [partial(make_eval_env, spec) for _ in range(num_envs)]
    mode = gymnasium.vector.AutoresetMode.DISABLED
    if num_envs == 1:
        return gymnasium.vector.SyncVectorEnv(fns, autoreset_mode=mode, copy=False)
    return gymnasium.vector.AsyncVectorEnv(fns, context="spawn", shared_memory=False, autoreset_mode=mode, copy=False)
