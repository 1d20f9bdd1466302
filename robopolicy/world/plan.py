"""MPPI planning in a world model, around a base policy's chunk (TD-MPC2's planner over residual chunks).

    planner = MPPIPlanner(model, MPPIConfig(samples=64, iterations=3))
    chunk = planner.plan(states, base_chunks)     # (B, D), (B, H, A) or None → (B, H, A)

    policy = PlannedPolicy.load("outputs/plan/point")   # a checkpoint of type "planned": base + world + MPPI
    policy.predict(obs)                                  # the base's chunk, refined by MPPI: (B, H, A)

For each of ``iterations`` rounds, ``samples`` residual sequences ``r ~ N(mean, std²)`` (the zero residual
and ``pi_samples`` chunks of the model's policy prior among them) are added to the nominal chunk, rolled out
in the latent space and scored by

    J = Σ_k γ^k c_k reward(z_k, a_k) + γ^H c_H V(z_H),   c_{k+1} = c_k (1 − P(success on arriving at z_{k+1}))

with ``V(z) = Q(z, pi(z))`` (the mean of two heads). The ``elites`` best refit ``mean`` and ``std`` with
weights ``softmax(temperature · J)``. The plan is the nominal chunk plus the final mean. The nominal is the
base policy's chunk, or without a base the policy prior's open-loop chunk in the latent space.

Samples whose score is not finite are dropped; when none is finite the planner logs a warning and
returns the nominal chunk (a bounded stop: the base's own action, never a NaN).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from robopolicy.config import ConfigError, build, load_yaml, parse_overrides, to_dict
from robopolicy.utils.files import atomic_write_text
from robopolicy.world.model import WorldModel, WorldModelError

log = logging.getLogger(__name__)
CHECKPOINT_TYPE = "planned"
CONFIG_FILE = "config.yaml"


@dataclass
class MPPIConfig:
    """Sampling-based planning around a nominal chunk (TD-MPC2's defaults, scaled down for batch-1 CPU latency)."""

    horizon: int = 8
    """Chunk length planned when there is no base (with a base: the base's chunk length)."""
    samples: int = 64
    """Residual sequences per iteration."""
    pi_samples: int = 8
    """Of those, chunks of the model's policy prior (rolled in the latent space)."""
    elites: int = 8
    iterations: int = 3
    std: float = 0.3
    """Initial standard deviation of the residuals."""
    min_std: float = 0.05
    temperature: float = 0.5
    """Elites weigh ``exp(temperature · (J − max J))`` (J in units of the model's reward scale)."""
    bound: float = 1.0
    """Actions are clipped to ``[-bound, bound]`` (0: no clip)."""
    seed: int = 0


def mppi_config(overrides: list[str]) -> MPPIConfig:
    """Command-line ``mppi.KEY=VALUE`` overrides → :class:`MPPIConfig`; any other key is an error, not ignored."""
    parsed = parse_overrides(overrides)
    stray = sorted(set(parsed) - {"mppi"})
    if stray:
        raise ConfigError(f"command line: {stray[0]!r} is not a planner setting (give mppi.KEY=VALUE)")
    return build(MPPIConfig, parsed.get("mppi", {}), "command line", prefix="mppi.")


class MPPIPlanner:
    """MPPI over residual chunks in a world model's latent space (module docstring)."""

    def __init__(self, model: WorldModel, cfg: MPPIConfig | None = None):
        self.model, self.cfg = model.eval(), cfg or MPPIConfig()
        self.gen = torch.Generator().manual_seed(self.cfg.seed)
        self.warned = False

    def _clip(self, a: torch.Tensor) -> torch.Tensor:
        return a.clamp(-self.cfg.bound, self.cfg.bound) if self.cfg.bound > 0 else a

    @torch.no_grad()
    def prior_chunk(self, z: torch.Tensor, horizon: int, deterministic: bool = True) -> torch.Tensor:
        """The policy prior rolled open loop in the latent space: ``z (N, L)`` → ``(N, H, A)``."""
        actions = []
        for _ in range(horizon):
            a, _ = self.model.pi(z, deterministic=deterministic)
            actions.append(a)
            z = self.model.next(z, a)
        return torch.stack(actions, dim=1)

    @torch.no_grad()
    def score(self, z: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """Return ``J (N,)`` of chunks ``actions (N, H, A)`` from latents ``z (N, L)`` (module docstring),
        in units of the model's reward scale."""
        model, gamma = self.model, self.model.cfg.gamma
        J, cont = torch.zeros(len(z)), torch.ones(len(z))
        for k in range(actions.shape[1]):
            J = J + gamma**k * cont * model.reward(z, actions[:, k])
            z = model.next(z, actions[:, k])
            cont = cont * (1 - torch.sigmoid(model.success(z)))
        a, _ = model.pi(z, deterministic=True)
        J = J + gamma ** actions.shape[1] * cont * model.Q(z, a, "avg")
        return J / model.reward_scale

    @torch.no_grad()
    def plan(self, states: torch.Tensor, nominal: torch.Tensor | None = None) -> torch.Tensor:
        """Plans for a batch: ``states (B, D)``, ``nominal (B, H, A)`` (None: the policy prior's) → ``(B, H, A)``."""
        cfg, model = self.cfg, self.model
        states = torch.as_tensor(states, dtype=torch.float32)
        if states.ndim != 2 or states.shape[1] != model.obs_dim:
            raise WorldModelError(f"planner: states of shape {tuple(states.shape)}, the world model takes (B, {model.obs_dim})")
        z = model.encode(states)  # (B, L)
        nominal = self.prior_chunk(z, cfg.horizon) if nominal is None else torch.as_tensor(nominal, dtype=torch.float32)
        B, H, A = nominal.shape
        if A != model.act_dim:
            raise WorldModelError(f"planner: the base's chunk has {A} action entries, the world model takes {model.act_dim}")
        N, P = cfg.samples, min(cfg.pi_samples, cfg.samples - 1)
        zN = z.repeat_interleave(N, 0)  # (B N, L)
        prior = (self.prior_chunk(z.repeat_interleave(P, 0), H, deterministic=False).reshape(B, P, H, A)
                 - nominal[:, None]) if P else nominal.new_zeros(B, 0, H, A)
        mean, std = torch.zeros(B, 1, H, A), torch.full((B, 1, H, A), cfg.std)
        for _ in range(cfg.iterations):
            noise = torch.randn(B, N - P - 1, H, A, generator=self.gen)
            residual = torch.cat([torch.zeros(B, 1, H, A), prior, mean + std * noise], dim=1)  # (B, N, H, A)
            actions = self._clip(nominal[:, None] + residual)
            J = self.score(zN, actions.reshape(B * N, H, A)).reshape(B, N)
            J = torch.where(torch.isfinite(J), J, torch.full_like(J, -torch.inf))
            if not torch.isfinite(J).any(1).all():
                return self._fallback(nominal)
            values, idx = J.topk(min(cfg.elites, N), dim=1)  # (B, E)
            w = torch.softmax(cfg.temperature * (values - values[:, :1]), dim=1)[..., None, None]
            elites = (actions - nominal[:, None]).gather(1, idx[..., None, None].expand(-1, -1, H, A))
            mean = (w * elites).sum(1, keepdim=True)
            std = ((w * (elites - mean) ** 2).sum(1, keepdim=True)).sqrt().clamp(min=cfg.min_std)
        return self._clip(nominal + mean[:, 0])

    def _fallback(self, nominal: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(nominal).all():
            raise WorldModelError("planner: the world model's scores and the nominal chunk are all NaN or inf")
        if not self.warned:
            log.warning("planner: every sampled chunk scored NaN or inf in the world model; returning the nominal chunk")
            self.warned = True
        return self._clip(nominal)


class PlannedPolicy:
    """A policy whose chunks MPPI refines in a world model: ``predict(obs) → (B, H, A)``, ``reset()``.

    Without a base the nominal chunk is the world model's policy prior. A checkpoint of ``type: planned``
    is a ``config.yaml`` naming ``base`` (a policy checkpoint, or null), ``world`` and ``mppi`` (and a copy
    of the base run's ``train_config.yaml``, whose dataset tells the worker the control rate); eval and
    the policy worker load it through ``load_policy`` like any other policy.
    """

    output = "chunk"

    def __init__(self, model: WorldModel, cfg: MPPIConfig | None = None, base: Any = None):
        self.model, self.base, self.planner = model, base, MPPIPlanner(model, cfg)
        inner = getattr(base, "base", None) or base
        for attr in ("config", "context_strides"):
            if inner is not None and hasattr(inner, attr):
                setattr(self, attr, getattr(inner, attr))

    def predict(self, obs: dict[str, Any]) -> torch.Tensor:
        """``obs["observation.state"] (B, D)`` (and the base's inputs) → planned chunk ``(B, H, A)``."""
        nominal = None
        if self.base is not None:
            nominal = torch.as_tensor(self.base.predict(obs), dtype=torch.float32).cpu()
        states = torch.as_tensor(obs["observation.state"], dtype=torch.float32).cpu()
        if states.ndim == 1:  # the policy worker's single observation
            states = states[None]
        return self.planner.plan(states, nominal)

    def reset(self, rows: list[int] | None = None) -> None:
        """Start new episodes on ``rows`` (all when ``None``): the base's context of those rows only."""
        if self.base is not None:
            self.base.reset(rows)

    def eval(self) -> "PlannedPolicy":
        if self.base is not None:
            self.base.eval()
        return self

    def to(self, device: Any) -> "PlannedPolicy":
        return self

    @staticmethod
    def write(directory: str | Path, world: str | Path, base: str | Path | None = None,
              cfg: MPPIConfig | None = None) -> Path:
        """Write a ``type: planned`` checkpoint that names its world model and base by path."""
        import yaml

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        meta = {"type": CHECKPOINT_TYPE, "world": str(world), "base": None if base is None else str(base),
                "mppi": to_dict(cfg or MPPIConfig())}
        atomic_write_text(directory / CONFIG_FILE, yaml.safe_dump(meta, sort_keys=False))
        for run in ([Path(base), Path(base).parent, Path(base).parent.parent] if base else []):
            if (run / "train_config.yaml").is_file():  # the base's control rate (its dataset's fps), for the worker
                atomic_write_text(directory / "train_config.yaml", (run / "train_config.yaml").read_text())
                break
        return directory

    @classmethod
    def load(cls, directory: str | Path, device: Any = "cpu") -> "PlannedPolicy":
        """Rebuild from a ``type: planned`` checkpoint; the base's action size and the world model's must agree."""
        path = Path(directory) / CONFIG_FILE
        meta = load_yaml(path) or {}
        if meta.get("type") != CHECKPOINT_TYPE or not meta.get("world"):
            raise WorldModelError(f"{path}: not a planned-policy checkpoint (needs type: {CHECKPOINT_TYPE} and world: DIR)")
        model = WorldModel.load(meta["world"])
        base = None
        if meta.get("base"):
            from robopolicy.models.loading import load_policy

            base = load_policy(meta["base"], device)
            check_base(base, model, meta["base"])
        return cls(model, build(MPPIConfig, meta.get("mppi") or {}, str(path), prefix="mppi."), base)


def check_base(base: Any, model: WorldModel, name: Any = "base") -> None:
    """The base policy's action and state sizes must be the world model's (where the base's config declares them)."""
    config = getattr(getattr(base, "base", None) or base, "config", None)
    shape, state_dim = list(getattr(config, "action_shape", None) or []), getattr(config, "state_dim", 0)
    if shape and (len(shape) != 1 or int(shape[0]) != model.act_dim):
        raise WorldModelError(f"{name}: the base policy's actions have shape {shape}, the world model's "
                              f"({model.act_dim},); plan with a world model of the base's task")
    if state_dim and int(state_dim) != model.obs_dim:
        raise WorldModelError(f"{name}: the base policy's state has {state_dim} entries, the world model's {model.obs_dim}")
