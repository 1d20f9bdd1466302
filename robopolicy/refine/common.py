"""Pieces shared by the refinement loops: rollout envs, reward scale, GAE, evaluation, curves.

Rollout envs are ``gymnasium`` vector envs of :class:`RefineEnv` (worker processes started with
``spawn`` and no shared memory when there are several: text observations break with shared
memory, and a forked child hangs creating its EGL context). Autoreset is ``SAME_STEP``: the
observation returned with ``done`` is already the next episode's first one.
"""

from __future__ import annotations

import csv
import math
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import gymnasium
import numpy as np

from robopolicy.data.features import ENV_STATE  # the privileged scene state RefineEnv adds
from robopolicy.envs import EnvConfig, make_env
from sim_envs.person_follow.metrics import summarize_episodes



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


@dataclass
class RefineRunOptions:
    """What every refinement loop's config shares: evaluation episodes, seeds, threads, output."""

    eval_episodes: int = 20
    eval_envs: int = 2
    eval_seed: int = 100_000
    """Episode ``e`` of an evaluation starts from seed ``eval_seed + e`` (as ``robopolicy eval``)."""
    seed: int = 0
    threads: int = 1
    out_dir: str = "outputs/refine/run"
    progress: bool = True


class RefineEnv(gymnasium.Wrapper):
    """A task env for refinement rollouts (no torch: worker processes build it).

    - reward: ``sparse`` (1 on the step that ends an episode successfully, else 0) or ``dense``
      (the task's own shaped reward);
    - ``privileged``: adds :data:`ENV_STATE` ``(D,)`` to the observation;
    - ``oracle``: puts the privileged oracle's clean label for the *returned* observation in
      ``info["oracle_label"]`` (``(A,)``; ``info["oracle_waypoints"]`` ``(K, 3)`` for tracking)
      and the label-reliability flags used by DAgger filters in ``info["label_flags"]``; with
      ``replan`` the oracle re-anchors its plan to the robot's actual state before each label (for
      labelling states a policy drove, see :attr:`sim_envs.core.Oracle.replan`); with
      ``label_chunk`` = H > 0 (envs with ``oracle_chunk``, i.e. the arm tasks) also the oracle's own
      next H labels from the returned state, a counterfactual rollout, in ``info["oracle_chunk"]``
      ``(H, A)`` (the last label repeated past the episode's end) and their number in
      ``info["oracle_chunk_len"]``;
    - ``probe_window`` > 0 (with ``oracle``; envs with ``oracle_recovers``, i.e. PersonFollow): when
      an episode ends in collision or loss, asks for each of its last ``probe_window`` states
      whether the oracle taking over there would itself fail within ``probe_horizon`` steps, and
      reports it in the final step's ``info["unrecoverable"]`` ``(probe_window,)`` (1: it would
      fail; oldest first, the last entry the state the final action was taken in; 0 where the
      episode was shorter). Only failed episodes pay for the probes.
    - ``hazard`` (envs with ``hazard_twist``, i.e. PersonFollow): puts a scripted push toward the
      nearest obstacle or wall in ``info["hazard_action"]``, in the env's action format (waypoints
      through a :class:`WaypointFollowWrapper`), for rollouts that visit the states a policy must
      recover from.
    """

    def __init__(self, env: gymnasium.Env, reward: str = "sparse", privileged: bool = False, oracle: bool = False,
                 probe_window: int = 0, probe_horizon: int = 20, replan: bool = False, label_chunk: int = 0,
                 hazard: bool = False):
        super().__init__(env)
        if hazard and not hasattr(env.unwrapped, "hazard_twist"):
            raise ValueError(f"hazard needs an env with hazard_twist(); {type(env.unwrapped).__name__} has none")
        self.hazard = bool(hazard)
        self._waypoints = None  # the waypoint wrapper that hazard pushes are written for
        if hazard:
            from sim_envs.person_follow.waypoints import WaypointFollowWrapper

            inner = env
            while isinstance(inner, gymnasium.Wrapper) and not isinstance(inner, WaypointFollowWrapper):
                inner = inner.env
            self._waypoints = inner if isinstance(inner, WaypointFollowWrapper) else None
        if label_chunk and not (oracle and hasattr(env.unwrapped, "oracle_chunk")):
            raise ValueError(f"label_chunk needs oracle=True and an env with oracle_chunk(); "
                             f"{type(env.unwrapped).__name__} has none")
        self.label_chunk = int(label_chunk)
        if reward not in ("sparse", "dense"):
            raise ValueError(f"reward must be 'sparse' or 'dense', got {reward!r}")
        if probe_window and not (oracle and hasattr(env.unwrapped, "oracle_recovers")):
            raise ValueError(f"probe_window needs oracle=True and an env with oracle_recovers(); "
                             f"{type(env.unwrapped).__name__} has none")
        self.probe_window, self.probe_horizon = int(probe_window), int(probe_horizon)
        self._recent: deque = deque(maxlen=max(self.probe_window, 1))
        self._info: dict = {}
        self.reward_mode, self.privileged = reward, privileged
        self.oracle = None
        if oracle:
            from sim_envs import make_oracle

            self.oracle = make_oracle(env.unwrapped, noise=0.0)
            self.oracle.replan = bool(replan)
        self._own_state = ENV_STATE in env.observation_space.spaces  # the env already observes it
        if privileged and not self._own_state:
            base = env.unwrapped
            dim = base.env_state_dim if hasattr(base, "environment_state") else 4  # see privileged_state
            spaces_ = dict(env.observation_space.spaces)
            spaces_[ENV_STATE] = gymnasium.spaces.Box(-np.inf, np.inf, (dim,), np.float32)
            self.observation_space = gymnasium.spaces.Dict(spaces_)

    def _decorate(self, obs: dict, info: dict, first: bool) -> tuple[dict, dict]:
        obs = dict(obs)
        if self.privileged and not self._own_state:
            obs[ENV_STATE] = privileged_state(self.env, info)
        if self.oracle is not None:
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
        if self.hazard:
            info = dict(info)
            info["hazard_action"] = self._hazard_action(info)
        self._info = info
        return obs, info

    def _hazard_action(self, info: dict) -> np.ndarray:
        """The env's scripted push toward the nearest obstacle or wall, as this env's action."""
        v, w = self.env.unwrapped.hazard_twist(info)
        if self._waypoints is not None:
            from sim_envs.person_follow.waypoints import arc_waypoints

            return arc_waypoints(float(v), float(w), self._waypoints.dt, self._waypoints.num_waypoints)
        return np.array([v, w], np.float32)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self._recent.clear()
        return self._decorate(obs, info, first=True)

    def step(self, action):
        if self.probe_window:
            self._recent.append((self.env.unwrapped.get_state(), self._info))
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self.reward_mode == "sparse":
            reward = float(bool(terminated) and bool(info.get("is_success", False)))
        info = dict(info)
        info["success"] = float(bool(info.get("is_success", False)) and (terminated or truncated))
        obs, info = self._decorate(obs, info, first=False)
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


