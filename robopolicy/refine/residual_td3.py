"""Off-policy residual RL over a frozen base policy: TD3 on the residual (sparse reward).

The same residual as residual PPO (:class:`~robopolicy.refine.residual.ResidualPolicy`: frozen base
chunks from a queue, a zero-initialised correction added in normalized action space), trained
from a replay buffer instead of on-policy batches. Every visited decision is reused for many
updates, so a sparse success signal that PPO would have to see in thousands of fresh episodes
is propagated by the critic's bootstrapped targets instead.

Read top to bottom: build envs and the policy → every env step: the rows that decide (every
step; with ``residual.decision: chunk`` each base chunk's first step, and every
``residual.decision_every`` steps of it when set) close their previous
transition (semi-MDP: the discounted reward collected since, γ^k to now) and draw a correction
``actor(x) + σ·ε`` → step the envs, and while the workers simulate, after ``learning_starts``
decisions, ``updates_per_decision`` critic updates per new decision (clipped double Q with
target-policy smoothing, LayerNorm critics), the actor every ``policy_delay`` of them once
``critic_warmup`` are done (maximise Q, plus ``residual_penalty`` × the squared correction, which
keeps it near the base where the critic knows nothing) → evaluate
every ``eval_every`` env steps (the best evaluation's policy kept in ``best/``) → save the policy
(base + residual, like residual PPO) and the critics.

Shapes: ``x (B, D_in)`` raw residual inputs (normalized when sampled), ``r (B, A)`` residuals.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from robopolicy.refine.common import Curve, make_vector_envs, step_while
from robopolicy.refine.residual import ResidualConfig, ResidualPolicy
from robopolicy.refine.residual_ppo import (ResidualRunConfig, build_policy as build_residual, env_kwargs, evaluate,
                                            periodic_evaluation)


@dataclass
class ResidualTD3Config(ResidualRunConfig):
    """Residual TD3 (a base policy is required; ``residual.log_std`` is the fixed exploration noise,
    ``residual.bound`` the residual's range in training and at inference)."""

    residual: ResidualConfig = field(default_factory=lambda: ResidualConfig(bound=1.0))
    buffer_size: int = 300_000
    """Decisions kept."""
    batch_size: int = 256
    learning_starts: int = 2_000
    """Decisions collected (the base with exploration noise) before the first update."""
    updates_per_decision: float = 1.0
    """Critic updates per new decision (update-to-data ratio)."""
    policy_delay: int = 2
    critic_warmup: int = 0
    """Critic updates before the actor's first: the critics first learn the base's values, so the
    actor does not follow an untrained critic's gradient away from the base."""
    actor_lr: float = 3e-4
    critic_lr: float = 3e-4
    critic_hidden: list[int] = field(default_factory=lambda: [256, 256])
    tau: float = 0.005
    """Polyak rate of the target networks."""
    target_noise: float = 0.2
    target_noise_clip: float = 0.5
    """Target-policy smoothing, in residual units (before ``residual.scale``)."""
    residual_penalty: float = 0.1
    """Actor loss weight of the mean squared residual: stay at the base unless the critic says better."""
    out_dir: str = "outputs/refine/residual_td3"

    def __post_init__(self):
        for key in ("total_env_steps", "num_envs", "buffer_size", "batch_size", "policy_delay", "eval_every",
                    "eval_episodes", "eval_envs"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.critic_warmup < 0:
            raise ValueError(f"critic_warmup must be >= 0, got {self.critic_warmup}")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma}")
        if self.updates_per_decision <= 0:
            raise ValueError(f"updates_per_decision must be > 0, got {self.updates_per_decision}")
        if self.residual.bound <= 0:
            raise ValueError("residual TD3 needs residual.bound > 0 (the residual's range, e.g. 1.0)")
        if self.reward not in ("sparse", "dense"):
            raise ValueError(f"reward must be 'sparse' or 'dense', got {self.reward!r}")


class QNetwork(nn.Module):
    """Q(x, r): an MLP with LayerNorm after every hidden layer (stable under many updates per sample)."""

    def __init__(self, d_in: int, a_dim: int, hidden: list[int]):
        super().__init__()
        layers: list[nn.Module] = []
        sizes = [d_in + a_dim, *hidden]
        for i in range(len(hidden)):
            layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.LayerNorm(sizes[i + 1]), nn.ReLU()]
        layers.append(nn.Linear(sizes[-1], 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, r], dim=-1)).squeeze(-1)


