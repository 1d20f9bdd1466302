"""A latent world model of a task with state observations (TD-MPC2's design, or a Koopman one).

    model = WorldModel(obs_dim=4, act_dim=2, cfg=WorldModelConfig(), obs_mean=m, obs_std=s)
    z = model.encode(obs)                  # (B, D) -> (B, L)
    z1 = model.next(z, a)                  # (B, L), (B, A) -> (B, L)
    r, p = model.reward(z, a), model.success(z1)   # (B,), (B,) logit of "success after the step"
    q = model.Q(z, a, "min")               # (B,) the lower of two Q heads drawn from the ensemble

The default (``kind: tdmpc2``) has no decoder: the encoder is trained only through the latent
consistency of a multi-step rollout, reward, success and value losses; its latent is split in
groups, each a softmax (SimNorm). Reward and Q heads predict a distribution over ``num_bins`` bins
in symlog space, trained by cross-entropy against two-hot targets (TD-MPC2's discrete regression:
its gradients do not shrink with the reward's scale, which keeps the latent from collapsing onto
what consistency alone can predict). ``kind: koopman`` lifts the state (an MLP's features beside the
state itself) and moves it linearly, ``z' = A z + B a`` (KORR's light option). ``decode_state`` is
a small read-out of the state, trained on detached latents, so that evaluation can report an
error in state units; no reconstruction gradient reaches the encoder.

A checkpoint is one directory: ``config.yaml`` (``type: world-model``, sizes, config) and
``model.safetensors`` (weights and the observation normalisation, which are buffers).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from robopolicy.config import build, load_yaml, to_dict
from robopolicy.utils.files import atomic_write_bytes, atomic_write_text

CHECKPOINT_TYPE = "world-model"
WEIGHTS_FILE, CONFIG_FILE = "model.safetensors", "config.yaml"


class WorldModelError(ValueError):
    """A world model does not fit its input (dataset keys, env or policy sizes, a diverged rollout)."""


@dataclass
class WorldModelConfig:
    """Sizes and loss weights of the world model (one set for every task)."""

    kind: Literal["tdmpc2", "koopman"] = "tdmpc2"
    """tdmpc2: MLP dynamics over SimNorm latents; koopman: lifted state with linear dynamics."""
    latent_dim: int = 64
    """Size of the latent z."""
    hidden: list[int] = field(default_factory=lambda: [256, 256])
    """Hidden layers of every MLP (encoder, dynamics, heads)."""
    simnorm_dim: int = 8
    """SimNorm group size (tdmpc2): the latent is latent_dim / simnorm_dim softmaxes."""
    num_q: int = 5
    """Q heads in the ensemble."""
    gamma: float = 0.97
    """Discount of the value heads and of imagined returns."""
    rho: float = 0.5
    """Weight decay over the rollout horizon: step k of the losses weighs rho**k."""
    consistency_coef: float = 20.0
    reward_coef: float = 0.1
    success_coef: float = 1.0
    value_coef: float = 0.1
    tau: float = 0.01
    """Polyak rate of the target Q heads."""
    log_std_min: float = -5.0
    log_std_max: float = 1.0
    num_bins: int = 101
    """Bins of the two-hot reward and Q distributions (1: plain MSE regression of a scalar)."""
    vmin: float = -10.0
    vmax: float = 10.0
    """Range of the bins, in symlog space (symlog(x) = sign(x) log(1 + |x|))."""
    dropout: float = 0.01
    """Dropout after the first layer of each Q head."""
    enc_lr_scale: float = 0.3
    """The encoder's learning rate relative to the rest."""


