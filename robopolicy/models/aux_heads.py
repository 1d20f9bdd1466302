"""Auxiliary heads: training-only heads, each declaring its losses and the dataset labels they read.

A head is a small class registered under its ``model.aux_heads`` name. It says which loss weights
it computes (``loss.<name>``), which dataset labels those losses read, whether it looks at camera
tokens, and how to build its module and compute its losses. :class:`~robopolicy.models.policy.Policy`
and the trainer only go through this registry, so neither names a task's labels:

    @register_aux_head
    class MyHead(AuxHead):
        name = "my_head"
        losses = ("my_loss",)                       # loss.my_loss in the recipe
        def labels(self, cfg): return {"label.my_thing": ("my_loss",)}
        def build(self, cfg, policy, stats): return SomeModule(cfg.d_model)
        def compute(self, policy, module, batch): return {"my_loss": ...}

Shapes: ``batch.memory`` is the fused memory ``(B, N, d)`` with padding ``batch.pad (B, N)``;
``batch.feats`` the raw context features ``(B, T, V, n, C)``; ``batch.state (B, D)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from robopolicy.models.heads import AlignHead, FreeRunHead, GroundingHead, LocateHead, LocateMLP

TARGET_BOX = "label.target_box"  # (4,) pixels x0 y0 x1 y1 of the instructed person in the front frame
TARGET_VISIBLE = "label.target_visible"  # (1,) bool
FREE_RUN = "label.free_run"  # (R,) metres the robot could drive along R bearings
GOAL_POS = "label.goal_pos"  # (6,) the named objects' xyz: the locate head's default label


class AuxHeadError(ValueError):
    """An auxiliary head cannot be built or trained as configured; the message names the setting."""


@dataclass
class LossBatch:
    """What :meth:`Policy.losses` has prepared for the heads: the loader batch and its encodings.

    ``memory`` / ``pad`` are computed on first use (an MLP head over raw tokens needs none)."""

    batch: Mapping[str, Any]
    feats: torch.Tensor | None
    ctx_pad: torch.Tensor | None
    state: torch.Tensor | None
    env_state: torch.Tensor | None
    tasks: list[str] | None
    fuse: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    _fused: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def fused(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(memory (B, N, d), padding (B, N))`` of the whole policy input, computed once."""
        if self._fused is None:
            self._fused = self.fuse()
        return self._fused

    def label(self, key: str, loss: str) -> torch.Tensor:
        """The batch's label ``key``; its absence names the loss weight that asked for it."""
        if key not in self.batch:
            raise AuxHeadError(f"loss.{loss} reads the label {key!r}, which the batch lacks: the trainer loads it "
                               f"when the dataset has it (set loss.{loss}: 0 if it has not)")
        return self.batch[key]


