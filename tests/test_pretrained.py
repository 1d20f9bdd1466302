"""Packaged ImageNet encoder weights (no hub), the EfficientNet-PyTorch → timm key map, the
frozen-needs-weights rule, and every shipped training recipe building its model."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
timm = pytest.importorskip("timm")

from robopolicy.config import ConfigError, load_config  # noqa: E402
from robopolicy.models import pretrained as P  # noqa: E402
from robopolicy.models.encoders import EncoderConfig, EncoderError, VisionEncoder  # noqa: E402
from robopolicy.models.policy import Policy, PolicyConfig  # noqa: E402
from robopolicy.train.trainer import TrainConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LITE0 = EncoderConfig(name="efficientnet_lite0", weights="imagenet", image_size=32)


@pytest.fixture(scope="module")
def lite0_state():
    return torch.load(P.packaged_weights_path("efficientnet_lite0"), map_location="cpu", weights_only=True)


def test_every_packaged_file_resolves_and_every_tensor_maps(lite0_state):
    """lite0: 247 tensors (49 BatchNorms' counters aside) map by name and shape; lite1/2 likewise."""
    for name in P.PACKAGED:
        path = P.packaged_weights_path(name)
        assert path.is_file() and path.suffix == ".pth"
        src = P.resolve_weights(name, "imagenet")
        assert src.efficientnet_pytorch
        net = timm.create_model(name, pretrained=False, **P.TF_TIMM_KWARGS)
        converted = P.convert_efficientnet_pytorch(src.state, net, str(path))
        expected = {k for k in net.state_dict() if not k.endswith("num_batches_tracked")}
        assert set(converted) == expected
        if name == "efficientnet_lite0":
            assert len(converted) == 247
    key_map = P.efficientnet_pytorch_key_map(timm.create_model("efficientnet_lite0", pretrained=False))
    assert key_map["blocks.0.0.conv_dw.weight"] == "_blocks.0._depthwise_conv.weight"
    assert key_map["blocks.2.1.bn1.running_var"] == "_blocks.4._bn0.running_var"  # stage 2's second block
    assert key_map["bn2.weight"] == "_bn1.weight" and key_map["classifier.bias"] == "_fc.bias"


def test_imagenet_encoder_carries_the_packaged_tensors_and_their_conventions(lite0_state):
    enc = VisionEncoder(LITE0, grid=2)
    net = enc.net
    assert torch.equal(net.conv_stem.weight, lite0_state["_conv_stem.weight"])
    assert torch.equal(net.blocks[5][3].bn2.running_var, lite0_state["_blocks.14._bn1.running_var"])
    # real training statistics, not a fresh BatchNorm's zeros and ones
    assert net.bn1.running_mean.abs().mean() > 0.05 and (net.bn1.running_var - 1).abs().mean() > 0.05
    # TensorFlow-trained: TF padding, eps 1e-3, inputs in [-1, 1]
    assert type(net.conv_stem).__name__ == "Conv2dSame" and net.bn1.eps == pytest.approx(1e-3)
    assert enc.mean.flatten().tolist() == [0.5, 0.5, 0.5] and enc.std.flatten().tolist() == [0.5, 0.5, 0.5]
    feats = enc(torch.randint(0, 256, (2, 3, 40, 40), dtype=torch.uint8))
    assert feats.shape == (2, 4, 1280) and torch.isfinite(feats).all()
    # the family's conventions do not hang on the weights entry: a later stage that freezes this
    # encoder with weights: null and loads it from init_from computes what it was trained to
    rand = VisionEncoder(dataclasses.replace(LITE0, weights=None), grid=2)
    assert rand.mean.flatten().tolist() == [0.5, 0.5, 0.5] and rand.net.bn1.eps == pytest.approx(1e-3)
    assert not torch.equal(rand.net.conv_stem.weight, net.conv_stem.weight)
    rand.load_state_dict(enc.state_dict())
    x = torch.randint(0, 256, (2, 3, 40, 40), dtype=torch.uint8)
    assert torch.equal(rand(x), enc(x))
    resnet = VisionEncoder(EncoderConfig(name="resnet18", image_size=32), grid=2)
    assert resnet.mean.flatten().tolist() == pytest.approx([0.485, 0.456, 0.406])


def test_feature_stage_and_local_file_in_either_format(tmp_path, lite0_state):
    staged = VisionEncoder(dataclasses.replace(LITE0, stage=3), grid=2)
    assert staged.out_dim == 112
    assert torch.equal(staged.net.blocks[0][0].conv_dw.weight, lite0_state["_blocks.0._depthwise_conv.weight"])
    x = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    # the packaged file under a user's path, and the same weights saved with timm names
    own = tmp_path / "lite0_efficientnet_pytorch.pth"
    torch.save(lite0_state, own)
    timm_names = tmp_path / "lite0_timm.pth"
    torch.save(VisionEncoder(LITE0, grid=2).net.state_dict(), timm_names)
    reference = VisionEncoder(LITE0, grid=2)(x)
    assert torch.equal(VisionEncoder(dataclasses.replace(LITE0, weights=str(own)), grid=2)(x), reference)
    assert torch.equal(VisionEncoder(dataclasses.replace(LITE0, weights=str(timm_names)), grid=2)(x), reference)


def test_key_and_shape_mismatches_name_the_tensor(tmp_path, lite0_state):
    net = timm.create_model("efficientnet_lite0", pretrained=False, **P.TF_TIMM_KWARGS)
    bad = dict(lite0_state)
    bad["_blocks.3._expand_conv.weight"] = bad["_blocks.3._expand_conv.weight"][:10]
    with pytest.raises(EncoderError, match=r"_blocks\.3\._expand_conv\.weight.*blocks\.2\.0\.conv_pw\.weight"):
        P.convert_efficientnet_pytorch(bad, net)
    missing = {k: v for k, v in lite0_state.items() if k != "_blocks.7._bn1.running_mean"}
    with pytest.raises(EncoderError, match=r"_blocks\.7\._bn1\.running_mean"):
        P.convert_efficientnet_pytorch(missing, net)
    # Lite2's deeper, wider network does not load into Lite0
    path = tmp_path / "lite2.pth"
    torch.save(torch.load(P.packaged_weights_path("efficientnet_lite2"), map_location="cpu", weights_only=True), path)
    with pytest.raises(EncoderError, match="shape|no place"):
        VisionEncoder(dataclasses.replace(LITE0, weights=str(path)), grid=2)
    # EfficientNet-PyTorch keys only fit an EfficientNet-Lite
    with pytest.raises(EncoderError, match="efficientnet_lite0..4"):
        VisionEncoder(EncoderConfig(name="test_resnet", weights=str(path)), grid=2)


def test_imagenet_needs_a_packaged_backbone():
    with pytest.raises(EncoderError, match="no packaged ImageNet weights for resnet18; use efficientnet_lite0..2"):
        VisionEncoder(EncoderConfig(name="resnet18", weights="imagenet"))


def test_frozen_encoder_needs_weights_from_somewhere(tmp_path):
    frozen_random = "model.encoders=[{name: efficientnet_lite0, frozen: true, weights: null}]"
    with pytest.raises(ConfigError, match=r"model.encoders\[0\].*frozen.*weights: null and no init_from.*weights: imagenet"):
        load_config(TrainConfig, None, [frozen_random])
    with pytest.raises(ConfigError, match=r"model.encoders\[1\] \(resnet18\)"):
        load_config(TrainConfig, None, ["model.encoders=[{weights: imagenet}, {name: resnet18}]"])
    # stage-loaded, pretrained, a local file, or trainable: all fine
    load_config(TrainConfig, None, [frozen_random, "init_from=outputs/train/previous/final"])
    load_config(TrainConfig, None, ["model.encoders=[{name: efficientnet_lite1, weights: imagenet}]"])
    load_config(TrainConfig, None, [f"model.encoders=[{{name: resnet18, weights: {tmp_path / 'own.pth'}}}]"])
    load_config(TrainConfig, None, ["model.encoders=[{name: resnet18, frozen: false}]"])
    # the library default is the packaged ImageNet EfficientNet-Lite0, frozen
    (enc,) = PolicyConfig().encoders
    assert (enc.name, enc.weights, enc.frozen) == ("efficientnet_lite0", "imagenet", True)


def _fake_stats(shape) -> dict:
    shape = tuple(shape)
    return {"mean": np.zeros(shape, np.float32), "std": np.ones(shape, np.float32),
            "min": np.full(shape, -1, np.float32), "max": np.ones(shape, np.float32),
            "q01": np.full(shape, -1, np.float32), "q99": np.ones(shape, np.float32)}


SHIPPED = sorted((ROOT / "configs" / "train").rglob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(ROOT / "configs" / "train")) for p in SHIPPED])
def test_every_shipped_recipe_builds_its_model(path):
    """Each recipe loads (frozen encoders have weights), builds its policy with the dataset-derived
    fields faked, and predicts on a tiny batch; no training."""
    cfg = load_config(TrainConfig, path)
    feats = cfg.data.features
    cameras = list(feats.cameras) if feats.cameras is not None else ["front"]
    action_shape = [8, 3] if cfg.model.head == "waypoints" else [6]
    state_dim = 6 if cfg.model.use_state else 0
    env_state_dim = 5 if feats.env_state else 0
    model_cfg = dataclasses.replace(cfg.model, cameras=cameras, action_shape=action_shape, state_dim=state_dim,
                                    env_state_dim=env_state_dim, frame_size=[24, 24] if cameras else [])
    stats = {"action": _fake_stats(action_shape)}
    if state_dim:
        stats["observation.state"] = _fake_stats((state_dim,))
    if env_state_dim:
        stats["observation.environment_state"] = _fake_stats((env_state_dim,))
    if "locate" in cfg.model.aux_heads:
        stats[cfg.model.locate_label] = _fake_stats((cfg.model.locate_dim,))
    policy = Policy(model_cfg, stats)
    for enc in (policy.vision.encoders if policy.vision is not None else []):
        assert not enc.cfg.frozen or enc.cfg.weights or cfg.init_from, f"{path}: frozen random encoder"
    rng = np.random.default_rng(0)
    obs = {f"observation.images.{c}": rng.integers(0, 256, (1, 24, 24, 3), dtype=np.uint8) for c in cameras}
    obs["task"] = ["pick up the red cube"]
    if state_dim:
        obs["observation.state"] = np.zeros((1, state_dim), np.float32)
    if env_state_dim:
        obs["observation.environment_state"] = np.zeros((1, env_state_dim), np.float32)
    out = policy.predict(obs)
    assert out.shape[0] == 1 and torch.isfinite(out).all()