LABEL_FLAGS = ("target_lost", "near_collision", "target_unseen", "near_obstacle")
NEAR_PERSON = 0.7
"""m: a person this close raises ``near_collision`` (the collision distance is 0.5 m)."""
NEAR_OBSTACLE = 0.5
"""m: the robot's rim this close to an obstacle or wall raises ``near_obstacle``."""


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


def make_refine_env(env: EnvConfig, reward: str = "sparse", privileged: bool = False, oracle: bool = False,
                    waypoints: int | None = None, probe_window: int = 0, probe_horizon: int = 20,
                    replan: bool = False, label_chunk: int = 0, hazard: bool = False) -> gymnasium.Env:
    """One :class:`RefineEnv` (what each vector-env worker unpickles and calls)."""
    inner = make_env(env, render_mode=None)
    if waypoints is not None:
        from sim_envs.person_follow.waypoints import WaypointFollowWrapper

        inner = WaypointFollowWrapper(inner, num_waypoints=int(waypoints))
    return RefineEnv(inner, reward=reward, privileged=privileged, oracle=oracle, probe_window=probe_window,
                     probe_horizon=probe_horizon, replan=replan, label_chunk=label_chunk, hazard=hazard)


def make_vector_envs(env: EnvConfig, num_envs: int, autoreset: bool = True, **kwargs) -> gymnasium.vector.VectorEnv:
    """``num_envs`` copies of :func:`make_refine_env` (spawned workers when > 1): same-step
    autoreset, or none (``autoreset=False``: the caller resets finished envs, with their seeds)."""
    fns = [partial(make_refine_env, env, **kwargs) for _ in range(num_envs)]
    mode = gymnasium.vector.AutoresetMode.SAME_STEP if autoreset else gymnasium.vector.AutoresetMode.DISABLED
    if num_envs == 1:
        return gymnasium.vector.SyncVectorEnv(fns, autoreset_mode=mode)
    return gymnasium.vector.AsyncVectorEnv(fns, context="spawn", shared_memory=False, autoreset_mode=mode)