class AuxHead:
    """One kind of auxiliary head (see the module docstring)."""

    name: ClassVar[str]
    losses: ClassVar[tuple[str, ...]]
    """The loss weights (``loss.<name>``) this head computes."""
    needs_camera: ClassVar[bool] = True
    """Whether it reads camera tokens (a state-only policy cannot have it)."""

    def labels(self, cfg: Any) -> dict[str, tuple[str, ...]]:
        """Dataset label key → the losses that read it, for a model config ``cfg``."""
        return {}

    def sizes(self, cfg: Any, stats: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        """Model config fields this head takes from the dataset's label statistics (its label's size)."""
        return {}

    def build(self, cfg: Any, policy: nn.Module, stats: Mapping[str, Mapping[str, Any]] | None) -> nn.Module:
        """The head's module for ``policy`` (``stats``: the dataset's, or ``None`` when loading a checkpoint)."""
        raise NotImplementedError

    def compute(self, policy: nn.Module, module: nn.Module, batch: LossBatch) -> dict[str, torch.Tensor]:
        """Every loss of :attr:`losses`, unweighted, as scalars."""
        raise NotImplementedError


AUX_HEADS: dict[str, AuxHead] = {}
"""``model.aux_heads`` name → head."""


def register_aux_head(cls: type[AuxHead]) -> type[AuxHead]:
    """Class decorator: make the head available as ``model.aux_heads: [<cls.name>]``."""
    AUX_HEADS[cls.name] = cls()
    return cls


def aux_head(name: str) -> AuxHead:
    """The head registered as ``name``."""
    if name not in AUX_HEADS:
        raise AuxHeadError(f"model.aux_heads: unknown head {name!r} (known: {sorted(AUX_HEADS)})")
    return AUX_HEADS[name]


def loss_owner(loss: str) -> AuxHead | None:
    """The head that computes the loss weight ``loss`` (``None`` for ``action``, the main head's)."""
    for head in AUX_HEADS.values():
        if loss in head.losses:
            return head
    if loss == "action":
        return None
    raise AuxHeadError(f"loss.{loss}: no head computes it (auxiliary losses: "
                       f"{sorted(l for h in AUX_HEADS.values() for l in h.losses)})")


def required_labels(cfg: Any, weights: Mapping[str, float]) -> dict[str, str]:
    """Dataset label key → the setting that asks for it (``loss.<name>``), for every nonzero weight."""
    out: dict[str, str] = {}
    for loss, weight in weights.items():
        head = loss_owner(loss) if weight else None
        if head is not None:
            for key, readers in head.labels(cfg).items():
                if loss in readers:
                    out.setdefault(key, f"loss.{loss}")
    return out


def head_sizes(cfg: Any, stats: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Every size the heads of ``cfg.aux_heads`` take from the dataset (e.g. ``locate_dim``)."""
    out: dict[str, Any] = {}
    for name in cfg.aux_heads:
        out.update(aux_head(name).sizes(cfg, stats))
    return out


def _label_size(stats: Mapping[str, Mapping[str, Any]], key: str) -> int:
    import numpy as np

    return int(np.asarray(stats[key]["mean"]).size)


# --------------------------------------------------------------------------- the heads


def _box_cxcywh(box_xyxy: torch.Tensor, frame_hw: tuple[int, int]) -> torch.Tensor:
    """Pixel boxes ``(B, 4)`` x0 y0 x1 y1 → normalized ``(B, 4)`` cx cy w h in [0, 1]."""
    h, w = frame_hw
    x0, y0, x1, y1 = (box_xyxy / box_xyxy.new_tensor([w, h, w, h])).clamp(0, 1).unbind(-1)
    return torch.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], dim=-1)


def region_weights(box_cxcywh: torch.Tensor, grid: int) -> torch.Tensor:
    """How much of each grid cell a box covers: ``(B, 4)`` → weights ``(B, grid*grid)`` summing to 1
    (row-major cells, as the encoders flatten them). A degenerate box puts its weight on the cell
    holding its centre."""
    cx, cy, w, h = box_cxcywh.unbind(-1)
    edges = torch.arange(grid + 1, device=box_cxcywh.device, dtype=box_cxcywh.dtype) / grid

    def overlap(lo, hi):  # (B, grid)
        return (torch.minimum(hi[:, None], edges[None, 1:]) - torch.maximum(lo[:, None], edges[None, :-1])).clamp(min=0)

    wx, wy = overlap(cx - w / 2, cx + w / 2), overlap(cy - h / 2, cy + h / 2)
    weights = (wy[:, :, None] * wx[:, None, :]).flatten(1)
    centre = ((cy * grid).long().clamp(0, grid - 1) * grid + (cx * grid).long().clamp(0, grid - 1))
    fallback = F.one_hot(centre, grid * grid).to(weights.dtype)
    total = weights.sum(-1, keepdim=True)
    return torch.where(total > 1e-8, weights / total.clamp(min=1e-8), fallback)


def _target_box(policy: nn.Module, batch: LossBatch, loss: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The instructed person's box ``(B, 4)`` cxcywh in [0, 1] and its visibility ``(B,)``."""
    raw_box, raw_visible = batch.label(TARGET_BOX, loss), batch.label(TARGET_VISIBLE, loss)
    frame = tuple(policy.config.frame_size)
    if len(frame) != 2:
        raise AuxHeadError("policy config: frame_size is unset (the trainer fills it from the dataset)")
    box = _box_cxcywh(raw_box.float().reshape(-1, 4), frame)
    visible = raw_visible.reshape(-1).bool() & (box[:, 2] * box[:, 3] > 0)
    return box, visible


@register_aux_head
class Grounding(AuxHead):
    """Stage 2: where the instructed person is (box) and whether they are in view."""

    name = "ground"
    losses = ("ground_box", "ground_visible")

    def labels(self, cfg):
        return {TARGET_BOX: self.losses, TARGET_VISIBLE: self.losses}

    def build(self, cfg, policy, stats):
        return GroundingHead(cfg.d_model, cfg.n_heads, cfg.dropout)

    def compute(self, policy, module, batch):
        box, visible = _target_box(policy, batch, "ground_box")
        memory, pad = batch.fused()
        g = module.loss(memory, pad, box, visible)
        return {"ground_box": g["box"], "ground_visible": g["visible"]}


@register_aux_head
class Align(AuxHead):
    """Stage 1: InfoNCE between the target's image region and the instruction."""

    name = "align"
    losses = ("align",)

    def labels(self, cfg):
        return {TARGET_BOX: self.losses, TARGET_VISIBLE: self.losses}

    def build(self, cfg, policy, stats):
        if policy.language is None:
            raise AuxHeadError("aux head 'align' needs model.language.enabled=true")
        return AlignHead(cfg.d_model)

    def compute(self, policy, module, batch):
        """InfoNCE between the target's region of the current front frame (contextualised by the
        backbone over vision tokens only) and the instruction."""
        box, visible = _target_box(policy, batch, "align")
        tasks, feats = batch.tasks, batch.feats
        if tasks is None:
            raise AuxHeadError("loss.align needs 'task' (the instruction) in the batch")
        b, t, v, n, _ = feats.shape
        memory, _, _ = policy._memory(feats, batch.ctx_pad, None, None, with_language=False, with_state=False)
        start = policy._t0 * v * n  # first camera of the current frame
        region = (region_weights(box, policy.config.grid)[:, :, None] * memory[:, start:start + n]).sum(1)
        text = policy.lang_proj(policy.language.embed(tasks).to(feats.device, feats.dtype))
        keep = visible.nonzero().flatten()
        if keep.numel() < 2:
            return {"align": feats.new_zeros(())}  # nothing to contrast in this batch
        kept_tasks = [tasks[i] for i in keep.tolist()]
        index = {s: i for i, s in enumerate(dict.fromkeys(kept_tasks))}
        ids = torch.tensor([index[s] for s in kept_tasks], device=feats.device)
        return {"align": module.loss(region[keep], text[keep], ids[:, None] == ids[None, :])}


@register_aux_head
class FreeRun(AuxHead):
    """Spatial grounding: how far ahead the robot could drive along R bearings (``free_run_dim``)."""

    name = "free_run"
    losses = ("ground_free_run",)
    needs_camera = False

    def labels(self, cfg):
        return {FREE_RUN: self.losses}

    def sizes(self, cfg, stats):
        return {"free_run_dim": _label_size(stats, FREE_RUN)} if FREE_RUN in stats else {}

    def build(self, cfg, policy, stats):
        return FreeRunHead(cfg.d_model, cfg.n_heads, cfg.free_run_dim, cfg.dropout)

    def compute(self, policy, module, batch):
        memory, pad = batch.fused()
        target = batch.label(FREE_RUN, "ground_free_run").reshape(-1, policy.config.free_run_dim)
        return {"ground_free_run": module.loss(memory, pad, target)}


@register_aux_head
class Locate(AuxHead):
    """Where the named objects are: regress ``model.locate_label`` (``locate_dim`` values)."""

    name = "locate"
    losses = ("locate",)

    def labels(self, cfg):
        return {cfg.locate_label: self.losses}

    def sizes(self, cfg, stats):
        return {"locate_dim": _label_size(stats, cfg.locate_label)} if cfg.locate_label in stats else {}

    def build(self, cfg, policy, stats):
        label_stats = (stats or {}).get(cfg.locate_label, {})  # none when loading: the buffers hold them
        if stats is not None and not label_stats:
            raise AuxHeadError(f"aux head 'locate' needs statistics of {cfg.locate_label!r} (model.locate_label): "
                               f"the dataset must have it")
        mean, std = label_stats.get("mean"), label_stats.get("std")
        if cfg.locate_head == "mlp":
            in_dim = (len(cfg.cameras) * policy.vision.n_tokens * policy.vision.out_dim
                      + (policy.language.dim if policy.language is not None else 0)
                      + (cfg.state_dim if cfg.use_state and cfg.locate_state else 0))
            return LocateMLP(in_dim, cfg.locate_dim, mean, std)
        return LocateHead(cfg.d_model, cfg.n_heads, cfg.locate_dim, mean, std, cfg.dropout)

    def compute(self, policy, module, batch):
        cfg = policy.config
        target = batch.label(cfg.locate_label, "locate").reshape(-1, cfg.locate_dim)
        if cfg.locate_head == "mlp":
            inputs = policy._locate_inputs(batch.feats[:, policy._t0], batch.state, batch.tasks)
            return {"locate": module.loss(inputs, None, target)}
        memory, pad = batch.fused()
        return {"locate": module.loss(memory, pad, target)}