class Mish(nn.Module):
    """``x tanh(softplus(x))`` written with one exp, ``x n (n + 2) / (n (n + 2) + 2)`` with ``n = e^x``: the
    same values as ``nn.Mish`` (to 1e-6) in less CPU time, which the planner's small batches feel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = torch.exp(x.clamp(max=20.0))
        t = n * (n + 2)
        return x * t / (t + 2)


def mlp(sizes: list[int], out_act: nn.Module | None = None, dropout: float = 0.0) -> nn.Sequential:
    """Linear + LayerNorm + Mish between every pair of sizes (dropout after the first), a plain Linear
    last (then ``out_act``)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers += [nn.LayerNorm(b), Mish()]
            if i == 0 and dropout > 0:
                layers.append(nn.Dropout(dropout))
    if out_act is not None:
        layers.append(out_act)
    return nn.Sequential(*layers)


def symlog(x: torch.Tensor) -> torch.Tensor:
    """``sign(x) log(1 + |x|)``: squashes large magnitudes, keeps small ones."""
    return torch.sign(x) * torch.log1p(x.abs())


def symexp(x: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`symlog`."""
    return torch.sign(x) * torch.expm1(x.abs())


def two_hot(x: torch.Tensor, cfg: WorldModelConfig) -> torch.Tensor:
    """Scalars ``(...)`` → two-hot targets ``(..., num_bins)`` over ``cfg``'s symlog bins: the mass is split
    between the two bins around ``symlog(x)`` so that the expectation is ``symlog(x)`` (clamped to the range)."""
    width = (cfg.vmax - cfg.vmin) / (cfg.num_bins - 1)
    pos = ((symlog(x).clamp(cfg.vmin, cfg.vmax) - cfg.vmin) / width).unsqueeze(-1)
    low = pos.floor().clamp(0, cfg.num_bins - 1)
    frac = pos - low
    out = torch.zeros(*x.shape, cfg.num_bins, device=x.device, dtype=x.dtype)
    out.scatter_add_(-1, low.long(), 1 - frac)
    return out.scatter_add_(-1, (low + 1).clamp(max=cfg.num_bins - 1).long(), frac)


def two_hot_inv(logits: torch.Tensor, cfg: WorldModelConfig) -> torch.Tensor:
    """Bin logits ``(..., num_bins)`` → the scalar they predict ``(...)`` (the symexp of the expected bin);
    with ``num_bins: 1`` the logit is the scalar itself."""
    if cfg.num_bins == 1:
        return logits.squeeze(-1)
    bins = torch.linspace(cfg.vmin, cfg.vmax, cfg.num_bins, device=logits.device, dtype=logits.dtype)
    return symexp((F.softmax(logits, dim=-1) * bins).sum(-1))


def scalar_loss(logits: torch.Tensor, target: torch.Tensor, cfg: WorldModelConfig) -> torch.Tensor:
    """Per-element loss of bin logits ``(..., num_bins)`` against scalar targets ``(...)``: the cross-entropy
    with the two-hot target (TD-MPC2's discrete regression), or the squared error with ``num_bins: 1``."""
    if cfg.num_bins == 1:
        return (logits.squeeze(-1) - target) ** 2
    return -(two_hot(target, cfg) * F.log_softmax(logits, dim=-1)).sum(-1)


class SimNorm(nn.Module):
    """Softmax over groups of ``dim`` latent entries: ``(B, L) -> (B, L)``, each group sums to 1."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return F.softmax(x.reshape(*shape[:-1], -1, self.dim), dim=-1).reshape(shape)


class WorldModel(nn.Module):
    """Encoder, latent dynamics, reward / success / Q heads and a policy prior over latents."""

    def __init__(self, obs_dim: int, act_dim: int, cfg: WorldModelConfig | None = None,
                 obs_mean: torch.Tensor | None = None, obs_std: torch.Tensor | None = None, reward_scale: float = 1.0):
        super().__init__()
        cfg = cfg or WorldModelConfig()
        if cfg.kind == "tdmpc2" and cfg.latent_dim % cfg.simnorm_dim:
            raise WorldModelError(f"latent_dim {cfg.latent_dim} is not a multiple of simnorm_dim {cfg.simnorm_dim}")
        self.cfg, self.obs_dim, self.act_dim = cfg, int(obs_dim), int(act_dim)
        self.register_buffer("obs_mean", torch.zeros(obs_dim) if obs_mean is None else torch.as_tensor(obs_mean).float())
        self.register_buffer("obs_std", torch.ones(obs_dim) if obs_std is None else torch.as_tensor(obs_std).float())
        # rewards and values are regressed in units of this scale (the data's reward spread), so that a task's
        # small reward differences span several bins; reward() and Q() answer in the task's units
        self.register_buffer("reward_scale", torch.tensor(float(reward_scale)))
        L, h = cfg.latent_dim, list(cfg.hidden)
        if cfg.kind == "tdmpc2":
            self._encoder = mlp([obs_dim, *h, L], SimNorm(cfg.simnorm_dim))
            self._dynamics = mlp([L + act_dim, *h, L], SimNorm(cfg.simnorm_dim))
        else:  # the lifting's last obs_dim entries are the normalised state itself
            self._encoder = mlp([obs_dim, *h, L - obs_dim])
            self._A = nn.Linear(L, L, bias=False)
            self._B = nn.Linear(act_dim, L, bias=False)
            nn.init.eye_(self._A.weight)
            nn.init.zeros_(self._B.weight)
        self._reward = mlp([L + act_dim, *h, cfg.num_bins])
        self._success = mlp([L, *h, 1])
        self._pi = mlp([L, *h, 2 * act_dim])
        self._Qs = nn.ModuleList(mlp([L + act_dim, *h, cfg.num_bins], dropout=cfg.dropout) for _ in range(cfg.num_q))
        with torch.no_grad():  # reward and values start at 0 (TD-MPC2's initialisation)
            for head in (self._reward, *self._Qs):
                head[-1].weight.zero_()
        self._target_Qs = copy.deepcopy(self._Qs).requires_grad_(False)
        self._state_readout = mlp([L, h[0], obs_dim])

    def encode(self, obs: torch.Tensor) -> torch.Tensor:
        """Observation state ``(..., D)`` → latent ``(..., L)``."""
        x = (obs - self.obs_mean) / self.obs_std
        if self.cfg.kind == "tdmpc2":
            return self._encoder(x)
        return torch.cat([self._encoder(x), x], dim=-1)

    def next(self, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Latent dynamics: ``z (..., L), a (..., A)`` → next latent ``(..., L)``."""
        if self.cfg.kind == "tdmpc2":
            return self._dynamics(torch.cat([z, a], dim=-1))
        return self._A(z) + self._B(a)

    def rollout(self, z: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Open loop: ``z (B, L), actions (B, H, A)`` → latents ``(B, H + 1, L)`` (z first)."""
        zs = [z]
        for k in range(actions.shape[1]):
            zs.append(self.next(zs[-1], actions[:, k]))
        return torch.stack(zs, dim=1)

    def reward_logits(self, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Bin logits of the reward of taking ``a`` in ``z``: ``(..., L), (..., A)`` → ``(..., num_bins)``."""
        return self._reward(torch.cat([z, a], dim=-1))

    def reward(self, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Reward of taking ``a`` in ``z``: ``(..., L), (..., A)`` → ``(...)``."""
        return two_hot_inv(self.reward_logits(z, a), self.cfg) * self.reward_scale

    def success(self, z: torch.Tensor) -> torch.Tensor:
        """Logit that the episode ends in success on arriving at ``z``: ``(..., L)`` → ``(...)``."""
        return self._success(z).squeeze(-1)

    def decode_state(self, z: torch.Tensor) -> torch.Tensor:
        """Read-out of the observation state from a latent: ``(..., L)`` → ``(..., D)``."""
        return self._state_readout(z) * self.obs_std + self.obs_mean

    def pi(self, z: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Policy prior: ``z (..., L)`` → (action in [-1, 1] ``(..., A)``, its log-probability ``(...)``)."""
        mean, log_std = self._pi(z).chunk(2, dim=-1)
        log_std = log_std.clamp(self.cfg.log_std_min, self.cfg.log_std_max)
        u = mean if deterministic else mean + log_std.exp() * torch.randn_like(mean)
        a = torch.tanh(u)
        logp = (-0.5 * ((u - mean) / log_std.exp()) ** 2 - log_std - 0.9189385).sum(-1)
        return a, logp - torch.log1p(-a.pow(2) + 1e-6).sum(-1)

    def Q(self, z: torch.Tensor, a: torch.Tensor, return_type: str = "min", target: bool = False) -> torch.Tensor:
        """Q values of ``(z, a)``: ``"logits"`` → bin logits ``(num_q, ..., num_bins)``; ``"all"`` → ``(num_q, ...)``;
        ``"min"`` / ``"avg"`` of two heads drawn at random → ``(...)``."""
        heads = self._target_Qs if target else self._Qs
        x = torch.cat([z, a], dim=-1)
        if return_type in ("logits", "all"):
            logits = torch.stack([q(x) for q in heads])
            return logits if return_type == "logits" else two_hot_inv(logits, self.cfg) * self.reward_scale
        i, j = torch.randperm(len(heads))[:2].tolist()
        qi, qj = (two_hot_inv(heads[k](x), self.cfg) * self.reward_scale for k in (i, j))
        return torch.minimum(qi, qj) if return_type == "min" else (qi + qj) / 2

    @torch.no_grad()
    def fit_normalisation(self, states: np.ndarray, rewards: np.ndarray) -> None:
        """Set the observation normalisation and the reward scale from data: ``states (N, D)``, ``rewards (M,)``."""
        self.obs_mean.copy_(torch.as_tensor(states.mean(0)))
        self.obs_std.copy_(torch.as_tensor(states.std(0) + 1e-3))
        self.reward_scale.fill_(float(max(np.std(rewards), 1e-2)) if len(rewards) else 1.0)

    @torch.no_grad()
    def soft_update_targets(self) -> None:
        """Move the target Q heads toward the online ones by ``tau``."""
        for p, tp in zip(self._Qs.parameters(), self._target_Qs.parameters()):
            tp.lerp_(p, self.cfg.tau)

    def save(self, directory: str | Path) -> Path:
        """Write ``config.yaml`` + ``model.safetensors`` (normalisation included) into ``directory``."""
        from safetensors.torch import save

        import yaml

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        atomic_write_bytes(directory / WEIGHTS_FILE, save(tensors))
        meta = {"type": CHECKPOINT_TYPE, "obs_dim": self.obs_dim, "act_dim": self.act_dim, "model": to_dict(self.cfg)}
        atomic_write_text(directory / CONFIG_FILE, yaml.safe_dump(meta, sort_keys=False))
        return directory

    @classmethod
    def load(cls, directory: str | Path, device: str | torch.device = "cpu") -> "WorldModel":
        """Rebuild a model saved by :meth:`save`."""
        from safetensors.torch import load_file

        directory = Path(directory)
        path = directory / CONFIG_FILE
        meta = load_yaml(path) if path.is_file() else {}
        if meta.get("type") != CHECKPOINT_TYPE:
            raise WorldModelError(f"{directory}: not a world-model checkpoint ({CONFIG_FILE} lacks type: {CHECKPOINT_TYPE})")
        cfg = build(WorldModelConfig, meta.get("model", {}), str(path), prefix="model.")
        model = cls(int(meta["obs_dim"]), int(meta["act_dim"]), cfg)
        try:
            model.load_state_dict(load_file(str(directory / WEIGHTS_FILE)))
        except RuntimeError as exc:
            raise WorldModelError(f"{directory}: weights do not fit the model its {CONFIG_FILE} describes "
                                  f"({str(exc).splitlines()[0]}); retrain it") from None
        return model.to(device).eval()
