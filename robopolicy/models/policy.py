"""One policy class: vision encoders → fusion transformer → head, with its own normalization.

    policy = Policy(PolicyConfig(head="chunk_l1", horizon=16, action_shape=[6], state_dim=6,
                                 cameras=["front", "wrist"]), stats)
    policy.reset()
    chunk = policy.predict(obs)            # (B, H, A) actions in env units
    policy.observe(obs)                    # a frame seen while a chunk executes: context only
    policy.save("outputs/ckpt")            # model.safetensors + config.yaml
    policy = Policy.load("outputs/ckpt")

Observation batch (what the env emits, optionally batched): ``observation.images.<camera>``
uint8 ``(B, H, W, 3)`` or ``(H, W, 3)`` (numpy or torch; ``(B, 3, H, W)`` also accepted),
``observation.state`` ``(B, D)`` or ``(D,)``, ``task`` a string or a list of B strings, and for
a policy trained with a scene state (``env_state_dim > 0``) ``observation.environment_state``
``(B, E)``. A policy conditioned on the operator's rating (``condition_on_rating``) also reads
``rating`` (``good``, ``bad``, ``unrated``, or one per row), ``good`` when the observation has none.
A policy may have no camera at all (``cameras: []``): a state-based policy over
the joint state and the scene state (robomimic's low-dim setting, LeRobot's
``observation.environment_state``), e.g. as a fast base for refinement.

Outputs (``policy.output``): ``"chunk"`` → ``(B, H, A)``; ``"waypoints"`` → ``(B, K, 3)``
robot-frame ``(x, y, yaw)``. Un-normalized with the statistics inside the checkpoint.

Temporal context: frames ``t - s`` for ``s`` in ``context_strides``. ``predict`` and ``observe``
each push one frame (encoded once) into a per-camera ring buffer; call one of them on every env
step so the strides count env steps, and ``reset()`` between episodes (``reset(rows)`` for the
sub-envs of a vector env that just started a new episode).

Training (see ``robopolicy.train``): ``losses(batch, weights)`` takes a loader batch
(``robopolicy.data.loader``) whose images may be replaced by cached encoder features
``features (B, T, V, n, C)`` (``robopolicy.models.feature_cache``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from robopolicy.config import ConfigError, build, load_yaml, to_dict
from robopolicy.data.features import ENV_STATE
from robopolicy.models.backbone import FusionTransformer
from robopolicy.models.encoders import EncoderConfig, EncoderError, FusedVisionEncoder, MemberLayerNorm
from robopolicy.models.aux_heads import GOAL_POS, AuxHeadError, LossBatch, aux_head, loss_owner
from robopolicy.models.heads import ChunkL1Head, FlowChunkHead, WaypointHead
from robopolicy.models.language import LanguageConfig, LanguageEncoder
from robopolicy.models.temporal import ContextTokens, FeatureRingBuffer
from robopolicy.teleop.ratings import RATING_INDEX, rating_index
from robopolicy.utils.files import atomic_directory

IMAGE_PREFIX = "observation.images."
STATE = "observation.state"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.yaml"
CHECKPOINT_FORMAT = 1
STAT_NAMES = ("mean", "std", "min", "max", "q01", "q99")
# Config keys that decide the shapes of shared modules: a stage may change the rest. The context
# strides are not among them: a stage may widen the temporal context (its time embeddings start
# fresh), e.g. after the encoder was trained on single frames and is frozen from then on.
ARCHITECTURE_KEYS = ("encoders", "grid", "d_model", "n_heads", "n_layers", "cameras")


class PolicyError(ValueError):
    """A checkpoint, an observation or a config does not fit the policy; the message names it."""


@dataclass
class PolicyConfig:
    """Architecture and I/O of a :class:`Policy` (saved as ``config.yaml`` in the checkpoint)."""

    head: Literal["waypoints", "chunk_l1", "chunk_flow"] = "chunk_l1"
    """Output head: K waypoints (tracking), or an action chunk by L1 or flow matching."""
    aux_heads: list[str] = field(default_factory=list)
    """Training-only heads, by their registered name (:mod:`robopolicy.models.aux_heads`, where each
    declares its losses and labels): ``align`` (stage 1 contrastive), ``ground`` (stage 2
    grounding), ``free_run`` (stage 2 spatial grounding), ``locate`` (regress a privileged label)."""
    free_run_dim: int = 9
    """Rays of the ``free_run`` head's label; the trainer fills it from the dataset."""
    locate_dim: int = 6
    """Size of the ``locate`` head's label; the trainer fills it from the dataset."""
    locate_label: str = GOAL_POS
    """The dataset label the ``locate`` head regresses (e.g. ``label.goal_pos`` of the arm tasks)."""
    locate_head: Literal["query", "mlp"] = "query"
    """``query``: a learned query cross-attends to the fused memory (:class:`LocateHead`);
    ``mlp``: an MLP over the current frame's raw encoder tokens of every camera, flattened, with
    the instruction embedding and the joint state (:class:`LocateMLP`), bypassing the transformer.
    The ``mlp`` head is the perception half of a :class:`~robopolicy.models.modular.ModularPolicy`."""
    locate_state: bool = True
    """The ``mlp`` locate head also reads the joint state. ``false``: frames and instruction only.
    On oracle episodes the arm heads for the named cube from the first steps, so a head given the
    joints can place the cube from where the arm is going and teach the encoder little; without
    them, the cube has to be found in the frames."""
    cameras: list[str] = field(default_factory=list)
    """Camera roles (``observation.images.<role>``); empty: every camera of the training dataset."""
    use_state: bool = True
    """Feed ``observation.state`` as a proprio token."""
    relative_action: list[int] = field(default_factory=list)
    """Chunk dims predicted as offsets from the same-index state value at the current frame, e.g.
    ``[0, 1, 2, 3, 4]``: arm joint targets relative to the joint angles now (the gripper, dim 5,
    stays absolute). The chunk then says where to move from here, not where the joints must be,
    which images show more directly (a wrist camera sees the offset to the object). Needs
    ``use_state``; ``predict`` adds the state back, so outputs stay in env units. The action
    statistics of these dims are those of the offsets (the trainer computes them)."""
    encoders: list[EncoderConfig] = field(default_factory=lambda: [EncoderConfig(weights="imagenet")])
    """One or two vision backbones, fused on a shared grid (default: the packaged ImageNet
    EfficientNet-Lite0, frozen)."""
    grid: int = 3
    """Each frame becomes grid x grid tokens."""
    context_strides: list[int] = field(default_factory=lambda: [0, 1, 4, 16])
    """Frames t - s that the policy sees; must contain 0 (the current frame)."""
    mask_padded_context: bool = True
    """Hide context frames from before the episode start (they repeat the first frame)."""
    horizon: int = 16
    """Chunk length H (chunk heads); waypoint heads predict one set of K waypoints."""
    language: LanguageConfig = field(default_factory=LanguageConfig)
    condition_on_rating: bool = False
    """Success conditioning: a learned token for the episode's operator rating (bad, good, unrated;
    :mod:`robopolicy.teleop.ratings`) joins the proprio tokens. Trained on good and bad episodes
    alike (the batch's ``rating``), the policy is asked for ``good`` at inference unless the
    observation's ``rating`` names another."""
    d_model: int = 192
    n_heads: int = 4
    n_layers: int = 3
    head_layers: int = 2
    dropout: float = 0.0
    """Dropout in the transformers (costly on a CPU: the random masks dominate small models)."""
    flow_steps: int = 10
    """Euler steps of the flow head at inference."""
    normalization: Literal["mean_std", "min_max"] = "mean_std"
    """How actions and state are normalized (min_max: to [-1, 1])."""
    action_shape: list[int] = field(default_factory=list)
    """Filled from the dataset: ``[A]`` for chunks, ``[K, 3]`` for waypoints."""
    state_dim: int = 0
    """Filled from the dataset (0: no state)."""
    env_state_dim: int = 0
    """Size of ``observation.environment_state`` (a second proprio token); filled from the dataset
    when ``data.features.env_state`` names it (0: not used)."""
    frame_size: list[int] = field(default_factory=list)
    """``[H, W]`` of the training frames (box labels are in their pixels); filled from the dataset."""

    def __post_init__(self):
        for name in self.aux_heads:
            aux_head(name)  # an unknown name raises, listing the known ones
        if 0 not in self.context_strides or min(self.context_strides, default=0) < 0:
            raise ValueError(f"context_strides must be steps back >= 0 and contain 0, got {self.context_strides}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} must be divisible by n_heads {self.n_heads}")
        if self.horizon < 1 or self.grid < 1 or self.flow_steps < 1:
            raise ValueError("horizon, grid and flow_steps must be >= 1")


