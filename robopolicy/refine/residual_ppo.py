"""Residual PPO over a frozen base policy (ResiP); without a base, PPO from scratch (same loop).

Read top to bottom: the config (beside what every residual loop takes,
:class:`~robopolicy.refine.residual_run.ResidualRunConfig`) → build envs and the policy → for each update: roll out
``num_steps`` steps in ``num_envs`` envs (base action from its chunk + a sampled residual, every
executed step; with ``residual.decision: chunk`` sampled when the base plans a chunk and held over
it) → scale the reward by the running std of the return → GAE over the decisions (semi-MDP for
chunk decisions) → the PPO update of :mod:`robopolicy.rl.ppo` (the KL stop ends the actor's
epochs only) → evaluate every ``eval_every`` env steps → save.

Shapes: ``x (T, N, D_in)`` normalized residual inputs, ``r (T, N, A)`` residual samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from robopolicy.config import ConfigError
from robopolicy.eval.envs import make_task_envs
from robopolicy.refine.common import Curve
from robopolicy.refine.residual import ActorCriticPolicy, init_from
from robopolicy.refine.residual_run import (ResidualRunConfig, build_policy, env_kwargs, evaluate,  # noqa: F401
                                            periodic_evaluation)
from robopolicy.refine.summary import write_refine_summary
from robopolicy.rl import PPOSettings, RewardScaler, gae, ppo_update
from robopolicy.rl.ppo import Batch, normalize_advantages


@dataclass
class ResidualPPOConfig(ResidualRunConfig):
    """Residual PPO (and PPO from scratch when ``base`` is empty)."""

    num_steps: int = 128
    """Rollout length per env per update (batch = num_envs * num_steps)."""
    gae_lambda: float = 0.95
    """GAE's λ (per env step, whatever the decision rate)."""
    clip: float = 0.2
    """The surrogate's ratio clip."""
    update_epochs: int = 20
    """PPO epochs over the full batch (ResiP: 50); the actor's stop early at ``target_kl``, the
    critic's run in full."""
    minibatches: int = 1
    """Minibatches per epoch."""
    target_kl: float = 0.1
    """Approximate KL of a minibatch beyond which the update stops (see ``kl_stop``)."""
    kl_stop: str = "actor"
    """What the KL stop ends (:attr:`robopolicy.rl.PPOSettings.kl_stop`): ``actor``, the actor's
    epochs only (the critic keeps fitting the returns), or ``update``, the whole update (RPD's)."""
    actor_lr: float = 3e-4
    """The actor's Adam learning rate."""
    critic_lr: float = 1e-3
    """Critic learns faster than the actor (ResiP)."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    max_grad_norm: float = 1.0
    """Gradient norm clip, actor and critic apart."""
    reward_clip: float = 5.0
    """Clip of the scaled reward."""
    clipped_likelihood: bool = True
    """Score a sample whose action the box clips by the probability mass beyond the bound (see
    ``ResidualPolicy.log_prob``); False: by its Gaussian density."""
    init_residual: str = ""
    """A residual checkpoint to start from (e.g. an earlier run's ``best/``): its actor, critic and
    input statistics. Its architecture and its base must be this run's; the log-std is
    ``residual.log_std`` (a second stage can explore less). Empty: a fresh residual (zero output)."""
    anneal_lr: bool = False
    """Lower the actor's learning rate linearly to 0 over the run (the critic's stays), so the last
    updates settle instead of moving a policy that is already good."""
    final_log_std: float | None = None
    """Lower the exploration linearly from ``residual.log_std`` to this log-std over the run (None:
    fixed). The sampled policy pays for its noise (a 6 mm tool-point jitter costs PickPlace
    grasps), and the advantage is judged on states that noise reached."""
    stages: list[dict] = field(default_factory=list)
    """Later stages of one command (see :mod:`~robopolicy.refine.stages`): each a mapping of the
    settings that differ from this config, e.g. ``{total_env_steps: 600000, actor_lr: 2.0e-4}``."""

    def __post_init__(self):
        self.ppo()  # checks kl_stop
        if self.final_log_std is not None and not np.isfinite(self.final_log_std):
            raise ValueError(f"final_log_std must be finite, got {self.final_log_std}")
        if self.final_log_std is not None and self.residual.learn_std:
            raise ValueError("final_log_std schedules a fixed log-std: it cannot be used with residual.learn_std")

    def ppo(self) -> PPOSettings:
        """This config's PPO update."""
        return PPOSettings(epochs=self.update_epochs, minibatches=self.minibatches, clip=self.clip,
                           target_kl=self.target_kl, kl_stop=self.kl_stop, vf_coef=self.vf_coef,
                           max_grad_norm=self.max_grad_norm)