class ReplayBuffer:
    """Semi-MDP transitions ``(x, r, R, discount, x_next, done)`` in a ring of ``capacity``."""

    def __init__(self, capacity: int, d_in: int, a_dim: int):
        self.x = np.zeros((capacity, d_in), np.float32)
        self.x_next = np.zeros((capacity, d_in), np.float32)
        self.r = np.zeros((capacity, a_dim), np.float32)
        self.ret = np.zeros(capacity, np.float32)
        self.disc = np.zeros(capacity, np.float32)
        self.done = np.zeros(capacity, np.float32)
        self.capacity, self.size, self.pos = capacity, 0, 0

    def add(self, x, r, ret, disc, x_next, done) -> None:
        idx = (self.pos + np.arange(len(ret))) % self.capacity
        self.x[idx], self.r[idx], self.ret[idx], self.disc[idx] = x, r, ret, disc
        self.x_next[idx], self.done[idx] = x_next, done
        self.pos = int(idx[-1] + 1) % self.capacity if len(idx) else self.pos
        self.size = min(self.size + len(idx), self.capacity)

    def sample(self, n: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        idx = rng.integers(0, self.size, n)
        return {k: torch.as_tensor(getattr(self, k)[idx]) for k in ("x", "r", "ret", "disc", "x_next", "done")}


def build_policy(cfg: ResidualTD3Config) -> ResidualPolicy:
    if not cfg.base:
        raise ValueError("residual TD3 needs a base policy (base=CKPT)")
    return build_residual(cfg)


def train(cfg: ResidualTD3Config, policy: ResidualPolicy | None = None, log: Callable[[str], None] = print) -> dict:
    """Run residual TD3; returns a summary (before / after success, steps to 80%, paths)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    policy = policy or build_policy(cfg)
    if policy.base is None or policy.config.bound <= 0:
        raise ValueError("residual TD3 needs a base policy and residual.bound > 0")
    if policy.switch:
        raise ValueError("residual TD3 trains a deterministic continuous residual; residual.switch_dims is for "
                         "residual PPO")
    a_dim, d_in = policy.action_loc.shape[0], policy.norm.mean.shape[0]
    actor = policy.actor
    actor_targ = copy.deepcopy(actor).requires_grad_(False)
    qs = nn.ModuleList([QNetwork(d_in, a_dim, cfg.critic_hidden) for _ in range(2)])
    qs_targ = copy.deepcopy(qs).requires_grad_(False)
    opt_actor = torch.optim.Adam(actor.parameters(), lr=cfg.actor_lr, fused=True)
    opt_critic = torch.optim.Adam(qs.parameters(), lr=cfg.critic_lr, fused=True)
    sigma = policy.log_std.detach().exp()
    buffer = ReplayBuffer(cfg.buffer_size, d_in, a_dim)
    curve = Curve(out, "curve")
    t0 = time.perf_counter()

    before = evaluate(policy, cfg)
    curve.add(0, before.success, seconds=time.perf_counter() - t0)
    log(f"[refine] before: success {before.success:.1%} ({before.episodes} episodes)")

    n = cfg.num_envs
    envs = make_vector_envs(cfg.env, n, **env_kwargs(cfg))
    # each row's open transition: inputs and residual at its last decision, reward and discount since
    pend_x, pend_r = np.zeros((n, d_in), np.float32), np.zeros((n, a_dim), np.float32)
    pend_ret, pend_disc, pend_open = np.zeros(n), np.ones(n), np.zeros(n, dtype=bool)
    obs, _ = envs.reset(seed=[cfg.seed + i for i in range(n)])
    policy.reset()
    env_steps, next_eval, decisions, updates, owed = 0, cfg.eval_every, 0, 0, 0.0
    episodes, window_episodes, window_successes = 0, 0, 0
    stats: dict[str, float] = {}
    bar = tqdm(total=cfg.total_env_steps, unit="step", disable=not cfg.progress, dynamic_ncols=True)

    def update() -> None:
        nonlocal updates
        b = buffer.sample(cfg.batch_size, rng)
        x, x_next = policy.norm(b["x"]), policy.norm(b["x_next"])
        with torch.no_grad():
            noise = (torch.randn_like(b["r"]) * cfg.target_noise).clamp(-cfg.target_noise_clip, cfg.target_noise_clip)
            r_next = policy.bounded(actor_targ(x_next) + noise)
            q_next = torch.min(qs_targ[0](x_next, r_next), qs_targ[1](x_next, r_next))
            target = b["ret"] + b["disc"] * (1 - b["done"]) * q_next
        q_loss = sum(((q(x, b["r"]) - target) ** 2).mean() for q in qs)
        opt_critic.zero_grad()
        q_loss.backward()
        opt_critic.step()
        updates += 1
        stats["q_loss"] = q_loss.item() / 2
        if updates % cfg.policy_delay == 0:
            if updates > cfg.critic_warmup:
                r = actor(x)
                q = qs[0](x, policy.bounded(r))
                a_loss = -q.mean() + cfg.residual_penalty * r.pow(2).sum(-1).mean()
                opt_actor.zero_grad()
                a_loss.backward()
                opt_actor.step()
                stats.update(q=q.mean().item(), r_rms=r.pow(2).mean().sqrt().item())
            with torch.no_grad():
                for net, targ in ((actor, actor_targ), (qs, qs_targ)):
                    for p, pt in zip(net.parameters(), targ.parameters()):
                        pt.lerp_(p, cfg.tau)

    def owed_updates() -> None:
        nonlocal owed
        while owed >= 1.0:
            update()
            owed -= 1.0

    try:
        while env_steps < cfg.total_env_steps:
            with torch.no_grad():
                x, base_norm = policy.residual_input(obs)
                policy.norm.update(x)
                dec = policy.decides.numpy()
                close = dec & pend_open
                if close.any():  # a row that decides again ends its previous decision here
                    buffer.add(pend_x[close], pend_r[close], pend_ret[close], pend_disc[close],
                               x.numpy()[close], np.zeros(int(close.sum())))
                r = policy.bounded(actor(policy.norm(x)) + sigma * torch.randn(n, a_dim))
                pend_x[dec], pend_r[dec] = x.numpy()[dec], r.numpy()[dec]
                pend_ret[dec], pend_disc[dec], pend_open[dec] = 0.0, 1.0, True
                decisions += int(dec.sum())
                owed += cfg.updates_per_decision * int(dec.sum()) if buffer.size >= cfg.learning_starts else 0.0
                action = policy.env_action(base_norm, policy.hold(r))
            # the owed updates run while the workers simulate the step
            obs, reward, term, trunc, info = step_while(envs, action.numpy(), owed_updates)
            pend_ret += pend_disc * np.asarray(reward, np.float64)
            pend_disc *= cfg.gamma
            done = np.logical_or(term, trunc)
            if done.any():
                rows = np.flatnonzero(done & pend_open)
                # the time limit ends an episode as a failure: no observation shows the time left
                buffer.add(pend_x[rows], pend_r[rows], pend_ret[rows], pend_disc[rows], pend_x[rows],
                           np.ones(len(rows)))
                pend_open[done] = False
                policy.reset([int(i) for i in np.flatnonzero(done)])
                won = int(np.asarray(info["final_info"].get("is_success", np.zeros(n)))[done].sum())
                episodes += int(done.sum())
                window_episodes += int(done.sum())
                window_successes += won
            env_steps += n
            bar.update(n)
            if updates and env_steps % (64 * n) == 0:
                bar.set_postfix(ep=episodes, train_sr=f"{window_successes / max(window_episodes, 1):.2f}",
                                upd=updates, **{k: round(v, 3) for k, v in stats.items()})

            if env_steps >= next_eval or env_steps >= cfg.total_env_steps:
                next_eval += cfg.eval_every
                periodic_evaluation(policy, cfg, curve, env_steps, t0, window_episodes, window_successes, log,
                                    updates=updates)
                window_episodes, window_successes = 0, 0
    finally:
        bar.close()
        envs.close()
    policy.save(out / "final")
    save_file({k: v.contiguous() for k, v in qs.state_dict().items()}, str(out / "critics.safetensors"))
    summary = {"before": before.success, "after": curve.rows[-1]["success"], "env_steps": env_steps, "decisions": decisions,
               "updates": updates, "steps_to_80": curve.steps_to(0.8), "seconds": time.perf_counter() - t0,
               "checkpoint": str(out / "final"), **curve.best_summary(), "curve_csv": str(out / "curve.csv"),
               "curve_png": str(out / "curve.png")}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