def step_while(envs: gymnasium.vector.VectorEnv, action: np.ndarray, work: Callable[[], None]):
    """``envs.step(action)`` with ``work()`` run while the workers step (spawned workers), or just
    before the step (one env in this process): the learner's updates overlap the simulation. Either
    way ``work`` sees the state before the step's results, so spawned and in-process envs give the
    same sequence of updates."""
    if isinstance(envs, gymnasium.vector.AsyncVectorEnv):
        envs.step_async(action)
        work()
        return envs.step_wait()
    work()
    return envs.step(action)


def single_spaces(env: EnvConfig, **kwargs) -> tuple[gymnasium.spaces.Dict, gymnasium.spaces.Box]:
    """Observation and action space of one refine env (built once in this process, then closed)."""
    e = make_refine_env(env, **kwargs)
    try:
        return e.observation_space, e.action_space
    finally:
        e.close()


class RewardScaler:
    """Divide rewards by the running std of the discounted return (per env), then clip (ResiP)."""

    def __init__(self, num_envs: int, gamma: float, clip: float = 5.0):
        self.gamma, self.clip = gamma, clip
        self.ret = np.zeros(num_envs)
        self.count, self.mean, self.m2 = 1e-4, 0.0, 0.0

    def __call__(self, reward: np.ndarray, done: np.ndarray) -> np.ndarray:
        self.ret = self.ret * self.gamma + reward
        for x in self.ret:  # Welford over every env's running return
            self.count += 1
            delta = x - self.mean
            self.mean += delta / self.count
            self.m2 += delta * (x - self.mean)
        self.ret[done] = 0.0
        std = math.sqrt(self.m2 / self.count) if self.count > 1 else 1.0
        return np.clip(reward / max(std, 1e-8), -self.clip, self.clip)


def gae(rewards, values, dones, last_value, gamma: float, lam: float, decisions=None):
    """Generalized advantage estimation over a ``(T, N)`` rollout.

    ``dones[t]``: the episode ended with step t (its ``values[t+1]`` belongs to the next episode).
    ``decisions`` ``(T, N)`` (optional, 1 where the policy decided): a decision's action ran until
    the next decision, so the transition is semi-MDP — its reward is the discounted sum of the
    steps up to the next decision (or the episode's end) and the next value is discounted by γ^k.
    Only decision steps get an advantage (0 elsewhere). Without ``decisions`` every step is one,
    which is ordinary GAE. Returns ``(advantages, returns)``, both ``(T, N)`` tensors.
    """
    import torch

    T = rewards.shape[0]
    adv = torch.zeros_like(rewards)
    dec = torch.ones_like(rewards) if decisions is None else decisions.to(rewards.dtype)
    reward_sum = torch.zeros_like(rewards[0])  # from step t to the next decision, discounted to t
    discount = torch.ones_like(rewards[0])  # γ^k to the next decision (0 once an episode ended)
    trace = torch.ones_like(rewards[0])  # λ^k: λ keeps its per-step meaning whatever the decision rate
    next_value, next_adv = last_value, torch.zeros_like(rewards[0])
    for t in reversed(range(T)):
        alive = 1.0 - dones[t]
        reward_sum = rewards[t] + gamma * alive * reward_sum
        discount = gamma * alive * discount
        trace = lam * trace
        delta = reward_sum + discount * next_value - values[t]
        a = delta + trace * discount * next_adv
        d = dec[t]
        adv[t] = d * a
        next_value = d * values[t] + (1 - d) * next_value
        next_adv = d * a + (1 - d) * next_adv
        reward_sum = (1 - d) * reward_sum
        discount = d + (1 - d) * discount
        trace = d + (1 - d) * trace
    return adv, (adv + values) * dec


