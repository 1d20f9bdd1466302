"""Vision encoders: timm backbones turned into a small grid of tokens per frame.

    enc = VisionEncoder(EncoderConfig(name="resnet18", frozen=True, image_size=96))
    feats = enc(images_uint8)            # (N, 3, H, W) uint8 -> (N, G*G, C) float

Two encoders can run side by side (:class:`FusedVisionEncoder`; e.g. a semantic ViT and a
spatial CNN): each is pooled to the same ``G x G`` grid and their channels are concatenated, so
a frame always becomes ``G*G`` tokens of ``sum(C_i)`` raw features. Raw features are what the
feature cache stores; the policy projects them to ``d_model`` afterwards.

Weights are never downloaded: ``pretrained=False`` always, and ``weights`` names a local file
(``.safetensors``, or a ``.pth``/``.bin`` state dict read with ``weights_only=True``).
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

    name: str = "resnet18"
    """timm model name (resnet18, resnet34, efficientnet_b0, vit_tiny_patch16_224, ...)."""
    weights: str | None = None
    """Local weights file (.safetensors / .pth / .bin); None: random init (never downloaded)."""
    frozen: bool = True
    """Frozen encoders run in eval mode without gradients, and their features can be cached."""
    image_size: int = 96
    """Frames are resized to this square size before the encoder (ViTs are built for it)."""
    stage: int | None = None
    """Read an intermediate feature map (timm ``features_only`` stage index, e.g. 2 for
    ResNet layer2 at stride 8) instead of the last one. Earlier stages keep the spatial detail a
    stride-32 map loses at 96 px (3 x 3) and cost a fraction of the full network; with random
    weights they are also the more useful features (colour and edge filters). None: the last."""


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
    """A timm backbone → ``(N, grid*grid, C)`` raw features for uint8 frames ``(N, 3, H, W)``."""

    def __init__(self, cfg: EncoderConfig, grid: int = 3):
        super().__init__()
        import timm

        self.cfg, self.grid = cfg, int(grid)
        kwargs = {"img_size": cfg.image_size} if cfg.name.startswith(("vit", "deit", "eva")) else {}
        try:
            if cfg.stage is None:
                self.net = timm.create_model(cfg.name, pretrained=False, num_classes=0, global_pool="", **kwargs)
            else:
                self.net = timm.create_model(cfg.name, pretrained=False, features_only=True,
                                             out_indices=(int(cfg.stage),), **kwargs)
        except RuntimeError as exc:
            raise EncoderError(f"timm has no model {cfg.name!r} ({exc})") from None
        except (IndexError, ValueError, AssertionError) as exc:
            raise EncoderError(f"timm {cfg.name!r} has no feature stage {cfg.stage} ({exc})") from None
        if cfg.weights:
            state = _load_state_dict(cfg.weights)
            # strict=False: classifier weights, and with ``stage`` the unused later layers, are extra
            missing, _ = self.net.load_state_dict(state, strict=False)
            missing = [k for k in missing if not k.startswith(("fc.", "head", "classifier"))]
            if missing:
                raise EncoderError(f"{cfg.weights}: weights do not fit timm {cfg.name!r}: "
                                   f"{len(missing)} missing keys, e.g. {missing[:3]}")
        data_cfg = getattr(self.net, "pretrained_cfg", {}) or {}
        mean = data_cfg.get("mean", (0.485, 0.456, 0.406))
        std = data_cfg.get("std", (0.229, 0.224, 0.225))
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.num_prefix = int(getattr(self.net, "num_prefix_tokens", 0) or 0)
        if cfg.stage is None:
            self.out_dim = int(self.net.num_features)
        else:
            self.out_dim = int(self.net.feature_info.channels()[-1])
        if cfg.frozen:
            self.net.requires_grad_(False)
            self.net.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        if self.cfg.frozen:
            self.net.eval()  # frozen: BatchNorm statistics never move
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (or [0, 1] float) images ``(N, 3, H, W)`` → features ``(N, grid*grid, C)``."""
        x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
        size = self.cfg.image_size
        if x.shape[-2:] != (size, size):
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        x = (x - self.mean) / self.std
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.cfg.frozen):
            y = self.net.forward_features(x) if self.cfg.stage is None else self.net(x)[-1]
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

    def __init__(self, cfgs: list[EncoderConfig], grid: int = 3):
        super().__init__()
        if not cfgs:
            raise EncoderError("at least one vision encoder is needed (model.encoders is empty)")
        self.encoders = nn.ModuleList(VisionEncoder(c, grid) for c in cfgs)
        self.grid = grid
        self.out_dim = sum(e.out_dim for e in self.encoders)

    @property
    def frozen(self) -> bool:
        """True when every encoder is frozen (then features can be cached)."""
        return all(e.cfg.frozen for e in self.encoders)

    def cache_key(self) -> str:
        """Identity of what this encoder computes, for the feature cache: names, image sizes, grid
        and a digest of the actual weights (a random init differs from seed to seed, and a stage
        may load its encoder from the previous one)."""
        h = hashlib.blake2b(digest_size=8)
        for name, tensor in sorted(self.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        names = "+".join(f"{e.cfg.name}@{e.cfg.image_size}" + (f"/s{e.cfg.stage}" if e.cfg.stage is not None else "")
                         for e in self.encoders)
        return f"{names}|grid{self.grid}|{h.hexdigest()}"

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return torch.cat([e(images) for e in self.encoders], dim=-1)
