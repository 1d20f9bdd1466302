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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from robopolicy.eval.envs import make_task_envs, step_while
from robopolicy.refine.common import Curve
from robopolicy.refine.residual import ResidualConfig, ResidualPolicy
from robopolicy.refine.residual_run import (ResidualRunConfig, build_policy as build_residual, env_kwargs, evaluate,
                                            periodic_evaluation)
from robopolicy.refine.summary import write_refine_summary


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
    out: str = "outputs/refine/residual_td3"

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


class TD3Learner:
    """The critics, the target networks and their updates, on the policy's actor (clipped double Q
    with target-policy smoothing; the actor every ``policy_delay`` critic updates after
    ``critic_warmup``)."""

    def __init__(self, policy: ResidualPolicy, cfg: ResidualTD3Config, rng: np.random.Generator):
        a_dim, d_in = policy.action_loc.shape[0], policy.norm.mean.shape[0]
        self.policy, self.cfg, self.rng = policy, cfg, rng
        self.actor = policy.actor
        self.actor_targ = copy.deepcopy(self.actor).requires_grad_(False)
        self.qs = nn.ModuleList([QNetwork(d_in, a_dim, cfg.critic_hidden) for _ in range(2)])
        self.qs_targ = copy.deepcopy(self.qs).requires_grad_(False)
        self.opt_actor = torch.optim.Adam(self.actor.parameters(), lr=cfg.actor_lr, fused=True)
        self.opt_critic = torch.optim.Adam(self.qs.parameters(), lr=cfg.critic_lr, fused=True)
        self.buffer = ReplayBuffer(cfg.buffer_size, d_in, a_dim)
        self.updates, self.owed = 0, 0.0
        self.stats: dict[str, float] = {}

    def update(self) -> None:
        """One critic update on a sampled batch (and, when due, the actor's and the targets')."""
        cfg, policy, qs = self.cfg, self.policy, self.qs
        b = self.buffer.sample(cfg.batch_size, self.rng)
        x, x_next = policy.norm(b["x"]), policy.norm(b["x_next"])
        with torch.no_grad():
            noise = (torch.randn_like(b["r"]) * cfg.target_noise).clamp(-cfg.target_noise_clip, cfg.target_noise_clip)
            r_next = policy.bounded(self.actor_targ(x_next) + noise)
            q_next = torch.min(self.qs_targ[0](x_next, r_next), self.qs_targ[1](x_next, r_next))
            target = b["ret"] + b["disc"] * (1 - b["done"]) * q_next
        q_loss = sum(((q(x, b["r"]) - target) ** 2).mean() for q in qs)
        self.opt_critic.zero_grad()
        q_loss.backward()
        self.opt_critic.step()
        self.updates += 1
        self.stats["q_loss"] = q_loss.item() / 2
        if self.updates % cfg.policy_delay == 0:
            if self.updates > cfg.critic_warmup:
                r = self.actor(x)
                q = qs[0](x, policy.bounded(r))
                a_loss = -q.mean() + cfg.residual_penalty * r.pow(2).sum(-1).mean()
                self.opt_actor.zero_grad()
                a_loss.backward()
                self.opt_actor.step()
                self.stats.update(q=q.mean().item(), r_rms=r.pow(2).mean().sqrt().item())
            with torch.no_grad():
                for net, targ in ((self.actor, self.actor_targ), (qs, self.qs_targ)):
                    for p, pt in zip(net.parameters(), targ.parameters()):
                        pt.lerp_(p, cfg.tau)

    def owe(self, decisions: int) -> None:
        """``updates_per_decision`` updates per new decision, once ``learning_starts`` are stored."""
        if self.buffer.size >= self.cfg.learning_starts:
            self.owed += self.cfg.updates_per_decision * decisions

    def pay(self) -> None:
        """Run the owed updates (while the workers simulate the step)."""
        while self.owed >= 1.0:
            self.update()
            self.owed -= 1.0