def ppo_loss(new_logp, old_logp, adv, clip: float, dual_clip: float | None = None):
    """Clipped surrogate (to minimise) and the approximate KL(old || new).

    ``dual_clip`` (c > 1, dual-clip PPO): where the advantage is negative the surrogate is
    bounded below by ``c * adv``, so a sample whose ratio has grown far past the clip range (the
    policy moved by another loss term, or its log-probability is stale) gives no gradient,
    instead of one that grows with the ratio."""
    import torch

    ratio = (new_logp - old_logp).exp()
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    if dual_clip is not None:
        surrogate = torch.where(adv < 0, torch.max(surrogate, dual_clip * adv), surrogate)
    approx_kl = ((ratio - 1) - (new_logp - old_logp)).mean()
    return -surrogate.mean(), approx_kl


@dataclass
class EvalResult:
    success: float
    episodes: int
    env_steps: int
    metrics: dict[str, float] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)
    """Per-episode summaries, in episode (seed) order."""


def evaluate_success(act: Callable[[dict], np.ndarray], reset_rows: Callable[[list[int]], None], env: EnvConfig,
                     episodes: int, num_envs: int, seed: int, **env_kwargs) -> EvalResult:
    """Run ``episodes`` episodes with ``act(obs) -> (N, A)`` env actions; episode ``e`` starts from
    seed ``seed + e`` whichever env runs it, as ``robopolicy eval`` seeds them, so refinement
    curves and evaluation reports measure the same episodes. Every started episode is counted."""
    num_envs = max(1, min(num_envs, episodes))
    envs = make_vector_envs(env, num_envs, autoreset=False, **env_kwargs)
    results: list[dict | None] = [None] * episodes
    row_episode = np.full(num_envs, -1)
    next_episode = 0
    steps = 0

    def start(rows: list[int]) -> dict:
        nonlocal next_episode
        mask = np.zeros(num_envs, dtype=bool)
        seeds: list[int | None] = [None] * num_envs
        for r in rows:
            mask[r] = True
            if next_episode < episodes:
                row_episode[r], seeds[r] = next_episode, seed + next_episode
                next_episode += 1
            else:  # nothing left to run: restart the env anyway (stepping a finished one is invalid)
                row_episode[r], seeds[r] = -1, seed + episodes + r
        obs, _ = envs.reset(seed=seeds, options={"reset_mask": mask})
        reset_rows(rows)
        return obs

    try:
        obs = start(list(range(num_envs)))
        while (row_episode >= 0).any():
            obs, _r, term, trunc, info = envs.step(act(obs))
            steps += int((row_episode >= 0).sum())
            done = np.flatnonzero(np.logical_or(term, trunc))
            if len(done):
                for i in done:
                    if row_episode[i] >= 0:
                        results[row_episode[i]] = _episode_summary(info, int(i))
                obs = start([int(i) for i in done])
    finally:
        envs.close()
    flat = [r for r in results if r is not None]
    return EvalResult(float(np.mean([r["success"] for r in flat])), len(flat), steps, tracking_metrics(flat), flat)


