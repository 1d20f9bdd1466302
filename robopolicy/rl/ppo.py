"""GAE and the one PPO update (clipped surrogate, target-KL stop) of every on-policy method.

Shapes: rollouts are ``(T, N)`` (steps, envs); the update sees the decisions flattened to ``(M,)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

KL_STOPS = ("actor", "update")


def gae(rewards, values, dones, last_value, gamma: float, lam: float, decisions=None):
    """Generalized advantage estimation over a ``(T, N)`` rollout.

    ``dones[t]``: the episode ended with step t (its ``values[t+1]`` belongs to the next episode).
    ``decisions`` ``(T, N)`` (optional, 1 where the policy decided): a decision's action ran until
    the next decision, so the transition is semi-MDP — its reward is the discounted sum of the
    steps up to the next decision (or the episode's end) and the next value is discounted by γ^k.
    Only decision steps get an advantage (0 elsewhere). Without ``decisions`` every step is one,
    which is ordinary GAE. Returns ``(advantages, returns)``, both ``(T, N)`` tensors.
    """
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
    ratio = (new_logp - old_logp).exp()
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    if dual_clip is not None:
        surrogate = torch.where(adv < 0, torch.max(surrogate, dual_clip * adv), surrogate)
    approx_kl = ((ratio - 1) - (new_logp - old_logp)).mean()
    return -surrogate.mean(), approx_kl


def normalize_advantages(adv: torch.Tensor) -> torch.Tensor:
    """``(M,)`` advantages to zero mean and unit std (one sample: as it is)."""
    return (adv - adv.mean()) / (adv.std() + 1e-8) if len(adv) > 1 else adv


@dataclass
class PPOSettings:
    """One PPO update's settings (each method's config maps its own fields onto these)."""

    epochs: int
    """Passes over the batch of decisions."""
    minibatches: int = 1
    """Minibatches per pass (1: full-batch steps)."""
    clip: float = 0.2
    """The surrogate's ratio clip."""
    target_kl: float = 0.1
    """Approximate KL(old || new) of a minibatch beyond which the update stops (see ``kl_stop``)."""
    kl_stop: str = "actor"
    """What the KL stop ends. ``actor``: the actor's steps only, the critic keeps fitting the
    returns for the remaining epochs (residual PPO and PPO from scratch: cut with the actor, the
    critic fit them in as few as 3 epochs). ``update``: the whole update, critic included, from
    the minibatch that crossed the target on (RPD)."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    max_grad_norm: float = 1.0
    """Gradient norm clip, applied to the actor's and the critic's parameters apart (a large
    critic gradient must not shrink the actor's step)."""
    pg_coef: float = 1.0
    """Weight of the surrogate (0: the actor learns from ``aux`` alone, and no KL stop applies)."""
    dual_clip: float | None = None
    """Dual-clip bound of :func:`ppo_loss` (``None``: plain clipped PPO)."""

    def __post_init__(self):
        if self.kl_stop not in KL_STOPS:
            raise ValueError(f"kl_stop must be one of {list(KL_STOPS)}, got {self.kl_stop!r}")
        if self.epochs < 0 or self.minibatches < 1:
            raise ValueError(f"PPO needs epochs >= 0 and minibatches >= 1, got {self.epochs}, {self.minibatches}")


class AuxLoss(Protocol):
    """An extra actor loss on its own samples (RPD's behaviour-cloning term)."""

    weight: float

    def draw(self) -> Sequence[torch.Tensor]:
        """This epoch's sample indices, one tensor per minibatch (drawn before the decisions')."""

    def loss(self, idx: torch.Tensor) -> torch.Tensor:
        """The loss on the samples ``idx``."""


@dataclass
class Batch:
    """The decisions of one rollout, flattened: ``old_logp``, ``adv`` (normalized) and ``ret``, ``(M,)``."""

    old_logp: torch.Tensor
    adv: torch.Tensor
    ret: torch.Tensor


def ppo_update(logp_of: Callable[[torch.Tensor], torch.Tensor], value_of: Callable[[torch.Tensor], torch.Tensor],
               batch: Batch, optimizers: tuple[torch.optim.Optimizer, torch.optim.Optimizer],
               params: dict[str, list[torch.nn.Parameter]], s: PPOSettings, aux: AuxLoss | None = None) -> dict:
    """Clipped PPO epochs over ``batch``; returns the last minibatch's statistics.

    ``logp_of(idx)``, ``value_of(idx)``: the current policy's log-probabilities and values of the
    decisions ``idx``; ``optimizers``: (actor's, critic's), over ``params["actor"]`` and
    ``params["critic"]``. The loss is ``pg_coef * surrogate + vf_coef * value loss (+ aux.weight *
    aux loss)``; see :attr:`PPOSettings.kl_stop` for what a KL beyond ``target_kl`` ends."""
    opt_actor, opt_critic = optimizers
    m = len(batch.adv)
    stats: dict[str, float] = {}
    actor_on = True
    for epoch in range(s.epochs):
        aux_idx = aux.draw() if aux is not None else None
        chunks = torch.randperm(m).chunk(s.minibatches)
        for j, idx in enumerate(chunks if aux_idx is None else chunks[:len(aux_idx)]):
            loss = torch.zeros(())
            if actor_on:
                pg, kl = ppo_loss(logp_of(idx), batch.old_logp[idx], batch.adv[idx], s.clip, s.dual_clip)
                if s.pg_coef and kl.item() > s.target_kl:
                    if s.kl_stop == "update":
                        return stats
                    actor_on = False
                else:
                    loss = s.pg_coef * pg
                    stats.update(pg_loss=pg.item(), kl=kl.item(), epochs=epoch + 1)
            v_loss = 0.5 * (value_of(idx) - batch.ret[idx]).pow(2).mean()
            loss = loss + s.vf_coef * v_loss
            if actor_on and aux is not None:
                aux_loss = aux.loss(aux_idx[j])
                loss = loss + aux.weight * aux_loss
                stats["aux_loss"] = aux_loss.item()
            opt_actor.zero_grad()
            opt_critic.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params["actor"], s.max_grad_norm)
            torch.nn.utils.clip_grad_norm_(params["critic"], s.max_grad_norm)
            if actor_on:
                opt_actor.step()
            opt_critic.step()
            stats["v_loss"] = v_loss.item()
    return stats