class OpenTransitions:
    """Each env's semi-MDP transition in progress: inputs and residual at its last decision, the
    discounted reward collected since and the discount to now."""

    def __init__(self, n: int, d_in: int, a_dim: int, gamma: float):
        self.x, self.r = np.zeros((n, d_in), np.float32), np.zeros((n, a_dim), np.float32)
        self.ret, self.disc, self.open = np.zeros(n), np.ones(n), np.zeros(n, dtype=bool)
        self.gamma = gamma

    def decide(self, buffer: ReplayBuffer, dec: np.ndarray, x: np.ndarray, r: np.ndarray) -> None:
        """The rows ``dec`` decide now: their previous transition ends at ``x``, a new one starts."""
        close = dec & self.open
        if close.any():
            buffer.add(self.x[close], self.r[close], self.ret[close], self.disc[close], x[close],
                       np.zeros(int(close.sum())))
        self.x[dec], self.r[dec] = x[dec], r[dec]
        self.ret[dec], self.disc[dec], self.open[dec] = 0.0, 1.0, True

    def step(self, reward: np.ndarray) -> None:
        self.ret += self.disc * np.asarray(reward, np.float64)
        self.disc *= self.gamma

    def end(self, buffer: ReplayBuffer, done: np.ndarray) -> None:
        """The rows ``done`` ended their episode: a terminal transition each (the time limit ends an
        episode as a failure: no observation shows the time left)."""
        rows = np.flatnonzero(done & self.open)
        buffer.add(self.x[rows], self.r[rows], self.ret[rows], self.disc[rows], self.x[rows], np.ones(len(rows)))
        self.open[done] = False


def train(cfg: ResidualTD3Config, policy: ResidualPolicy | None = None, log: Callable[[str], None] = print) -> dict:
    """Run residual TD3; returns a summary (before / after success, steps to 80%, paths)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    out, started = Path(cfg.out), time.time()
    policy = policy or build_policy(cfg)
    if policy.base is None or policy.config.bound <= 0:
        raise ValueError("residual TD3 needs a base policy and residual.bound > 0")
    if policy.switch:
        raise ValueError("residual TD3 trains a deterministic continuous residual; residual.switch_dims is for "
                         "residual PPO")
    n, a_dim = cfg.num_envs, policy.action_loc.shape[0]
    learner = TD3Learner(policy, cfg, rng)
    sigma = policy.log_std.detach().exp()
    curve, t0 = Curve(out, "curve"), time.perf_counter()
    before = evaluate(policy, cfg)
    curve.add(0, before.success, seconds=time.perf_counter() - t0)
    log(f"[refine] before: success {before.success:.1%} ({before.episodes} episodes)")

    envs = make_task_envs(cfg.env, n, **env_kwargs(cfg))
    pending = OpenTransitions(n, policy.norm.mean.shape[0], a_dim, cfg.gamma)
    obs, _ = envs.reset(seed=[cfg.seed + i for i in range(n)])
    policy.reset()
    env_steps, next_eval, decisions, episodes = 0, cfg.eval_every, 0, 0
    window = [0, 0]  # sampled training [episodes, successes] since the last evaluation
    bar = tqdm(total=cfg.total_env_steps, unit="step", disable=not cfg.progress, dynamic_ncols=True)
    try:
        while env_steps < cfg.total_env_steps:
            with torch.no_grad():
                x, base_norm = policy.residual_input(obs)
                policy.norm.update(x)
                dec = policy.decides.numpy()
                r = policy.bounded(policy.actor(policy.norm(x)) + sigma * torch.randn(n, a_dim))
                pending.decide(learner.buffer, dec, x.numpy(), r.numpy())
                decisions += int(dec.sum())
                learner.owe(int(dec.sum()))
                action = policy.env_action(base_norm, policy.hold(r))
            obs, reward, term, trunc, info = step_while(envs, action.numpy(), learner.pay)
            pending.step(reward)
            done = np.logical_or(term, trunc)
            if done.any():
                pending.end(learner.buffer, done)
                policy.reset([int(i) for i in np.flatnonzero(done)])
                episodes += int(done.sum())
                window[0] += int(done.sum())
                window[1] += int(np.asarray(info["final_info"].get("is_success", np.zeros(n)))[done].sum())
            env_steps += n
            bar.update(n)
            if learner.updates and env_steps % (64 * n) == 0:
                bar.set_postfix(ep=episodes, train_sr=f"{window[1] / max(window[0], 1):.2f}", upd=learner.updates,
                                **{k: round(v, 3) for k, v in learner.stats.items()})
            if env_steps >= next_eval or env_steps >= cfg.total_env_steps:
                next_eval += cfg.eval_every
                periodic_evaluation(policy, cfg, curve, env_steps, t0, window, log, updates=learner.updates)
    finally:
        bar.close()
        envs.close()
    policy.save(out / "final")
    save_file({k: v.contiguous() for k, v in learner.qs.state_dict().items()}, str(out / "critics.safetensors"))
    summary = {"before": before.success, "after": curve.rows[-1]["success"], "env_steps": env_steps,
               "decisions": decisions, "updates": learner.updates, "steps_to_80": curve.steps_to(0.8),
               "seconds": time.perf_counter() - t0, "checkpoint": str(out / "final"), **curve.best_summary(),
               "curve_csv": str(out / "curve.csv"), "curve_png": str(out / "curve.png")}
    write_refine_summary(cfg, summary, started)
    return summary
