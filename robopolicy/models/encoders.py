"""Vision encoders: timm backbones turned into a small grid of tokens per frame.

    enc = VisionEncoder(EncoderConfig(name="efficientnet_lite0", weights="imagenet", image_size=96))
    feats = enc(images_uint8)            # (N, 3, H, W) uint8 -> (N, G*G, C) float

Two encoders can run side by side (:class:`FusedVisionEncoder`, ``model.encoders: [a, b]``): a
complementary pair that sees differently, e.g. EfficientNet-Lite0 at the frames' full
resolution read at stride 16 (spatial detail) beside Lite2's last map (deeper, more global
features). Each is pooled to the same ``G x G`` grid and their channels are concatenated, so a
frame always becomes ``G*G`` tokens of ``sum(C_i)`` raw features. Raw features are what the
feature cache stores, one file per frozen member (keyed by that member's identity); the policy
normalizes each member's channels on their own and projects the concatenation to ``d_model``
(see ``Policy.vision_proj``).

Two options serve small objects named by the instruction (a 2.5 cm cube is ~4 px wide in a
96 px view, and average-pooling it into a grid cell drowns it):

- ``film: true`` modulates every residual stage's output by the instruction embedding
  (``x * (1 + gamma(text)) + beta(text)``, per channel, zero-initialised so it starts as the plain
  network; BC-Z / RT-1 condition their image encoders this way). The encoder can then keep the
  named cube's colour and suppress the others before anything is pooled.
  ``forward(images, text)`` needs the text embedding ``(N, D)`` then.
- ``pool: keypoints`` replaces the grid by a spatial softmax (as in Levine et al.'s visuomotor
  policies and robomimic): K learned attention maps over the last feature map, each giving a
  token ``[x, y, attended features]`` with sub-cell precision, so a frame becomes K tokens of
  ``C + 2`` features.

Weights are never downloaded: ``pretrained=False`` always, and ``weights`` is ``imagenet`` (the
ImageNet checkpoint that ships in a package, for efficientnet_lite0..2: see
:mod:`robopolicy.models.pretrained`) or names a local file (``.safetensors``, or a ``.pth``/``.bin``
state dict read with ``weights_only=True``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class EncoderError(ValueError):
    """An encoder cannot be built or its weights cannot be loaded; the message says which."""


@dataclass
class EncoderConfig:
    """One vision backbone."""

    name: str = "efficientnet_lite0"
    """timm model name (efficientnet_lite0, resnet18, vit_tiny_patch16_224, ...)."""
    weights: str | None = None
    """``imagenet``: the packaged ImageNet weights (efficientnet_lite0..2); a local weights file
    (.safetensors / .pth / .bin, timm or EfficientNet-PyTorch keys); None: random init. Never
    downloaded."""
    frozen: bool = True
    """Frozen encoders run in eval mode without gradients, and their features can be cached. A
    training recipe may freeze only weights that come from somewhere (``weights`` or ``init_from``)."""
    image_size: int = 96
    """Frames are resized to this square size before the encoder (ViTs are built for it)."""
    stage: int | None = None
    """Read an intermediate feature map (timm ``features_only`` stage index, e.g. 2 for
    ResNet layer2 at stride 8) instead of the last one. Earlier stages keep the spatial detail a
    stride-32 map loses at 96 px (3 x 3) and cost a fraction of the full network; with random
    weights they are also the more useful features (colour and edge filters). None: the last."""
    film: bool = False
    """Condition each residual stage on the instruction embedding (FiLM); needs ``stage`` (the
    stages are run one by one) and a language model in the policy."""
    pool: str = "grid"
    """``grid``: average-pool to ``grid x grid`` tokens; ``keypoints``: spatial softmax, ``keypoints`` tokens."""
    keypoints: int = 32
    """Tokens of ``pool: keypoints``."""
    keypoint_features: bool = True
    """Keypoint tokens carry the attended features beside ``(x, y)``; False: coordinates only."""
    channels_last: bool = True
    """Run a convolutional backbone's weights and frames in channels-last (NHWC) memory layout,
    which oneDNN's CPU convolutions (and GPU tensor cores) run faster; the same numbers either
    way. Ignored for transformer backbones."""

    def __post_init__(self):
        if self.pool not in ("grid", "keypoints"):
            raise ValueError(f"encoder pool must be 'grid' or 'keypoints', got {self.pool!r}")
        if self.keypoints < 1:
            raise ValueError(f"encoder keypoints must be >= 1, got {self.keypoints}")
        if self.film and self.stage is None:
            raise ValueError("encoder film: true needs a feature stage (e.g. stage: 2): FiLM runs the stages one by one")


class SpatialSoftmax(nn.Module):
    """``(N, C, H, W)`` → ``(N, K, 2 + C)``: for each of K learned attention maps (a 1x1 conv and a
    softmax over the positions, with a learned temperature) its expected ``(x, y)`` in [-1, 1] and
    the features it attends to (layer-normalized, divided by sqrt(C))."""

    def __init__(self, channels: int, k: int, features: bool = True):
        super().__init__()
        self.attn = nn.Conv2d(channels, k, 1)
        self.log_temp = nn.Parameter(torch.zeros(()))
        self.features = bool(features)
        self.out_dim = 2 + (channels if self.features else 0)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        n, c, h, w = f.shape
        a = (self.attn(f).flatten(2) / self.log_temp.exp()).softmax(-1)  # (N, K, HW)
        ys = torch.linspace(-1.0, 1.0, h, device=f.device, dtype=f.dtype)
        xs = torch.linspace(-1.0, 1.0, w, device=f.device, dtype=f.dtype)
        gy, gx = torch.meshgrid(ys, xs, indexing="ij")  # row-major positions, as flatten(2) orders them
        pos = torch.stack([gx.reshape(-1), gy.reshape(-1)], -1)  # (HW, 2) x, y
        if not self.features:
            return a @ pos
        # attended features at unit total scale: raw activations are many times larger than the
        # coordinates, and the policy's LayerNorm over the token would drown x and y in them
        feats = F.layer_norm(a @ f.flatten(2).transpose(1, 2), (c,)) / math.sqrt(c)
        return torch.cat([a @ pos, feats], dim=-1)


def _load_state_dict(path: str) -> dict[str, torch.Tensor]:
    p = Path(path)
    if not p.is_file():
        raise EncoderError(f"encoder weights file not found: {p}")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(p))
        state = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any reader error becomes a named one
        raise EncoderError(f"{p}: cannot read encoder weights ({type(exc).__name__}: {exc})") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise EncoderError(f"{p}: expected a state dict, got {type(state).__name__}")
    return state


class VisionEncoder(nn.Module):
    """A timm backbone → ``(N, n_tokens, C)`` raw features for uint8 frames ``(N, 3, H, W)``
    (``n_tokens``: ``grid * grid``, or ``keypoints``)."""

    def __init__(self, cfg: EncoderConfig, grid: int = 3, text_dim: int = 0):
        super().__init__()
        import timm

        from robopolicy.models import pretrained

        self.cfg, self.grid = cfg, int(grid)
        kwargs = {"img_size": cfg.image_size} if cfg.name.startswith(("vit", "deit", "eva")) else {}
        build_kwargs, mean_std = pretrained.conventions(cfg.name)  # e.g. TensorFlow padding for Lite
        kwargs.update(build_kwargs)
        source = pretrained.resolve_weights(cfg.name, cfg.weights)
        # FiLM needs every stage's output: ask for all of them (they are computed anyway)
        indices = tuple(range(int(cfg.stage) + 1)) if cfg.film else (cfg.stage,)
        try:
            if cfg.stage is None:
                self.net = timm.create_model(cfg.name, pretrained=False, num_classes=0, global_pool="", **kwargs)
            else:
                self.net = timm.create_model(cfg.name, pretrained=False, features_only=True,
                                             out_indices=tuple(int(i) for i in indices), **kwargs)
        except RuntimeError as exc:
            raise EncoderError(f"timm has no model {cfg.name!r} ({exc})") from None
        except (IndexError, ValueError, AssertionError) as exc:
            raise EncoderError(f"timm {cfg.name!r} has no feature stage {cfg.stage} ({exc})") from None
        if source is not None:
            pretrained.load_weights(self.net, source, cfg.name)
        data_cfg = getattr(self.net, "pretrained_cfg", {}) or {}
        mean = data_cfg.get("mean", (0.485, 0.456, 0.406))
        std = data_cfg.get("std", (0.229, 0.224, 0.225))
        if mean_std is not None:
            mean, std = mean_std  # the normalisation the family's weights were trained with
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.num_prefix = int(getattr(self.net, "num_prefix_tokens", 0) or 0)
        if cfg.stage is None:
            self.out_dim = int(self.net.num_features)
        else:
            self.out_dim = int(self.net.feature_info.channels()[-1])
        self.film = None
        if cfg.film:
            if text_dim < 1:
                raise EncoderError(f"encoder {cfg.name!r} has film: true but the policy has no language "
                                   "model (model.language.enabled: true is needed)")
            if not isinstance(self.net, nn.ModuleDict):
                raise EncoderError(f"film: true runs the stages of {cfg.name!r} one by one, which its timm "
                                   f"feature wrapper ({type(self.net).__name__}) does not allow; use a ResNet")
            names, channels = self.net.feature_info.module_name(), self.net.feature_info.channels()
            self.film = nn.ModuleDict({n.replace(".", "_"): nn.Linear(text_dim, 2 * c) for n, c in zip(names, channels)})
            self._film_at = {n: n.replace(".", "_") for n in names}
            for lin in self.film.values():  # zero: the modulation starts as the identity
                nn.init.zeros_(lin.weight)
                nn.init.zeros_(lin.bias)
        # NHWC for convolutional backbones (a ViT's one convolution is its patch embedding)
        n_convs = sum(isinstance(m, nn.Conv2d) for m in self.net.modules())
        self.channels_last = bool(cfg.channels_last) and n_convs > 1
        if self.channels_last:
            self.net.to(memory_format=torch.channels_last)
        self.keypoints = (SpatialSoftmax(self.out_dim, cfg.keypoints, cfg.keypoint_features)
                          if cfg.pool == "keypoints" else None)
        self.n_tokens = cfg.keypoints if self.keypoints is not None else self.grid * self.grid
        if self.keypoints is not None:
            self.out_dim = self.keypoints.out_dim
        if cfg.frozen:
            self.requires_grad_(False)
            self.eval()

    @property
    def needs_text(self) -> bool:
        return self.film is not None

    def describe(self) -> str:
        """What this encoder computes, in words: ``name@size[/sN][/film][/kpK[xy]]``."""
        c = self.cfg
        return (f"{c.name}@{c.image_size}" + (f"/s{c.stage}" if c.stage is not None else "") + ("/film" if c.film else "")
                + (f"/kp{c.keypoints}" + ("" if c.keypoint_features else "xy") if self.keypoints is not None else ""))

    def cache_key(self) -> str:
        """Identity of this encoder's features, for the feature cache: what it computes
        (:meth:`describe`), the grid and a digest of its actual weights (a random init differs
        from seed to seed, and a stage may load its encoder from the previous one). Two members
        of a fused encoder have different keys, so their cached features never collide, and a
        member keeps its key in any pair, so its features are shared between recipes."""
        h = hashlib.blake2b(digest_size=8)
        for name, tensor in sorted(self.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return f"{self.describe()}|grid{self.grid}|{h.hexdigest()}"

    def train(self, mode: bool = True):
        super().train(mode)
        if self.cfg.frozen:
            for m in self.children():
                m.eval()  # frozen: BatchNorm statistics never move
        return self

    def _film_forward(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        text = text.to(x.dtype)
        for name, module in self.net.items():
            x = module(x)
            if name in self._film_at:
                gamma, beta = self.film[self._film_at[name]](text).chunk(2, dim=-1)
                x = x * (1.0 + gamma[:, :, None, None]) + beta[:, :, None, None]
        return x

    def forward(self, images: torch.Tensor, text: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 (or [0, 1] float) images ``(N, 3, H, W)`` → features ``(N, n_tokens, C)``;
        ``text (N, D)``: the instruction embedding of each frame (needed with ``film``)."""
        if self.film is not None:
            if text is None:
                raise EncoderError(f"encoder {self.cfg.name!r} is FiLM-conditioned: it needs the instruction embedding")
            if text.shape[0] != images.shape[0]:
                raise EncoderError(f"{text.shape[0]} instruction embeddings for {images.shape[0]} frames")
        x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
        size = self.cfg.image_size
        if x.shape[-2:] != (size, size):
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        x = (x - self.mean) / self.std
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.cfg.frozen):
            if self.film is not None:
                y = self._film_forward(x, text)
            else:
                y = self.net.forward_features(x) if self.cfg.stage is None else self.net(x)[-1]
            if self.keypoints is not None:
                if y.ndim != 4:
                    raise EncoderError(f"{self.cfg.name}: pool 'keypoints' needs a convolutional feature map")
                return self.keypoints(y)
        if y.ndim == 3:  # ViT-like (N, prefix + P, C): patch tokens back onto their grid
            patches = y[:, self.num_prefix:]
            side = int(math.isqrt(patches.shape[1]))
            if side * side != patches.shape[1]:
                raise EncoderError(f"{self.cfg.name}: {patches.shape[1]} patch tokens are not a square grid")
            y = patches.transpose(1, 2).reshape(y.shape[0], -1, side, side)
        if y.shape[-2:] != (self.grid, self.grid):
            y = F.adaptive_avg_pool2d(y, self.grid)
        return y.flatten(2).transpose(1, 2)


