"""Output heads over the fused memory ``(B, N, d)`` (and its padding mask ``(B, N)``).

- :class:`WaypointHead`   K queries → ``(B, K, 3)`` robot-frame ``(x, y, yaw)`` (normalized units).
- :class:`ChunkL1Head`    H queries → ``(B, H, A)`` action chunk, trained with L1 (ACT-like).
- :class:`FlowChunkHead`  flow matching (pi0-style): ``x_t = t·ε + (1−t)·a``, velocity target
  ``ε − a``, ``t ~ Beta(1.5, 1)``; sampling integrates from ``t=1`` (noise) to ``t=0`` in a few
  Euler steps. The memory is computed once; only this small decoder runs per step.
- :class:`GroundingHead`  one query → target box ``(B, 4)`` (cx, cy, w, h in [0, 1]) and a
  visibility logit ``(B,)``.
- :class:`AlignHead`      projections of a visual region feature and an instruction embedding into
  a shared space for the InfoNCE alignment loss.

Every head works in normalized units; the policy un-normalizes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class QueryDecoder(nn.Module):
    """Learned queries cross-attending to the memory: ``(B, N, d)`` → ``(B, Q, d)``."""

    def __init__(self, num_queries: int, d_model: int, n_heads: int, n_layers: int, dropout: float):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(num_queries, d_model) * 0.02)
        layer = nn.TransformerDecoderLayer(d_model, n_heads, 4 * d_model, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, n_layers)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, memory: torch.Tensor, memory_pad: torch.Tensor | None = None,
                tgt: torch.Tensor | None = None) -> torch.Tensor:
        q = self.queries.expand(memory.shape[0], -1, -1)
        if tgt is not None:
            q = q + tgt
        pad = memory_pad if memory_pad is not None and memory_pad.any() else None
        return self.norm(self.decoder(q, memory, memory_key_padding_mask=pad))


class WaypointHead(nn.Module):
    """``(B, N, d)`` memory → ``(B, K, 3)`` normalized waypoints."""

    def __init__(self, num_waypoints: int, d_model: int, n_heads: int, n_layers: int = 2, dropout: float = 0.1):
        super().__init__()
        self.decoder = QueryDecoder(num_waypoints, d_model, n_heads, n_layers, dropout)
        self.out = nn.Linear(d_model, 3)

    def forward(self, memory, memory_pad=None) -> torch.Tensor:
        return self.out(self.decoder(memory, memory_pad))

    def loss(self, memory, memory_pad, target: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        """L1 to normalized target waypoints ``(B, K, 3)``."""
        return F.l1_loss(self(memory, memory_pad), target)


class ChunkL1Head(nn.Module):
    """``(B, N, d)`` memory → ``(B, H, A)`` normalized action chunk, L1-trained."""

    def __init__(self, horizon: int, action_dim: int, d_model: int, n_heads: int, n_layers: int = 2,
                 dropout: float = 0.1):
        super().__init__()
        self.decoder = QueryDecoder(horizon, d_model, n_heads, n_layers, dropout)
        self.out = nn.Linear(d_model, action_dim)

    def forward(self, memory, memory_pad=None) -> torch.Tensor:
        return self.out(self.decoder(memory, memory_pad))

    def loss(self, memory, memory_pad, target: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        """L1 to the chunk ``(B, H, A)``, steps past the episode end (``pad (B, H)``) excluded."""
        err = (self(memory, memory_pad) - target).abs().mean(-1)
        return _masked_mean(err, pad)


def _masked_mean(err: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
    if pad is None:
        return err.mean()
    keep = (~pad).float()
    return (err * keep).sum() / keep.sum().clamp(min=1.0)


def _time_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of flow time ``t (B,)`` in [0, 1] → ``(B, dim)``."""
    half = dim // 2
    freqs = torch.exp(torch.linspace(math.log(1.0), math.log(1000.0), half, device=t.device))
    angles = t[:, None] * freqs[None] * 2 * math.pi
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class FlowChunkHead(nn.Module):
    """Flow-matching action expert: velocity ``v(x_t, t | memory)`` ``(B, H, A)``.

    ``loss``: ``t ~ Beta(1.5, 1)``, ``ε ~ N(0, I)``, ``x_t = t·ε + (1−t)·a``, regress ``ε − a``.
    ``forward`` (sampling): ``x_1 = ε``, then ``x ← x − Δ·v(x, t)`` for ``steps`` Euler steps
    down to ``t = 0``; returns the normalized chunk ``(B, H, A)``.
    """

    def __init__(self, horizon: int, action_dim: int, d_model: int, n_heads: int, n_layers: int = 2,
                 dropout: float = 0.1, steps: int = 10):
        super().__init__()
        self.horizon, self.action_dim, self.steps = horizon, action_dim, steps
        self.decoder = QueryDecoder(horizon, d_model, n_heads, n_layers, dropout)
        self.action_in = nn.Linear(action_dim, d_model)
        self.time_in = nn.Sequential(nn.Linear(d_model, d_model), nn.SiLU(), nn.Linear(d_model, d_model))
        self.out = nn.Linear(d_model, action_dim)
        self.beta = torch.distributions.Beta(torch.tensor(1.5), torch.tensor(1.0))

    def velocity(self, memory, memory_pad, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``x_t (B, H, A)``, ``t (B,)`` → velocity ``(B, H, A)``."""
        tgt = self.action_in(x_t) + self.time_in(_time_features(t, self.action_in.out_features))[:, None]
        return self.out(self.decoder(memory, memory_pad, tgt))

    def loss(self, memory, memory_pad, target: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        b = target.shape[0]
        t = self.beta.sample((b,)).to(target.device, target.dtype)
        eps = torch.randn_like(target)
        x_t = t[:, None, None] * eps + (1 - t[:, None, None]) * target
        err = (self.velocity(memory, memory_pad, x_t, t) - (eps - target)).pow(2).mean(-1)
        return _masked_mean(err, pad)

    def forward(self, memory, memory_pad=None, steps: int | None = None,
                noise: torch.Tensor | None = None) -> torch.Tensor:
        steps = int(steps or self.steps)
        b = memory.shape[0]
        x = noise if noise is not None else torch.randn(b, self.horizon, self.action_dim, device=memory.device,
                                                        dtype=memory.dtype)
        dt = 1.0 / steps
        for i in range(steps):
            t = torch.full((b,), 1.0 - i * dt, device=memory.device, dtype=memory.dtype)
            x = x - dt * self.velocity(memory, memory_pad, x, t)
        return x


class GroundingHead(nn.Module):
    """Where the instructed person is: ``(B, N, d)`` → box ``(B, 4)`` cxcywh in [0, 1], visible logit ``(B,)``."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.1):
        super().__init__()
        self.decoder = QueryDecoder(1, d_model, n_heads, 1, dropout)
        self.out = nn.Linear(d_model, 5)

    def forward(self, memory, memory_pad=None) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.out(self.decoder(memory, memory_pad)[:, 0])
        return torch.sigmoid(y[:, :4]), y[:, 4]

    def loss(self, memory, memory_pad, box: torch.Tensor, visible: torch.Tensor) -> dict[str, torch.Tensor]:
        """``box (B, 4)`` cxcywh target (used where ``visible (B,)``), visibility BCE everywhere."""
        pred_box, logit = self(memory, memory_pad)
        vis = visible.float()
        box_err = F.l1_loss(pred_box, box, reduction="none").sum(-1)
        return {"box": (box_err * vis).sum() / vis.sum().clamp(min=1.0),
                "visible": F.binary_cross_entropy_with_logits(logit, vis)}


class FreeRunHead(nn.Module):
    """How far the robot could drive along R bearings across its camera's view before it touches
    an obstacle or wall (spatial grounding, the privileged ``label.free_run``, metres):
    ``(B, N, d)`` → ``(B, R)`` metres. Its loss trains the backbone (and a trainable encoder) to
    represent the free space in front of the robot, which the person-finding losses do not ask for."""

    def __init__(self, d_model: int, n_heads: int, rays: int, dropout: float = 0.1):
        super().__init__()
        self.decoder = QueryDecoder(1, d_model, n_heads, 1, dropout)
        self.out = nn.Linear(d_model, rays)

    def forward(self, memory, memory_pad=None) -> torch.Tensor:
        return self.out(self.decoder(memory, memory_pad)[:, 0])

    def loss(self, memory, memory_pad, free_run: torch.Tensor) -> torch.Tensor:
        """Smooth L1 (metres) to ``free_run (B, R)``, averaged over the rays."""
        return F.smooth_l1_loss(self(memory, memory_pad), free_run.float())


class LocateHead(nn.Module):
    """Where the instructed objects are (privileged labels, auxiliary): ``(B, N, d)`` → ``(B, D)``.

    The target (e.g. ``label.goal_pos``: the named cube's and bowl's xyz) is standardized by the
    dataset statistics the head keeps as buffers; the loss is a smooth L1 in those units. To
    answer, the query must find the object the instruction names in the image tokens, which puts
    a dense, direct signal on the grounding that the action loss only teaches indirectly.
    """

    def __init__(self, d_model: int, n_heads: int, dim: int, mean=None, std=None, dropout: float = 0.1):
        super().__init__()
        self.decoder = QueryDecoder(1, d_model, n_heads, 1, dropout)
        self.out = nn.Linear(d_model, dim)
        self._label_stats(dim, mean, std)

    def _label_stats(self, dim: int, mean, std) -> None:
        """Keep the label's statistics as buffers (they travel in the checkpoint)."""
        self.register_buffer("mean", torch.zeros(dim) if mean is None else torch.as_tensor(mean, dtype=torch.float32).reshape(dim))
        std = torch.ones(dim) if std is None else torch.as_tensor(std, dtype=torch.float32).reshape(dim)
        self.register_buffer("std", torch.where(std < 1e-4, torch.ones_like(std), std))

    def standardized(self, memory, memory_pad=None) -> torch.Tensor:
        """Predicted labels ``(B, D)`` in standardized units."""
        return self.out(self.decoder(memory, memory_pad)[:, 0])

    def forward(self, memory, memory_pad=None) -> torch.Tensor:
        """Predicted labels ``(B, D)`` in label units."""
        return self.standardized(memory, memory_pad) * self.std + self.mean

    def loss(self, memory, memory_pad, target: torch.Tensor) -> torch.Tensor:
        return F.smooth_l1_loss(self.standardized(memory, memory_pad), (target.float() - self.mean) / self.std)


class LocateMLP(LocateHead):
    """``locate`` as an MLP over the current frame's raw encoder tokens, flattened: ``(B, F)`` → ``(B, D)``.

    ``F`` = cameras × tokens × channels of the encoder output, plus the instruction embedding and
    the normalized joint state when the policy has them (the caller concatenates). It bypasses the
    fusion transformer: with coordinate-only keypoint tokens (``keypoint_features: false``) the
    position of each keypoint is the information, and a flat MLP reads it directly
    (``experiments/probes/locate_probe.py``). Same label standardization and loss as :class:`LocateHead`.
    """

    def __init__(self, in_dim: int, dim: int, mean=None, std=None, hidden: int = 256):
        nn.Module.__init__(self)  # no query decoder: only the statistics are shared with LocateHead
        self.mlp = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, dim))
        self._label_stats(dim, mean, std)

    def standardized(self, inputs, memory_pad=None) -> torch.Tensor:
        """``inputs (B, F)`` → predicted labels ``(B, D)`` in standardized units."""
        return self.mlp(inputs)


class AlignHead(nn.Module):
    """Shared embedding space for region features ``(B, d)`` and instruction embeddings ``(B, d)``."""

    def __init__(self, d_model: int, dim: int = 128):
        super().__init__()
        self.visual = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, dim))
        self.text = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, dim))
        self.log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def loss(self, region: torch.Tensor, text: torch.Tensor, same_text: torch.Tensor) -> torch.Tensor:
        """Symmetric InfoNCE; ``same_text (B, B)`` marks pairs that describe the same person
        (several frames in a batch share an instruction), all of them positives."""
        v = F.normalize(self.visual(region), dim=-1)
        u = F.normalize(self.text(text), dim=-1)
        logits = self.log_scale.clamp(max=math.log(100.0)).exp() * v @ u.T
        target = same_text.float() / same_text.float().sum(-1, keepdim=True)
        loss_v = -(target * logits.log_softmax(-1)).sum(-1).mean()
        loss_t = -(target.T * logits.T.log_softmax(-1)).sum(-1).mean()
        return 0.5 * (loss_v + loss_t)