class Normalizer(nn.Module):
    """Action and state statistics as buffers (so they are saved inside ``model.safetensors``)."""

    def __init__(self, action_shape: tuple[int, ...], state_dim: int, mode: str,
                 stats: Mapping[str, Mapping[str, Any]] | None = None, env_state_dim: int = 0):
        super().__init__()
        self.mode = mode
        self.entries = [("action", "action", tuple(action_shape))]
        if state_dim > 0:
            self.entries.append(("state", STATE, (state_dim,)))
        if env_state_dim > 0:
            self.entries.append(("env_state", ENV_STATE, (env_state_dim,)))
        for prefix, key, shape in self.entries:
            for name in STAT_NAMES:
                value = torch.zeros(shape) if name != "std" else torch.ones(shape)
                if stats is not None:
                    if key not in stats:
                        raise PolicyError(f"normalization statistics for {key!r} are missing "
                                          f"(have: {sorted(stats)})")
                    arr = np.asarray(stats[key][name], dtype=np.float32)
                    if arr.shape != tuple(shape):
                        raise PolicyError(f"statistics of {key!r} have shape {arr.shape}, expected {tuple(shape)}")
                    value = torch.from_numpy(arr.copy())
                self.register_buffer(f"{prefix}_{name}", value)

    def _loc_scale(self, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mode == "min_max":
            lo, hi = getattr(self, f"{prefix}_min"), getattr(self, f"{prefix}_max")
            loc, scale = (hi + lo) / 2, (hi - lo) / 2
        else:
            loc, scale = getattr(self, f"{prefix}_mean"), getattr(self, f"{prefix}_std")
        return loc, torch.where(scale < 1e-4, torch.ones_like(scale), scale)  # constant dims stay put

    def normalize(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        loc, scale = self._loc_scale(prefix)
        return (x - loc) / scale

    def unnormalize(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        loc, scale = self._loc_scale(prefix)
        return x * scale + loc

    def stats(self) -> dict[str, dict[str, np.ndarray]]:
        """The statistics as numpy arrays, keyed like ``robopolicy.data.stats``."""
        return {key: {n: getattr(self, f"{prefix}_{n}").cpu().numpy() for n in STAT_NAMES}
                for prefix, key, _ in self.entries}


def check_io(cfg: PolicyConfig) -> None:
    """The checks of a model config whose dataset-derived fields are filled (cameras, action shape,
    state sizes); each error names the setting. The trainer runs them before it computes anything."""
    if not cfg.cameras and not (cfg.use_state or cfg.env_state_dim > 0):
        raise PolicyError("policy config: 'cameras' is empty and the policy reads no state either "
                          "(the trainer fills the cameras from the dataset)")
    need_camera = [h for h in cfg.aux_heads if aux_head(h).needs_camera]
    if not cfg.cameras and need_camera:
        raise PolicyError(f"model.aux_heads {need_camera} look at camera tokens; this policy has no camera")
    if not cfg.action_shape:
        raise PolicyError("policy config: 'action_shape' is empty (the trainer fills it from the dataset)")
    if cfg.head == "waypoints" and (len(cfg.action_shape) != 2 or cfg.action_shape[1] != 3):
        raise PolicyError(f"waypoint head needs (K, 3) targets, the action feature has shape {cfg.action_shape} "
                          f"(map data.features.action to oracle.waypoints)")
    if cfg.head != "waypoints" and len(cfg.action_shape) != 1:
        raise PolicyError(f"chunk heads need a flat action (A,), got shape {cfg.action_shape}")
    if cfg.use_state and cfg.state_dim < 1:
        raise PolicyError("model.use_state is true but the dataset has no state (data.features.state)")
    if cfg.relative_action:
        rel = list(cfg.relative_action)
        if cfg.head == "waypoints":
            raise PolicyError("model.relative_action is for chunk heads (waypoints are robot-frame already)")
        if not cfg.use_state:
            raise PolicyError("model.relative_action needs model.use_state: true (offsets are from the state)")
        limit = min(cfg.action_shape[0], cfg.state_dim)
        if len(set(rel)) != len(rel) or any(not 0 <= i < limit for i in rel):
            raise PolicyError(f"model.relative_action {rel}: dims must be distinct and below {limit} "
                              f"(action {cfg.action_shape}, state {cfg.state_dim} values)")


def check_loss_heads(cfg: PolicyConfig, weights: Mapping[str, float]) -> dict:
    """The auxiliary heads that compute the nonzero ``weights``, by name; a loss whose head is not in
    ``model.aux_heads`` (or that no head computes) is an error naming both settings."""
    heads = {}
    for loss, weight in weights.items():
        if not float(weight):
            continue
        try:
            head = loss_owner(loss)
        except AuxHeadError as exc:
            raise PolicyError(str(exc)) from None
        if head is None:
            continue
        if head.name not in cfg.aux_heads:
            raise PolicyError(f"loss.{loss} is {weight}, but model.aux_heads {list(cfg.aux_heads)} has no {head.name!r}, "
                              f"the head that computes it: add {head.name!r} to model.aux_heads, or set loss.{loss}: 0")
        heads[head.name] = head
    return heads


def _main_head(cfg: PolicyConfig) -> nn.Module:
    """The output head ``model.head`` names."""
    d = cfg.d_model
    if cfg.head == "waypoints":
        return WaypointHead(cfg.action_shape[0], d, cfg.n_heads, cfg.head_layers, cfg.dropout)
    if cfg.head == "chunk_l1":
        return ChunkL1Head(cfg.horizon, cfg.action_shape[0], d, cfg.n_heads, cfg.head_layers, cfg.dropout)
    return FlowChunkHead(cfg.horizon, cfg.action_shape[0], d, cfg.n_heads, cfg.head_layers, cfg.dropout, cfg.flow_steps)


class Policy(nn.Module):
    """Encoders → fusion transformer → head. See the module docstring for I/O and shapes."""

    def __init__(self, config: PolicyConfig, stats: Mapping[str, Mapping[str, Any]] | None = None):
        super().__init__()
        cfg = self.config = config
        check_io(cfg)
        d = cfg.d_model
        self.vision = self.vision_proj = self.context = None
        self.language = LanguageEncoder(cfg.language) if cfg.language.enabled else None
        if cfg.cameras:
            if any(e.film for e in cfg.encoders) and self.language is None:
                raise PolicyError("model.encoders: film: true conditions the encoder on the instruction; "
                                  "it needs model.language.enabled: true")
            try:
                self.vision = FusedVisionEncoder(list(cfg.encoders), cfg.grid,
                                                 self.language.dim if self.language is not None else 0)
            except EncoderError as exc:
                raise PolicyError(str(exc)) from None
            n_tok = self.vision.n_tokens
            # a LayerNorm over a token of coordinates alone (keypoint_features: false) would map every
            # (x, y) to (+-1, -+1): such tokens are projected as they are
            norm = nn.LayerNorm(self.vision.out_dim) if self.vision.out_dim > 2 else nn.Identity()
            if len(self.vision.encoders) > 1 and all(e.out_dim > 2 for e in self.vision.encoders):
                norm = MemberLayerNorm([e.out_dim for e in self.vision.encoders])  # a pair: each member its own norm
            self.vision_proj = nn.Sequential(norm, nn.Linear(self.vision.out_dim, d))
            self.context = ContextTokens(len(cfg.context_strides), len(cfg.cameras), n_tok, d)
        self.lang_proj = nn.Linear(self.language.dim, d) if self.language else None
        self.lang_pos = (nn.Parameter(torch.randn(cfg.language.max_tokens, d) * 0.02)
                         if self.language is not None and cfg.language.tokens else None)
        self.state_proj = nn.Linear(cfg.state_dim, d) if cfg.use_state else None
        self.env_state_proj = nn.Linear(cfg.env_state_dim, d) if cfg.env_state_dim > 0 else None
        self.rating_embed = nn.Embedding(len(RATING_INDEX), d) if cfg.condition_on_rating else None
        self.backbone = FusionTransformer(d, cfg.n_heads, cfg.n_layers, dropout=cfg.dropout)
        self.head = _main_head(cfg)
        self.aux = nn.ModuleDict()
        for name in cfg.aux_heads:
            try:
                self.aux[name] = aux_head(name).build(cfg, self, stats)
            except AuxHeadError as exc:
                raise PolicyError(str(exc)) from None
        self.normalizer = Normalizer(tuple(cfg.action_shape), cfg.state_dim if cfg.use_state else 0,
                                     cfg.normalization, stats, env_state_dim=cfg.env_state_dim)
        self._t0 = list(cfg.context_strides).index(0)
        self._ring = FeatureRingBuffer(max(cfg.context_strides) + 1)

    # ------------------------------------------------------------------ properties
    @property
    def output(self) -> str:
        """``"waypoints"`` ((B, K, 3)) or ``"chunk"`` ((B, H, A))."""
        return "waypoints" if self.config.head == "waypoints" else "chunk"

    @property
    def horizon(self) -> int:
        """Steps per prediction: H for chunks, K for waypoints."""
        return self.config.action_shape[0] if self.output == "waypoints" else self.config.horizon

    @property
    def cameras(self) -> list[str]:
        return list(self.config.cameras)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def stats(self) -> dict[str, dict[str, np.ndarray]]:
        """Normalization statistics carried by this policy."""
        return self.normalizer.stats()

    # ------------------------------------------------------------------ encoding
    def encode_frames(self, images: torch.Tensor, tasks: Sequence[str] | None = None) -> torch.Tensor:
        """uint8 frames ``(N, 3, H, W)`` → raw encoder features ``(N, n_tokens, C)``; ``tasks``: the
        N frames' instructions, needed by a FiLM-conditioned encoder (``None`` otherwise)."""
        return self.vision(images, self.frame_text(tasks, images.shape[0]))

    def frame_text(self, tasks: Sequence[str] | None, n: int | None = None) -> torch.Tensor | None:
        """The instruction embedding ``(len(tasks), D)`` a FiLM-conditioned encoder needs (``None``
        if it needs none); ``n``: the number of frames, checked against the instructions."""
        if self.vision is None or not self.vision.needs_text:
            return None
        if tasks is None:
            raise PolicyError("the vision encoder is conditioned on the instruction (film): 'task' is needed")
        tasks = [str(t) for t in tasks]
        if n is not None and len(tasks) != n:
            raise PolicyError(f"{len(tasks)} instructions for {n} frames")
        ref = next(self.parameters())
        return self.language.embed(tasks).to(ref.device, ref.dtype)

    def _context_features(self, batch: Mapping[str, Any]) -> torch.Tensor | None:
        """Batch → raw features ``(B, T, V, n, C)`` (cached ``features``, or encoded images);
        ``None`` for a policy without cameras."""
        if self.vision is None:
            return None
        if "features" in batch:
            return batch["features"].float()
        frames = []
        for role in self.config.cameras:
            key = IMAGE_PREFIX + role
            if key not in batch:
                raise PolicyError(f"batch lacks camera {key!r} (policy cameras: {self.config.cameras})")
            frames.append(batch[key])  # (B, T, 3, H, W)
        b, t = frames[0].shape[:2]
        tasks = None
        if self.vision.needs_text:
            if "task" not in batch:
                raise PolicyError("the vision encoder is conditioned on the instruction (film): the batch needs 'task'")
            tasks = [s for s in batch["task"] for _ in range(t)]  # every context frame of a sample
        per_cam = self._encode_cameras([f.flatten(0, 1) for f in frames], tasks)
        return torch.stack([f.view(b, t, *self._feature_shape()) for f in per_cam], dim=2)

    def _encode_cameras(self, frames: list[torch.Tensor], tasks: list[str] | None) -> list[torch.Tensor]:
        """Every camera's frames ``[(N, 3, H, W), ...]`` → their features, in one encoder call when
        the frames have one size. A trainable encoder's BatchNorm then normalizes the cameras
        together in training, as its running statistics (which mix the cameras) do at inference;
        one call per camera would train each camera on its own batch statistics and evaluate it
        on the mixture."""
        n = frames[0].shape[0]
        if len(frames) > 1 and len({tuple(f.shape[1:]) for f in frames}) == 1:
            out = self.encode_frames(torch.cat(frames), None if tasks is None else list(tasks) * len(frames))
            return list(out.split(n))
        return [self.encode_frames(f, tasks) for f in frames]

    def _feature_shape(self) -> tuple[int, int]:
        return (self.vision.n_tokens, self.vision.out_dim)

    def _memory(self, feats: torch.Tensor | None, context_pad: torch.Tensor | None, state: torch.Tensor | None,
                tasks: list[str] | None, with_language: bool = True, with_state: bool = True,
                env_state: torch.Tensor | None = None, rating: torch.Tensor | None = None):
        """Fused memory ``(B, N, d)``, its padding mask ``(B, N)`` and the projected vision tokens
        ``(B, T, V, n, d)`` (``None`` without cameras). ``rating (B,)``: the rating indices of a
        rating-conditioned policy (``None``: good); ``with_state`` covers the rating token too."""
        ref = next(self.parameters())
        tok = vision = vpad = None
        if feats is not None:
            b, t, v, n, _ = feats.shape
            tok = self.vision_proj(feats)
            vision = self.context(tok)
            if context_pad is not None and self.config.mask_padded_context:
                vpad = context_pad[:, :, None].expand(b, t, v * n).reshape(b, t * v * n)
        lang = prop = lang_pad = None
        if self.language is not None and with_language:
            if tasks is None:
                raise PolicyError("the policy is language-conditioned: the batch needs 'task' (the instruction)")
            if self.lang_pos is not None:  # the instruction's token sequence, positions marked
                words, lang_pad = self.language.embed_tokens(tasks)
                lang = self.lang_proj(words.to(ref.device, ref.dtype)) + self.lang_pos[: words.shape[1]]
            else:
                lang = self.lang_proj(self.language.embed(tasks).to(ref.device, ref.dtype))[:, None]
        props = []
        if self.state_proj is not None and with_state:
            if state is None:
                raise PolicyError(f"the policy uses proprio state: the batch needs {STATE!r}")
            props.append(self.state_proj(self.normalizer.normalize("state", state.float()))[:, None])
        if self.env_state_proj is not None and with_state:
            if env_state is None:
                raise PolicyError(f"the policy reads the scene state: the batch needs {ENV_STATE!r}")
            props.append(self.env_state_proj(self.normalizer.normalize("env_state", env_state.float()))[:, None])
        if self.rating_embed is not None and with_state:
            props.append(self._rating_token(rating, props[0] if props else (lang if lang is not None else tok)))
        prop = torch.cat(props, dim=1) if props else None
        memory, pad = self.backbone(vision, lang, prop, vpad, lang_pad)
        return memory, pad, tok

    def _rating_token(self, rating: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """The rating token ``(B, 1, d)`` of ``rating`` (``(B,)`` or one for all ``(1,)``; ``None``:
        good); ``like``: a token tensor of the batch (its size and device)."""
        b = like.shape[0]
        if rating is None:
            rating = torch.tensor([RATING_INDEX["good"]])
        if rating.ndim != 1 or rating.shape[0] not in (1, b):
            raise PolicyError(f"'rating' holds {tuple(rating.shape)} ratings for a batch of {b}")
        return self.rating_embed(rating.to(like.device).long())[:, None].to(like.dtype).expand(b, -1, -1)

    # ------------------------------------------------------------------ training
    def losses(self, batch: Mapping[str, Any], weights: Mapping[str, float]) -> dict[str, torch.Tensor]:
        """Named losses for a loader batch; ``weights`` (``action`` and the auxiliary heads' losses,
        see :mod:`robopolicy.models.aux_heads`) chooses which are computed. ``total`` is their
        weighted sum.

        Batch: ``features (B, T, V, n, C)`` or ``observation.images.<role> (B, T, 3, H, W)``,
        ``observation_is_pad (B, T)``, ``observation.state (B, T, D)``, ``task`` list of B str,
        ``action (B, H, A)`` or waypoints ``(B, 1, K, 3)``, ``action_is_pad (B, H)``, and the
        labels the auxiliary heads declare.
        """
        w = {k: float(v) for k, v in weights.items() if float(v) != 0.0}
        heads = check_loss_heads(self.config, w)
        lb = self._loss_batch(batch)
        out: dict[str, torch.Tensor] = {}
        if "action" in w:
            out["action"] = self._action_loss(batch, lb)
        for name, head in heads.items():
            try:
                computed = head.compute(self, self.aux[name], lb)
            except AuxHeadError as exc:
                raise PolicyError(str(exc)) from None
            out.update({k: v for k, v in computed.items() if k in w})
        out["total"] = sum(w[k] * out[k] for k in out)
        return out

    def _loss_batch(self, batch: Mapping[str, Any]) -> LossBatch:
        """The batch's encodings at the current frame, the fused memory computed on demand."""
        feats = self._context_features(batch)
        ctx_pad = batch.get("observation_is_pad")
        state, env_state = (v[:, self._t0] if v is not None and v.ndim == 3 else v
                            for v in (batch.get(STATE), batch.get(ENV_STATE)))
        tasks = list(batch["task"]) if "task" in batch else None
        rating = batch.get("rating")
        if self.rating_embed is not None and rating is None:
            raise PolicyError("the policy is conditioned on the rating (model.condition_on_rating): the batch "
                              "needs 'rating' (the episodes' rating indices, see robopolicy.teleop.ratings)")

        def fuse():
            memory, pad, _ = self._memory(feats, ctx_pad, state, tasks, env_state=env_state, rating=rating)
            return memory, pad

        return LossBatch(batch, feats, ctx_pad, state, env_state, tasks, fuse)

    def _action_loss(self, batch: Mapping[str, Any], lb: LossBatch) -> torch.Tensor:
        """The main head's imitation loss against ``batch["action"]`` (normalized units)."""
        target = batch["action"].float()
        if self.output == "waypoints":
            target, act_pad = target[:, 0], None  # (B, 1, K, 3): the K waypoints at t
        else:
            act_pad = batch.get("action_is_pad")
            target = self.to_relative(target, lb.state)
        memory, pad = lb.fused()
        return self.head.loss(memory, pad, self.normalizer.normalize("action", target), act_pad)

    def _locate_inputs(self, current: torch.Tensor, state: torch.Tensor | None, tasks: list[str] | None) -> torch.Tensor:
        """The ``mlp`` locate head's input ``(B, F)``: the current frame's raw tokens of every camera
        (``current (B, V, n, C)``), the instruction embedding and the normalized joint state
        (unless ``locate_state`` is off)."""
        parts = [current.flatten(1).float()]
        if self.language is not None:
            if tasks is None:
                raise PolicyError("the locate head reads the instruction: the batch needs 'task'")
            parts.append(self.language.embed(tasks).to(parts[0].device, parts[0].dtype))
        if self.config.use_state and self.config.locate_state:
            if state is None:
                raise PolicyError(f"the locate head reads the joint state: the batch needs {STATE!r}")
            parts.append(self.normalizer.normalize("state", state.float()))
        return torch.cat(parts, dim=-1)

    # ------------------------------------------------------------------ inference
    def reset(self, rows: Sequence[int] | None = None) -> None:
        """Forget the temporal context (call at every episode start); ``rows``: only those batch
        rows start a new episode (sub-envs of a vector env that were just reset)."""
        self._ring.reset(rows)

    def _obs_tasks(self, obs: Mapping[str, Any], b: int) -> list[str] | None:
        """The batch's instructions (``None`` for a policy without language)."""
        if self.language is None:
            return None
        if "task" not in obs:
            raise PolicyError("observation lacks 'task' (the policy is language-conditioned)")
        task = obs["task"]
        tasks = [task] * b if isinstance(task, str) else [str(s) for s in task]
        if len(tasks) != b:
            raise PolicyError(f"'task' holds {len(tasks)} instructions for a batch of {b}")
        return tasks

    def _obs_rating(self, obs: Mapping[str, Any]) -> torch.Tensor | None:
        """The asked-for ratings ``(B,)`` or ``(1,)`` (broadcast): ``obs["rating"]``, one for the batch or one
        per row; ``None`` (good) when absent or the policy is not conditioned on the rating."""
        if self.rating_embed is None or obs.get("rating") is None:
            return None
        asked = obs["rating"]
        rows = [asked] if isinstance(asked, (str, bool, int, np.integer, np.bool_)) else list(asked)
        try:
            index = torch.tensor([rating_index(r) for r in rows], dtype=torch.long)
        except ValueError as exc:
            raise PolicyError(f"observation 'rating': {exc}") from None
        return index

    def _obs_features(self, obs: Mapping[str, Any]) -> tuple[torch.Tensor, int]:
        """Encode the current frame of every camera: ``(B, V, n, C)``. A FiLM-conditioned encoder
        reads the instruction too; the ring buffer then holds features of the episode's instruction
        (the envs keep one instruction per episode)."""
        frames = []
        for role in self.config.cameras:
            key = IMAGE_PREFIX + role
            if key not in obs:
                raise PolicyError(f"observation lacks {key!r} (policy cameras: {self.config.cameras}; "
                                  f"observation keys: {sorted(obs)})")
            img = torch.as_tensor(np.asarray(obs[key]) if not isinstance(obs[key], torch.Tensor) else obs[key])
            if img.ndim == 3:
                img = img[None]
            if img.ndim != 4:
                raise PolicyError(f"{key}: expected (B, H, W, 3) images, got shape {tuple(img.shape)}")
            if img.shape[-1] == 3 and img.shape[1] != 3:
                img = img.permute(0, 3, 1, 2)
            if frames and img.shape[0] != frames[0].shape[0]:
                raise PolicyError(f"{key}: batch of {img.shape[0]}, the first camera has {frames[0].shape[0]}")
            frames.append(img.to(self.device))
        tasks = self._obs_tasks(obs, frames[0].shape[0]) if self.vision.needs_text else None
        feats = torch.stack(self._encode_cameras(frames, tasks), dim=1)
        return feats, feats.shape[0]

    def observe(self, obs: Mapping[str, Any]) -> None:
        """Push the frame of an env step on which no prediction is needed (keeps strides in env steps)."""
        if max(self.config.context_strides) == 0 or self.vision is None:
            return
        self.eval()
        with torch.inference_mode():
            self._ring.push(self._obs_features(obs)[0])

    def predict(self, obs: Mapping[str, Any], flow_steps: int | None = None) -> torch.Tensor:
        """Observation batch → ``(B, H, A)`` actions or ``(B, K, 3)`` waypoints in env units (CPU float32).
        A rating-conditioned policy acts as in the episodes rated ``obs["rating"]`` (default ``good``)."""
        self.eval()
        with torch.inference_mode():
            ctx, ctx_pad, state, env_state, tasks = self._inputs(obs)
            rating = self._obs_rating(obs)
            memory, mpad, _ = self._memory(ctx, ctx_pad, state, tasks, env_state=env_state, rating=rating)
            if isinstance(self.head, FlowChunkHead):
                out = self.head(memory, mpad, steps=flow_steps)
            else:
                out = self.head(memory, mpad)
            return self.from_relative(self.normalizer.unnormalize("action", out).float(), state).cpu()

    def locate(self, obs: Mapping[str, Any]) -> torch.Tensor:
        """Observation batch → the ``locate`` head's estimate ``(B, locate_dim)`` in label units
        (those of ``model.locate_label``), CPU float32. Like
        :meth:`predict`, it pushes the frame into the temporal context."""
        if "locate" not in self.aux:
            raise PolicyError("this policy has no locate head (model.aux_heads: [locate])")
        self.eval()
        with torch.inference_mode():
            ctx, ctx_pad, state, env_state, tasks = self._inputs(obs)
            if self.config.locate_head == "mlp":
                inputs = self._locate_inputs(ctx[:, self._t0], state, tasks)
                return self.aux["locate"](inputs).float().cpu()
            memory, mpad, _ = self._memory(ctx, ctx_pad, state, tasks, env_state=env_state,
                                           rating=self._obs_rating(obs))
            return self.aux["locate"](memory, mpad).float().cpu()

    def _inputs(self, obs: Mapping[str, Any]):
        """One observation batch → ``(context features (B, T, V, n, C) or None, context padding,
        state (B, D) or None, scene state (B, E) or None, instructions or None)``; the frame is
        encoded once and pushed into the ring buffer."""
        ctx = ctx_pad = None
        if self.vision is not None:
            feats, b = self._obs_features(obs)
            self._ring.push(feats)
            ctx, pad = self._ring.context(self.config.context_strides)  # (B, T, V, n, C), (B, T)
            ctx_pad = pad.to(self.device)
        vectors = [(STATE, self.config.state_dim, self.state_proj is not None, "the policy uses proprio state"),
                   (ENV_STATE, self.config.env_state_dim, self.env_state_proj is not None,
                    "the policy reads the scene state: make the env with env_state=true")]
        got = []
        for key, dim, used, why in vectors:
            if not used:
                got.append(None)
                continue
            if key not in obs:
                raise PolicyError(f"observation lacks {key!r} ({why}; observation keys: {sorted(obs)})")
            value = torch.as_tensor(np.asarray(obs[key], dtype=np.float32)).to(self.device)
            value = value.reshape(-1, value.shape[-1]) if value.ndim else value.reshape(1, 1)
            if value.shape[1] != dim:
                raise PolicyError(f"{key}: expected {dim} values, got {value.shape[1]}")
            got.append(value)
        state, env_state = got
        if self.vision is None:
            b = next(v for v in got if v is not None).shape[0]
        for v, key in ((state, STATE), (env_state, ENV_STATE)):
            if v is not None and v.shape[0] != b:
                raise PolicyError(f"{key}: batch of {v.shape[0]}, the rest of the observation has {b}")
        return ctx, ctx_pad, state, env_state, self._obs_tasks(obs, b)

    def to_relative(self, chunk: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """Env-unit chunk ``(B, H, A)`` → the head's targets: ``relative_action`` dims minus the state now."""
        return self._shift_relative(chunk, state, -1.0)

    def from_relative(self, chunk: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        """Inverse of :meth:`to_relative`: head output (unnormalized) → env units."""
        return self._shift_relative(chunk, state, 1.0)

    def _shift_relative(self, chunk: torch.Tensor, state: torch.Tensor | None, sign: float) -> torch.Tensor:
        dims = list(self.config.relative_action)
        if not dims:
            return chunk
        if state is None:
            raise PolicyError(f"model.relative_action needs {STATE!r} in the batch")
        out = chunk.clone()
        out[..., dims] = chunk[..., dims] + sign * state[:, None, dims].to(chunk.dtype)
        return out

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str | Path) -> Path:
        """Write ``model.safetensors`` (weights + normalization stats) and ``config.yaml``, atomically."""
        import yaml
        from safetensors.torch import save_file

        directory = Path(directory)
        cfg = to_dict(self.config)
        state = {k: v.detach().cpu().contiguous().clone() for k, v in self.state_dict().items()}
        with atomic_directory(directory) as tmp:
            save_file(state, str(tmp / WEIGHTS_FILE),
                      metadata={"format": str(CHECKPOINT_FORMAT), "policy_config": json.dumps(cfg, sort_keys=True)})
            (tmp / CONFIG_FILE).write_text(yaml.safe_dump({"format": CHECKPOINT_FORMAT, "type": "policy", "policy": cfg},
                                                            sort_keys=False))
        return directory

    @staticmethod
    def read_checkpoint(directory: str | Path) -> tuple[PolicyConfig, dict[str, torch.Tensor], dict]:
        """``(config, state dict, saved config dict)`` of a checkpoint directory, every problem named."""
        from safetensors import safe_open

        directory = Path(directory)
        if not directory.is_dir():
            raise PolicyError(f"{directory}: checkpoint directory not found")
        cfg_path, weights = directory / CONFIG_FILE, directory / WEIGHTS_FILE
        data = load_yaml(cfg_path) if cfg_path.is_file() else {}
        if data.get("type", "policy") != "policy":
            raise PolicyError(f"{cfg_path}: a {data['type']!r} checkpoint, not a plain policy "
                              f"(robopolicy.models.load_policy loads any kind)")
        for p in (cfg_path, weights):
            if not p.is_file():
                raise PolicyError(f"{p}: file is missing (a checkpoint holds {CONFIG_FILE} and {WEIGHTS_FILE})")
        if data.get("format") != CHECKPOINT_FORMAT or "policy" not in data:
            raise PolicyError(f"{cfg_path}: not a robopolicy checkpoint config (format {data.get('format')!r})")
        try:
            config = build(PolicyConfig, data["policy"], source=str(cfg_path), prefix="policy.")
        except ConfigError as exc:
            raise PolicyError(str(exc)) from None
        try:
            with safe_open(str(weights), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                state = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise PolicyError(f"{weights}: cannot read the weights (truncated or corrupt safetensors file): "
                              f"{exc}") from None
        saved = json.loads(meta["policy_config"]) if "policy_config" in meta else None
        return config, state, saved or {}

    @classmethod
    def load(cls, directory: str | Path, device: str | torch.device = "cpu") -> "Policy":
        """Rebuild a policy saved with :meth:`save`; mismatches name the config keys or tensors."""
        config, state, saved = cls.read_checkpoint(directory)
        if saved:
            # a checkpoint written before a config field existed has no entry for it: the field's
            # default (the behaviour it was trained with) stands in, so older checkpoints still load
            try:
                saved = to_dict(build(PolicyConfig, saved, source=str(Path(directory) / WEIGHTS_FILE), prefix="policy."))
            except ConfigError:
                pass  # a key this version does not know: the comparison below names it
            diff = _config_diff(json.loads(json.dumps(saved)), json.loads(json.dumps(to_dict(config))))
            if diff:
                raise PolicyError(f"{Path(directory) / WEIGHTS_FILE} was saved with another config than "
                                  f"{Path(directory) / CONFIG_FILE}: " + "; ".join(diff[:5]))
        policy = cls(config)
        policy._load_state(state, Path(directory) / WEIGHTS_FILE)
        return policy.to(device)

    def _load_state(self, state: Mapping[str, torch.Tensor], source: Path) -> None:
        own = self.state_dict()
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        shapes = [f"{k}: {tuple(state[k].shape)} in the file, {tuple(own[k].shape)} here"
                  for k in own if k in state and state[k].shape != own[k].shape]
        if missing or unexpected or shapes:
            parts = []
            if shapes:
                parts.append(f"{len(shapes)} tensors differ in shape (e.g. {shapes[0]})")
            if missing:
                parts.append(f"{len(missing)} tensors missing (e.g. {missing[0]})")
            if unexpected:
                parts.append(f"{len(unexpected)} unexpected tensors (e.g. {unexpected[0]})")
            raise PolicyError(f"{source}: the checkpoint comes from another model config: " + "; ".join(parts))
        self.load_state_dict(state)

    def load_pretrained(self, directory: str | Path) -> dict[str, list[str]]:
        """Initialise from an earlier stage's checkpoint: every tensor whose name and shape match
        (encoders, projections, backbone, shared heads); the normalizer stays this dataset's.
        Architecture keys (``ARCHITECTURE_KEYS``) must agree. Returns loaded / skipped names."""
        config, state, _ = self.read_checkpoint(directory)
        src, dst = _architecture(to_dict(config)), _architecture(to_dict(self.config))
        diff = [f"model.{k}: {src[k]!r} in {directory}, {dst[k]!r} here"
                for k in ARCHITECTURE_KEYS if src[k] != dst[k]]
        if diff:
            raise PolicyError(f"cannot start from {directory}: its model differs: " + "; ".join(diff))
        own = self.state_dict()
        # the locate head's label statistics, like the normalizer's, are this dataset's (and this
        # run's label may be another one of the same size)
        own_stats = ("normalizer.", "aux.locate.mean", "aux.locate.std")
        loaded = {k: v for k, v in state.items()
                  if k in own and v.shape == own[k].shape and not k.startswith(own_stats)}
        # A stage may change the head (waypoints → chunk, another horizon), the proprio size or
        # the number of context frames: those tensors start fresh. Anything else of another
        # shape is a different model.
        bad = [k for k, v in state.items() if k in own and v.shape != own[k].shape
               and not k.startswith(("normalizer.", "head.", "aux.", "state_proj.", "context.time"))]
        if bad:
            raise PolicyError(f"cannot start from {directory}: tensor {bad[0]} has shape {tuple(state[bad[0]].shape)} "
                              f"there, {tuple(own[bad[0]].shape)} here")
        self.load_state_dict(loaded, strict=False)
        return {"loaded": sorted(loaded),
                "new": sorted(k for k in own if k not in loaded and not k.startswith(own_stats))}


def _architecture(cfg: dict) -> dict:
    """The architecture keys of a config dict. Whether an encoder is frozen, and the file its
    initial weights came from, are not architecture: a stage may freeze (or unfreeze) the encoder
    it inherits, whose weights come from the previous stage's checkpoint anyway."""
    out = {k: cfg[k] for k in ARCHITECTURE_KEYS}
    out["encoders"] = [{k: v for k, v in dict(e).items() if k not in ("frozen", "weights")} for e in cfg["encoders"]]
    return out


def _config_diff(a: Mapping, b: Mapping, prefix: str = "model.") -> list[str]:
    """Human-readable differences between two nested config dicts."""
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, Mapping) and isinstance(vb, Mapping):
            out += _config_diff(va, vb, f"{prefix}{key}.")
        elif va != vb:
            out.append(f"{prefix}{key}: {va!r} vs {vb!r}")
    return out
