"""The one evaluation loop: seeded episodes over a vector of :class:`~robopolicy.eval.envs.EvalEpisode` envs.

    records, steps = run_episodes(envs, actor, seeds=[100000 + i for i in range(50)])
    result = evaluate_success(act, reset_rows, EnvConfig("robopolicy/ArmReach-v0"), episodes=20,
                              num_envs=2, seed=100000, reward="sparse")    # refinement's evaluations

W envs step together (autoreset off). Each env runs one episode at a time; episode i has seed
``seeds[i]`` whatever W is, so two policies (or two worker counts) see the same scenes. When an
env finishes, it takes the next seed at once if the actor resets one batch row at a time;
otherwise the envs run in waves and the whole actor is reset between them. A finished env with no
episode left is parked (it returns its last observation) while the others run on. The actor
always sees the full batch of W observations. (With ``backend: ray`` each Ray worker runs this
loop over one env, one seed per call: :func:`robopolicy.eval.rollout.episode_on_worker`.)
"""

from __future__ import annotations

import json
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from robopolicy.envs import EnvConfig
from robopolicy.eval.envs import EPISODE_INFO, SUCCESS_KEYS, EvalEnvSpec, make_eval_vector_env
from sim_envs.person_follow.metrics import summarize_episodes


class Actor(Protocol):
    """What :func:`run_episodes` drives: one action per env row each step."""

    def act(self, obs: Any, active: np.ndarray) -> np.ndarray:
        """Actions ``(W, *action_shape)`` for every row of the batch ``obs`` (only ``active`` rows'
        are executed)."""

    def reset(self, rows: list[int] | None) -> None:
        """Forget the episode state of ``rows`` (``None``: all)."""


def run_episodes(envs, actor: Actor, seeds: Sequence[int], per_row_reset: bool = True,
                 on_finish: Callable[[int], None] | None = None) -> tuple[list[dict], int]:
    """Run one episode per seed; returns the episode summaries (in seed order) and the number of
    env steps taken by running episodes. ``on_finish(n)`` is called as ``n`` episodes end."""
    width = envs.num_envs
    pending = deque(range(len(seeds)))
    row_episode = np.full(width, -1)
    records: list[dict | None] = [None] * len(seeds)
    env_steps = 0

    def start(rows: list[int], obs: Any) -> Any:
        mask = np.zeros(width, dtype=bool)
        row_seeds: list[int | None] = [None] * width
        for r in rows:
            if pending:
                e = pending.popleft()
                row_episode[r], row_seeds[r], mask[r] = e, int(seeds[e]), True
        if not mask.any():
            return obs
        obs, _ = envs.reset(seed=row_seeds, options={"reset_mask": mask})
        started = [int(r) for r in np.flatnonzero(mask)]
        actor.reset(None if len(started) == width else started)
        return obs

    obs = start(list(range(width)), None)
    while (row_episode >= 0).any():
        active = np.flatnonzero(row_episode >= 0)
        obs, _reward, _term, _trunc, infos = envs.step(actor.act(obs, active))
        env_steps += len(active)
        done_mask = infos.get(f"_{EPISODE_INFO}")
        if done_mask is None or not np.any(done_mask):
            continue
        finished = [int(r) for r in np.flatnonzero(done_mask) if row_episode[r] >= 0]
        for r in finished:
            records[row_episode[r]] = json.loads(infos[EPISODE_INFO][r])
            row_episode[r] = -1
        if on_finish is not None and finished:
            on_finish(len(finished))
        if per_row_reset:
            obs = start(finished, obs)
        elif (row_episode < 0).all():
            obs = start(list(range(width)), obs)
    return [r for r in records if r is not None], env_steps


def unreported_success(records: list[dict]) -> str | None:
    """A warning when the env reported success under none of :data:`SUCCESS_KEYS`, else ``None``."""
    if records and not any(r.get("success_reported", True) for r in records):
        return (f"the env reported neither info[{SUCCESS_KEYS[0]!r}] nor info[{SUCCESS_KEYS[1]!r}] in "
                f"{len(records)} episodes: every episode counts as a failure (success rates are 0 for that reason)")
    return None


# ----------------------------------------------------------------------------- refinement's evaluations
@dataclass
class EvalResult:
    success: float
    episodes: int
    env_steps: int
    metrics: dict[str, float] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)
    """Per-episode summaries, in episode (seed) order: ``success`` and the task's scalar
    ``episode_metrics``."""


class _CallableActor:
    def __init__(self, act: Callable[[Any], np.ndarray], reset_rows: Callable[[list[int]], None]):
        self._act, self._reset = act, reset_rows
        self.width = 0

    def act(self, obs: Any, active: np.ndarray) -> np.ndarray:
        return self._act(obs)

    def reset(self, rows: list[int] | None) -> None:
        self._reset(list(range(self.width)) if rows is None else rows)


def evaluate_success(act: Callable[[Any], np.ndarray], reset_rows: Callable[[list[int]], None], env: EnvConfig,
                     episodes: int, num_envs: int, seed: int, waypoints: int | None = None,
                     **task: Any) -> EvalResult:
    """Run ``episodes`` episodes with ``act(obs) -> (N, A)`` env actions in task envs (``task``:
    the task wrappers' settings, :func:`sim_envs.wrappers.wrap_task`); episode ``e`` starts from
    seed ``seed + e`` whichever env runs it, as ``robopolicy eval`` seeds them, so refinement
    curves and evaluation reports measure the same episodes."""
    num_envs = max(1, min(num_envs, episodes))
    spec = EvalEnvSpec(env=env, mapping=None, waypoints=waypoints, task=task, render_mode=None)
    envs = make_eval_vector_env(spec, num_envs)
    actor = _CallableActor(act, reset_rows)
    actor.width = num_envs
    try:
        summaries, steps = run_episodes(envs, actor, [seed + e for e in range(episodes)])
    finally:
        envs.close()
    message = unreported_success(summaries)
    if message:
        warnings.warn(f"{env.id}: {message}", stacklevel=2)
    flat = [_episode_record(s) for s in summaries]
    return EvalResult(float(np.mean([r["success"] for r in flat])), len(flat), steps, tracking_metrics(flat), flat)


def _episode_record(summary: dict) -> dict:
    """An episode summary of :class:`EvalEpisode` as refinement reads it: ``success`` and the
    scalar ``episode_metrics``."""
    out = {"success": bool(summary["success"])}
    for k, v in (summary.get("episode_metrics") or {}).items():
        if isinstance(v, (bool, int, float)) and not k.startswith("_"):
            out[k] = float(v)
    out["success"] = bool(out["success"])
    return out


def tracking_metrics(episodes: list[dict]) -> dict[str, float]:
    """Collision / lost rates and the pooled tracking rate of tracking episodes, as the task
    defines them (``sim_envs.person_follow.metrics``); empty for other tasks."""
    if not episodes or not all("following_steps" in e for e in episodes):
        return {}
    pooled = summarize_episodes(episodes)
    return {"collision": pooled["collision_rate"], "person_collision": pooled["person_collision_rate"],
            "lost": pooled["lost_rate"], "tracking_rate": pooled["tracking_rate"]}