def rollout(policy: ActorCriticPolicy, envs, obs: dict, T: int, scaler: RewardScaler, cfg: ResidualPPOConfig,
            window: list[int]) -> tuple[dict, dict[str, torch.Tensor]]:
    """``T`` steps of every env with sampled residuals; the next observation and the ``(T, N)``
    buffers (``x``, ``r``, ``base``, ``logp``, ``val``, ``rew``, ``done``, ``dec``; ``adv``, ``ret``)."""
    n = envs.num_envs
    buf: dict[str, list[torch.Tensor]] = {k: [] for k in ("x", "r", "base", "logp", "val", "rew", "done", "dec")}
    for _ in range(T):
        x, base_norm = policy.residual_input(obs)
        policy.norm.update(x)
        x = policy.norm(x)
        dist = policy.dist(x)
        r = policy.hold(dist.sample(torch.randn(n, dist.mean.shape[1])))  # decision: chunk — held between decisions
        obs, reward, term, trunc, info = envs.step(policy.env_action(base_norm, r).numpy())
        done = np.logical_or(term, trunc)
        for key, value in (("x", x), ("r", r), ("base", base_norm), ("dec", policy.decides.float()),
                           ("logp", policy.log_prob(dist, r, base_norm, clipped=cfg.clipped_likelihood)),
                           ("val", policy.value(x)),
                           ("rew", torch.as_tensor(scaler(np.asarray(reward, np.float64), done), dtype=torch.float32)),
                           ("done", torch.as_tensor(done, dtype=torch.float32))):
            buf[key].append(value)
        if done.any():
            rows = [int(i) for i in np.flatnonzero(done)]
            policy.reset(rows)
            won = np.asarray(info["final_info"].get("is_success", np.zeros(n)), dtype=bool)
            window[0] += len(rows)
            window[1] += int(won[rows].sum())
    out = {k: torch.stack(v) for k, v in buf.items()}
    x_last, _ = policy.residual_input(obs, peek=True)  # the next step acts on these queued actions
    last_value = policy.value(policy.norm(x_last))
    out["adv"], out["ret"] = gae(out["rew"], out["val"], out["done"], last_value, cfg.gamma, cfg.gae_lambda,
                                 out["dec"])
    return obs, out


def update(policy: ActorCriticPolicy, buf: dict[str, torch.Tensor], optimizers, cfg: ResidualPPOConfig) -> dict:
    """The PPO update on the rollout's decisions (every step, or each held correction's first)."""
    keep = buf["dec"].reshape(-1) > 0
    flat = {k: v.reshape(keep.shape[0], *v.shape[2:])[keep] for k, v in buf.items()}
    batch = Batch(flat["logp"], normalize_advantages(flat["adv"]), flat["ret"])

    def logp_of(idx):
        return policy.log_prob(policy.dist(flat["x"][idx]), flat["r"][idx], flat["base"][idx],
                               clipped=cfg.clipped_likelihood)
    return ppo_update(logp_of, lambda idx: policy.value(flat["x"][idx]), batch, optimizers,
                      policy.trainable_parameters(), cfg.ppo())


def train(cfg: ResidualPPOConfig, policy: ActorCriticPolicy | None = None, log: Callable[[str], None] = print) -> dict:
    """Run residual PPO; returns a summary (before / after success, steps to 80%, paths)."""
    from tqdm import tqdm

    if cfg.stages:
        raise ConfigError("a config with stages runs through robopolicy.refine.stages.train (robopolicy refine "
                          "does), which trains each stage with this function")
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    out, started = Path(cfg.out), time.time()
    policy = policy or build_policy(cfg)
    if cfg.init_residual:
        init_from(policy, cfg.init_residual, "init_residual")
    params = policy.trainable_parameters()
    optimizers = (torch.optim.Adam(params["actor"], lr=cfg.actor_lr, eps=1e-5),
                  torch.optim.Adam(params["critic"], lr=cfg.critic_lr, eps=1e-5))
    start_log_std = policy.log_std.detach().clone()
    curve, t0 = Curve(out, "curve"), time.perf_counter()
    before = evaluate(policy, cfg)
    curve.add(0, before.success, seconds=time.perf_counter() - t0)
    log(f"[refine] before: success {before.success:.1%} ({before.episodes} episodes)")

    envs = make_task_envs(cfg.env, cfg.num_envs, **env_kwargs(cfg))
    scaler = RewardScaler(cfg.num_envs, cfg.gamma, cfg.reward_clip)
    obs, _ = envs.reset(seed=[cfg.seed + i for i in range(cfg.num_envs)])
    policy.reset()
    env_steps, next_eval, window = 0, cfg.eval_every, [0, 0]  # window: sampled training [episodes, successes]
    bar = tqdm(total=cfg.total_env_steps, unit="step", disable=not cfg.progress, dynamic_ncols=True)
    try:
        while env_steps < cfg.total_env_steps:
            done_frac = env_steps / cfg.total_env_steps
            if cfg.anneal_lr:
                optimizers[0].param_groups[0]["lr"] = cfg.actor_lr * (1.0 - done_frac)
            if cfg.final_log_std is not None:
                policy.log_std.data.copy_(start_log_std + done_frac * (cfg.final_log_std - start_log_std))
            with torch.no_grad():
                obs, buf = rollout(policy, envs, obs, cfg.num_steps, scaler, cfg, window)
            env_steps += cfg.num_steps * cfg.num_envs
            bar.update(cfg.num_steps * cfg.num_envs)
            stats = update(policy, buf, optimizers, cfg)
            bar.set_postfix(train_sr=f"{window[1] / max(window[0], 1):.2f}", **{k: round(v, 3) for k, v in stats.items()})
            if env_steps >= next_eval or env_steps >= cfg.total_env_steps:
                next_eval += cfg.eval_every
                periodic_evaluation(policy, cfg, curve, env_steps, t0, window, log)
    finally:
        bar.close()
        envs.close()
    policy.save(out / "final")
    summary = {"before": before.success, "after": curve.rows[-1]["success"], "env_steps": env_steps,
               "steps_to_80": curve.steps_to(0.8), "seconds": time.perf_counter() - t0,
               "checkpoint": str(out / "final"), **curve.best_summary(),
               "curve_csv": str(out / "curve.csv"), "curve_png": str(out / "curve.png")}
    write_refine_summary(cfg, summary, started)
    return summary