def tracking_metrics(episodes: list[dict]) -> dict[str, float]:
    """Collision / lost rates and the pooled tracking rate of tracking episodes, as the task
    defines them (``sim_envs.person_follow.metrics``); empty for other tasks."""
    if not episodes or not all("following_steps" in e for e in episodes):
        return {}
    pooled = summarize_episodes(episodes)
    return {"collision": pooled["collision_rate"], "person_collision": pooled["person_collision_rate"],
            "lost": pooled["lost_rate"], "tracking_rate": pooled["tracking_rate"]}


def _episode_summary(final_info: dict, i: int) -> dict:
    """Env ``i``'s episode summary from a vector env's last-step info (a dict of per-env arrays)."""
    out = {"success": bool(np.asarray(final_info.get("is_success", np.zeros(i + 1)))[i])}
    em = final_info.get("episode_metrics")
    if isinstance(em, dict):
        for k, v in em.items():
            if k.startswith("_"):
                continue
            val = np.asarray(v)[i]
            if isinstance(val, (bool, int, float, np.number, np.bool_)):
                out[k] = float(val)
        if "success" in out:
            out["success"] = bool(out["success"])
    return out


def save_run_config(method: str, cfg) -> Path:
    """``<out_dir>/refine_config.yaml``: every setting of a run as resolved (config file, overrides,
    defaults), so ``robopolicy refine --method M --config <it>`` runs it again. Written whole or
    not at all, before the run starts."""
    import json

    import yaml

    from robopolicy.config import to_dict
    from robopolicy.utils.files import atomic_write_text

    text = (f"# robopolicy refine --method {method} --config <this file> runs it again\n"
            + yaml.safe_dump(json.loads(json.dumps(to_dict(cfg))), sort_keys=False))
    return atomic_write_text(Path(cfg.out_dir) / "refine_config.yaml", text)


class Curve:
    """Success vs environment steps, written as CSV and PNG."""

    def __init__(self, out_dir: str | Path, name: str = "curve"):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.rows: list[dict[str, float]] = []

    def add(self, env_steps: int, success: float, **extra: float) -> None:
        self.rows.append({"env_steps": int(env_steps), "success": float(success), **extra})
        self.save()

    def steps_to(self, level: float) -> int | None:
        """First env-step count at which success reached ``level`` (``None``: never)."""
        return next((int(r["env_steps"]) for r in self.rows if r["success"] >= level), None)

    def best(self) -> dict[str, float] | None:
        """The evaluation with the highest success after the first row (the starting policy), the
        earliest on ties; ``None`` before any. The curve need not rise, so a run keeps this point's
        policy beside its final one."""
        return max(self.rows[1:], key=lambda r: r["success"], default=None)

    def is_best(self) -> bool:
        """Whether the last evaluation is :meth:`best` (the one to save as ``best/``)."""
        return len(self.rows) > 1 and self.best() is self.rows[-1]

    def best_summary(self, above: float = float("-inf")) -> dict:
        """Summary fields of :meth:`best` and its checkpoint (``best/`` beside the curve); all ``None``
        when there is none or its success is not above ``above``."""
        best = self.best()
        if best is None or best["success"] <= above:
            return {"best": None, "best_env_steps": None, "best_checkpoint": None}
        return {"best": best["success"], "best_env_steps": int(best["env_steps"]),
                "best_checkpoint": str(self.out / "best")}

    def save(self) -> tuple[Path, Path | None]:
        csv_path = self.out / f"{self.name}.csv"
        keys = list(dict.fromkeys(k for r in self.rows for k in r))
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.rows)
        return csv_path, plot_curves({self.name: self.rows}, self.out / f"{self.name}.png")


def plot_curves(curves: dict[str, Sequence[dict]], path: str | Path, title: str = "success vs env steps") -> Path | None:
    """One line per named curve (rows with ``env_steps`` and ``success``); ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in curves.items():
        if rows:
            ax.plot([r["env_steps"] for r in rows], [r["success"] for r in rows], marker="o", label=name)
    ax.set_xlabel("environment steps")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
