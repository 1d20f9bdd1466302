"""A latent world model of a task with state observations (TD-MPC2's design, or a Koopman one).

    model = WorldModel(obs_dim=4, act_dim=2, cfg=WorldModelConfig(), obs_mean=m, obs_std=s)
    z = model.encode(obs)                  # (B, D) -> (B, L)
    z1 = model.next(z, a)                  # (B, L), (B, A) -> (B, L)
    r, p = model.reward(z, a), model.success(z1)   # (B,), (B,) logit of "success after the step"
    q = model.Q(z, a, "min")               # (B,) the lower of two Q heads drawn from the ensemble

The default (``kind: tdmpc2``) has no decoder: the encoder is trained only through the latent
consistency of a multi-step rollout, reward, success and value losses; its latent is split in
groups, each a softmax (SimNorm). ``kind: koopman`` lifts the state (an MLP's features beside the
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


def mlp(sizes: list[int], out_act: nn.Module | None = None) -> nn.Sequential:
    """Linear + LayerNorm + Mish between every pair of sizes, a plain Linear last (then ``out_act``)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers += [nn.LayerNorm(b), nn.Mish()]
    if out_act is not None:
        layers.append(out_act)
    return nn.Sequential(*layers)


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
                 obs_mean: torch.Tensor | None = None, obs_std: torch.Tensor | None = None):
        super().__init__()
        cfg = cfg or WorldModelConfig()
        if cfg.kind == "tdmpc2" and cfg.latent_dim % cfg.simnorm_dim:
            raise WorldModelError(f"latent_dim {cfg.latent_dim} is not a multiple of simnorm_dim {cfg.simnorm_dim}")
        self.cfg, self.obs_dim, self.act_dim = cfg, int(obs_dim), int(act_dim)
        self.register_buffer("obs_mean", torch.zeros(obs_dim) if obs_mean is None else torch.as_tensor(obs_mean).float())
        self.register_buffer("obs_std", torch.ones(obs_dim) if obs_std is None else torch.as_tensor(obs_std).float())
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
        self._reward = mlp([L + act_dim, *h, 1])
        self._success = mlp([L, *h, 1])
        self._pi = mlp([L, *h, 2 * act_dim])
        self._Qs = nn.ModuleList(mlp([L + act_dim, *h, 1]) for _ in range(cfg.num_q))
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

    def reward(self, z: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Reward of taking ``a`` in ``z``: ``(..., L), (..., A)`` → ``(...)``."""
        return self._reward(torch.cat([z, a], dim=-1)).squeeze(-1)

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
        """Q values of ``(z, a)``: ``"all"`` → ``(num_q, ...)``; ``"min"`` / ``"avg"`` of two random heads → ``(...)``."""
        heads = self._target_Qs if target else self._Qs
        x = torch.cat([z, a], dim=-1)
        if return_type == "all":
            return torch.stack([q(x).squeeze(-1) for q in heads])
        i, j = torch.randperm(len(heads))[:2].tolist()
        qi, qj = heads[i](x).squeeze(-1), heads[j](x).squeeze(-1)
        return torch.minimum(qi, qj) if return_type == "min" else (qi + qj) / 2

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
        model.load_state_dict(load_file(str(directory / WEIGHTS_FILE)))
        return model.to(device).eval()
