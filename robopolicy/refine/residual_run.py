"""What the residual refinement loops share (residual PPO, residual TD3): the run's config, the
policy sized for its env, and the evaluation during training (a curve point, ``best/``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from robopolicy.data.features import ENV_STATE
from robopolicy.envs import EnvConfig
from robopolicy.eval.envs import single_spaces
from robopolicy.eval.episodes import EvalResult, evaluate_success
from robopolicy.refine.common import Curve, RefineRunOptions
from robopolicy.refine.residual import ActorCriticPolicy, ResidualConfig, ResidualPolicy
from robopolicy.refine.scratch import ScratchPolicy


@dataclass
class ResidualRunConfig(RefineRunOptions):
    """What every residual refinement loop takes (residual PPO here, residual TD3 in
    :mod:`~robopolicy.refine.residual_td3`): env, base, residual, reward, budget, evaluation."""

    env: EnvConfig = field(default_factory=lambda: EnvConfig("robopolicy/ArmReach-v0"))
    """The task."""
    base: str = ""
    """Base policy checkpoint (frozen); empty: PPO from scratch on the whole action."""
    residual: ResidualConfig = field(default_factory=ResidualConfig)
    """The residual actor-critic and how it acts on the base's command."""
    reward: str = "sparse"
    """``sparse`` (success) or ``dense`` (the task's shaped reward)."""
    total_env_steps: int = 20_000
    """Env steps of training, all envs together."""
    num_envs: int = 4
    """Rollout envs (worker processes when > 1)."""
    gamma: float = 0.99
    """Discount per env step (ResiP uses 0.999 for its ~1000-step episodes; ours last 100-200
    steps); a chunk decision of k steps discounts by γ^k."""
    eval_every: int = 4_000
    """Evaluate every this many env steps (and before training, and at the end)."""
    out: str = "outputs/refine/residual_ppo"
    """Where the curve, ``best/``, ``final/`` and ``summary.json`` go."""


def env_kwargs(cfg: ResidualRunConfig) -> dict:
    return {"reward": cfg.reward, "privileged": "environment_state" in cfg.residual.inputs}


def build_policy(cfg: ResidualRunConfig, base=None) -> ActorCriticPolicy:
    """The residual over ``base`` or ``cfg.base`` (without either: a policy learnt from scratch)
    sized for ``cfg.env``."""
    from robopolicy.models import load_policy

    obs_space, act_space = single_spaces(cfg.env, **env_kwargs(cfg))
    if base is None and cfg.base:
        base = load_policy(cfg.base)
        if isinstance(base, ActorCriticPolicy):
            raise ValueError(f"--base {cfg.base} is already a residual checkpoint; give a plain policy checkpoint")
    state_dim = obs_space["observation.state"].shape[0] if "observation.state" in obs_space.spaces else 0
    env_dim = obs_space[ENV_STATE].shape[0] if ENV_STATE in obs_space.spaces else 0
    if base is None:
        return ScratchPolicy(cfg.residual, act_space.low, act_space.high, state_dim=state_dim, env_state_dim=env_dim)
    return ResidualPolicy(cfg.residual, act_space.low, act_space.high, base=base, state_dim=state_dim,
                          env_state_dim=env_dim)


def evaluate(policy: ActorCriticPolicy, cfg: ResidualRunConfig) -> EvalResult:
    """Deterministic success rate on the fixed evaluation seeds."""
    def act(obs):
        return policy.predict(obs)[:, 0].numpy()
    return evaluate_success(act, policy.reset, cfg.env, cfg.eval_episodes, cfg.eval_envs, cfg.eval_seed,
                            **env_kwargs(cfg))


def periodic_evaluation(policy: ActorCriticPolicy, cfg: ResidualRunConfig, curve: Curve, env_steps: int, t0: float,
                        window: list[int], log: Callable[[str], None], **extra) -> None:
    """Evaluate during training: a curve point, a log line, and the policy saved to ``best/`` when this
    evaluation is the best so far. Beside the deterministic success, the sampled policy's success
    on the training episodes that ended since the last evaluation (``window``: [episodes,
    successes], reset here) shows whether the loop improves its own (noisy) objective."""
    elapsed = policy.elapsed.copy()
    res = evaluate(policy, cfg)
    train_sr = window[1] / max(window[0], 1)
    curve.add(env_steps, res.success, seconds=time.perf_counter() - t0, train_success=train_sr,
              train_episodes=window[0], **extra)
    more = "".join(f"; {v} {k}" for k, v in extra.items())
    log(f"[refine] {env_steps} env steps: success {res.success:.1%} "
        f"(sampled, training: {train_sr:.1%} of {window[0]}{more})")
    if curve.is_best():
        policy.save(Path(cfg.out) / "best")
    window[:] = [0, 0]
    # evaluation used the policy's queues: the training rows plan their chunks afresh, but their
    # episodes go on: keep their step counts
    policy.reset()
    policy.elapsed = elapsed
