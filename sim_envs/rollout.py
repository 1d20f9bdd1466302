"""Run oracle episodes and summarise them: shared by `robopolicy sim`, collection and benches."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import gymnasium
import numpy as np

from sim_envs.core import make_oracle


@dataclass
class EpisodeResult:
    """What one oracle episode produced (frames only when asked for)."""

    seed: int
    steps: int
    success: bool
    episode_metrics: dict[str, Any]
    task: str
    seconds: float
    frames: list[np.ndarray] = field(default_factory=list)


def run_oracle_episode(
    env: gymnasium.Env,
    seed: int,
    noise: float = 0.0,
    render: bool = False,
    on_step: Callable[[dict, dict, Any], None] | None = None,
) -> EpisodeResult:
    """Roll out the env's oracle for one seeded episode.

    ``on_step(obs, info, oracle_step)`` is called before each action is executed (a recorder
    hooks in here); ``render=True`` keeps ``env.render()`` frames for a video.
    """
    oracle = make_oracle(env, noise=noise, seed=seed)
    t0 = time.perf_counter()
    obs, info = env.reset(seed=seed)
    oracle.reset(obs, info)
    frames = [env.render()] if render else []
    task = str(obs.get("task", "")) if isinstance(obs, dict) else ""
    steps = 0
    while True:
        decision = oracle.act(obs, info)
        if on_step is not None:
            on_step(obs, info, decision)
        obs, _reward, terminated, truncated, info = env.step(decision.action)
        steps += 1
        if render:
            frames.append(env.render())
        if terminated or truncated:
            break
    metrics = dict(info.get("episode_metrics", {}))
    return EpisodeResult(
        seed=seed,
        steps=steps,
        success=bool(info.get("is_success", False)),
        episode_metrics=metrics,
        task=task,
        seconds=time.perf_counter() - t0,
        frames=frames,
    )


def summarize(env_id: str, results: Sequence[EpisodeResult]) -> dict[str, float]:
    """Task-appropriate summary: tracking metrics for PersonFollow, success/time for the arm."""
    if not results:
        return {"episodes": 0}
    if "PersonFollow" in env_id:
        from sim_envs.person_follow.metrics import summarize_episodes

        return summarize_episodes([r.episode_metrics for r in results])
    successes = [r for r in results if r.success]
    out = {
        "episodes": len(results),
        "success_rate": len(successes) / len(results),
        "mean_steps_to_success": float(np.mean([r.steps for r in successes])) if successes else float("nan"),
    }
    if any("wrong_object" in r.episode_metrics for r in results):  # PickPlace: another cube than the named one lifted
        out["wrong_object_rate"] = sum(bool(r.episode_metrics.get("wrong_object", False)) for r in results) / len(results)
    return out
