"""One policy in one env, a step at a time, executed as ``robopolicy eval`` executes it.

    policy = load_policy(checkpoint)
    env = make_diagnosis_env(policy, EnvConfig("robopolicy/ArmPickPlace-v0"))
    actor = PolicyActor(policy)
    obs, info = env.reset(seed=100_000)
    actor.reset()
    action = actor.act(obs)          # (A,) or (K, 3) waypoints; actor.decided: a fresh prediction

A diagnosis needs the env's full ``info`` on every step (scene state, contacts), which the
evaluation's episode wrapper keeps to itself, so the env here is the task env itself (plus the
waypoint follower for a waypoint policy), made with the kwargs evaluation would pass.
"""

from __future__ import annotations

from typing import Any, Mapping

import gymnasium
import numpy as np

from hardware.control.chunking import ChunkExecutor
from robopolicy.envs import EnvConfig, make_env
from robopolicy.eval.config import EvalConfig
from robopolicy.eval.policy_runner import PolicyRunner
from robopolicy.eval.rollout import split_env_config, waypoint_count


def make_diagnosis_env(policy: Any, env: EnvConfig) -> gymnasium.Env:
    """The task env with the kwargs evaluation derives from the checkpoint (cameras, scene state,
    image size), wrapped in the waypoint follower when the policy predicts waypoints."""
    split = env.kwargs.get("split")
    cfg = split_env_config(EvalConfig(env=env, videos=0, render_size=None), split, policy)
    task = make_env(cfg, render_mode=None)
    if PolicyRunner(policy).kind == "waypoints":
        from sim_envs.person_follow.waypoints import WaypointFollowWrapper

        task = WaypointFollowWrapper(task, num_waypoints=waypoint_count(policy))
    return task


def batched(obs: Mapping[str, Any]) -> dict[str, Any]:
    """One env's observation as a batch of one, the shape a vector env returns."""
    return {k: [v] if isinstance(v, str) else np.asarray(v)[None] for k, v in obs.items()}


class PolicyActor:
    """A policy's action for each step of one env: predicts when the executor's chunk runs out."""

    def __init__(self, policy: Any, steps_per_chunk: int | None = None):
        self.runner = PolicyRunner(policy)
        self.executor = ChunkExecutor("chunk", steps_per_chunk, kind=self.runner.kind, n_envs=1)
        self.every_step = self.runner.has_context and not self.runner.can_observe
        self.decided = False

    def reset(self) -> None:
        """Start of an episode: forget chunks and temporal context."""
        self.executor.reset()
        self.runner.reset()

    def act(self, obs: Mapping[str, Any]) -> np.ndarray:
        """The action to execute for ``obs`` (a float64 copy the caller may edit)."""
        self.decided = bool(self.executor.needs()[0])
        batch = batched(obs)
        if self.decided or self.every_step:
            chunks = self.runner.predict(batch)
            if self.decided:
                self.executor.add([0], chunks)
        else:
            self.runner.observe(batch)
        return self.executor.next()[0].astype(np.float64)