def test_encoder_probe_command_writes_its_record(tmp_path, capsys):
    """``robopolicy diagnose encoder-probe`` renders, probes both inits and writes summary.json."""
    import json

    from robopolicy.cli import main

    out = tmp_path / "probe"
    rc = main(["diagnose", "encoder-probe", "--episodes", "12", "--out", str(out), "tasks=[person, cube]", "image_size=32",
               "encoder.image_size=32", "encoder.stage=3", "grid=2"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| cube | " in text and "| person | 2 | " in text
    record = json.loads((out / "summary.json").read_text())
    assert record["kind"] == "diagnose" and record["diagnosis"] == "encoder-probe"
    assert set(record["metrics"]) == {f"{t}_{k}" for t in ("person", "cube") for k in ("pretrained", "random", "majority")}
    assert all(0.0 <= v <= 1.0 for v in record["metrics"].values())
    with pytest.raises(ConfigError, match="not encoder.weights"):
        from robopolicy.diagnose.encoder_probe import EncoderProbeConfig

        load_config(EncoderProbeConfig, None, ["encoder.weights=imagenet"])


def test_packaged_weights_see_sim_frames_as_they_saw_their_training_images():
    """With the Lite family's own input scaling ([-1, 1]), the first BatchNorms' batch means on
    our frames lie near the running means ImageNet training left; ImageNet mean/std scaling (what
    a timm-trained network would want) puts them more than twice as far off."""
    from robopolicy.diagnose.encoder_probe import render_frames

    frames, _ = render_frames("shirt", 8, seed=0, image_size=64)
    images = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    enc = VisionEncoder(dataclasses.replace(LITE0, image_size=64), grid=2)
    first = [enc.net.bn1, enc.net.blocks[0][0].bn1, enc.net.blocks[0][0].bn2, enc.net.blocks[1][0].bn1]

    def offset(mean, std) -> float:
        enc.mean.copy_(torch.tensor(mean).view(1, 3, 1, 1))
        enc.std.copy_(torch.tensor(std).view(1, 3, 1, 1))
        z = []
        hooks = [bn.register_forward_hook(
            lambda m, inp, out: z.append(((inp[0].mean((0, 2, 3)) - m.running_mean).abs()
                                          / (m.running_var + m.eps).sqrt()).mean().item())) for bn in first]
        enc(images)
        for h in hooks:
            h.remove()
        return float(np.mean(z))

    own = offset(*P.TF_MEAN_STD)
    imagenet = offset((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    assert own < 0.3 and imagenet > 2 * own