class FusedVisionEncoder(nn.Module):
    """One or more encoders on the same frames, channel-concatenated on a shared grid.

    ``forward``: uint8 ``(N, 3, H, W)`` → ``(N, grid*grid, sum of out_dim)``.
    """

    def __init__(self, cfgs: list[EncoderConfig], grid: int = 3, text_dim: int = 0):
        super().__init__()
        if not cfgs:
            raise EncoderError("at least one vision encoder is needed (model.encoders is empty)")
        self.encoders = nn.ModuleList(VisionEncoder(c, grid, text_dim) for c in cfgs)
        self.grid = grid
        self.out_dim = sum(e.out_dim for e in self.encoders)
        counts = sorted({e.n_tokens for e in self.encoders})
        if len(counts) > 1:
            raise EncoderError(f"fused encoders must give the same number of tokens per frame, got {counts} "
                               "(grid x grid, or keypoints)")
        self.n_tokens = counts[0]

    @property
    def needs_text(self) -> bool:
        """True when an encoder is FiLM-conditioned on the instruction."""
        return any(e.needs_text for e in self.encoders)

    @property
    def frozen(self) -> bool:
        """True when every encoder is frozen (then features can be cached)."""
        return all(e.cfg.frozen for e in self.encoders)

    def cache_key(self) -> str:
        """Identity of what the fused encoder computes: its members' keys joined by ``+``."""
        return "+".join(e.cache_key() for e in self.encoders)

    def forward(self, images: torch.Tensor, text: torch.Tensor | None = None) -> torch.Tensor:
        """``(N, 3, H, W)`` (and ``text (N, D)`` with FiLM) → ``(N, n_tokens, out_dim)``."""
        return torch.cat([e(images, text) for e in self.encoders], dim=-1)


class MemberLayerNorm(nn.Module):
    """LayerNorm over each member's channels of a fused feature ``(..., sum C_i)`` on their own.

    One LayerNorm over the concatenation would take its mean and variance mostly from the member
    with more (or larger) channels, e.g. Lite2's 352 last-map channels beside Lite0's 112 at
    stride 16, and squash the other; normalizing each member first gives both the same footing
    before the shared projection."""

    def __init__(self, dims: list[int]):
        super().__init__()
        self.dims = [int(d) for d in dims]
        self.norms = nn.ModuleList(nn.LayerNorm(d) for d in self.dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([n(part) for n, part in zip(self.norms, x.split(self.dims, dim=-1))], dim=-1)
