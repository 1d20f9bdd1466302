"""The complementary encoder pair: config, per-member feature cache, frozen members, bad configs."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("timm")

from robopolicy.config import ConfigError, load_config  # noqa: E402
from robopolicy.models import feature_cache as fc  # noqa: E402
from robopolicy.models.encoders import EncoderConfig, FusedVisionEncoder, MemberLayerNorm  # noqa: E402
from robopolicy.models.policy import Policy  # noqa: E402
from robopolicy.train.trainer import TrainConfig, build_dataset, model_config_for, train  # noqa: E402
from test_train import IMG, make_dataset  # noqa: E402

LITE0 = "{name: efficientnet_lite0, weights: imagenet, frozen: true, image_size: 32, stage: 3}"
LITE2 = "{name: efficientnet_lite2, weights: imagenet, frozen: true, image_size: 32, stage: 4}"
SMALL_CNN = "{name: resnet18, weights: null, frozen: false, image_size: 32, stage: 1}"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("pair") / "squares", episodes=2, length=12)


def config(dataset: Path, root: Path, encoders: str, *overrides) -> TrainConfig:
    base = [f"data.dataset={dataset}", f"data.cache_dir={root / 'training'}", f"data.feature_cache_dir={root / 'features'}",
            f"out={root / 'run'}", "progress=false", "threads=1", "seed=0", f"model.encoders={encoders}",
            "model.grid=2", "model.context_strides=[0, 2]", "model.d_model=32", "model.n_heads=2", "model.n_layers=1",
            "model.head_layers=1", "model.language.enabled=false", "model.head=waypoints",
            "data.features.action=oracle.waypoints", "batch_size=8", "log_every=1", "save_every=0"]
    return load_config(TrainConfig, None, base + list(overrides))


def test_pair_config_builds_a_fused_encoder_with_a_norm_per_member(dataset, tmp_path):
    cfg = config(dataset, tmp_path, f"[{LITE0}, {LITE2}]")
    ds = build_dataset(cfg, progress=False)
    pol = Policy(model_config_for(cfg.model, ds), ds.stats)
    lite0, lite2 = pol.vision.encoders
    assert (lite0.cfg.name, lite2.cfg.name) == ("efficientnet_lite0", "efficientnet_lite2")
    assert pol.vision.out_dim == lite0.out_dim + lite2.out_dim == 112 + 352
    assert pol.vision.n_tokens == 4 and pol.vision.frozen
    norm = pol.vision_proj[0]
    assert isinstance(norm, MemberLayerNorm) and norm.dims == [112, 352]
    # each member is normalized on its own: scaling one member's channels leaves the output unchanged
    x = torch.randn(3, 4, 464)
    y = x.clone()
    y[..., 112:] *= 50.0
    with torch.no_grad():
        torch.testing.assert_close(norm(x), norm(y), rtol=1e-4, atol=1e-4)
    frames = torch.randint(0, 255, (2, 3, IMG, IMG), dtype=torch.uint8)
    with torch.no_grad():
        fused = pol.encode_frames(frames)
        torch.testing.assert_close(fused, torch.cat([lite0(frames), lite2(frames)], dim=-1))


def test_each_frozen_member_has_its_own_cache_file_shared_between_recipes(dataset, tmp_path, monkeypatch):
    cfg = config(dataset, tmp_path, f"[{LITE0}, {LITE2}]")
    ds = build_dataset(cfg, progress=False)
    pair = FusedVisionEncoder([EncoderConfig(**_parse(LITE0)), EncoderConfig(**_parse(LITE2))], grid=2)
    keys = [e.cache_key() for e in pair.encoders]
    assert keys[0] != keys[1] and keys[0].startswith("efficientnet_lite0@32/s3|grid2|")
    feats = fc.ensure_features(ds, pair, tmp_path / "features", progress=False)["front"]
    files = sorted((tmp_path / "features").glob("*.npy"))
    assert len(files) == 2 and feats.shape == (ds.cache.num_frames, 4, 464)
    rows = [0, ds.cache.num_frames - 1]
    frames = torch.from_numpy(ds.cache.read_frames(ds.cameras["front"], rows))
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(feats[rows]).float(), pair(frames), rtol=3e-3, atol=3e-3)
    # Lite0 alone has the same member key: its file is read, not encoded again
    encoded = []
    real = fc._encode_all
    monkeypatch.setattr(fc, "_encode_all", lambda ds_, cam, enc, *a, **k: encoded.append(enc.describe()) or real(ds_, cam, enc, *a, **k))
    single = FusedVisionEncoder([EncoderConfig(**_parse(LITE0))], grid=2)
    alone = fc.ensure_features(ds, single, tmp_path / "features", progress=False)["front"]
    assert encoded == [] and np.array_equal(alone, feats[..., :112])
    # another grid is another identity: encoded anew, the pair's files untouched
    fc.ensure_features(ds, FusedVisionEncoder([EncoderConfig(**_parse(LITE0))], grid=1), tmp_path / "features",
                       progress=False)
    assert encoded == ["efficientnet_lite0@32/s3"] and len(list((tmp_path / "features").glob("*.npy"))) == 3


def test_pair_trains_on_cached_features_and_frozen_members_get_no_gradient(dataset, tmp_path):
    result = train(config(dataset, tmp_path, f"[{LITE0}, {LITE2}]", "steps=3"), log=lambda s: None)
    assert result.used_feature_cache and len(list((tmp_path / "features").glob("*.npy"))) == 2
    loaded = Policy.load(result.final)
    fresh = FusedVisionEncoder([EncoderConfig(**_parse(LITE0)), EncoderConfig(**_parse(LITE2))], grid=2)
    torch.testing.assert_close(loaded.vision.state_dict(), fresh.state_dict())  # the packaged weights, untouched

    # a frozen pretrained member beside a small trainable CNN: gradients reach only the trainable one
    cfg = config(dataset, tmp_path, f"[{LITE0}, {SMALL_CNN}]")
    ds = build_dataset(cfg, progress=False)
    pol = Policy(model_config_for(cfg.model, ds), ds.stats)
    assert not pol.vision.frozen and [e.cfg.frozen for e in pol.vision.encoders] == [True, False]
    pol.train()
    batch = {k: (v[None] if torch.is_tensor(v) else [v]) for k, v in ds[3].items()}
    pol.losses(batch, {"action": 1.0})["total"].backward()
    frozen, trainable = pol.vision.encoders
    assert all(p.grad is None and not p.requires_grad for p in frozen.parameters())
    assert not any(m.training for m in frozen.net.modules()) and trainable.net.training  # frozen BN stays put
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable.parameters())
    assert pol.vision_proj[1].weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"resnet18@32/s1 trainable"):
        fc.ensure_features(ds, pol.vision, tmp_path / "features", progress=False)


def test_a_pair_with_a_random_frozen_member_is_a_config_error(dataset, tmp_path):
    random_frozen = "{name: efficientnet_lite2, weights: null, frozen: true, image_size: 32}"
    with pytest.raises(ConfigError, match=r"model.encoders\[1\] \(efficientnet_lite2\) is frozen with weights: null"
                                          r".*never learns.*weights: imagenet"):
        config(dataset, tmp_path, f"[{LITE0}, {random_frozen}]")
    with pytest.raises(ConfigError, match=r"model.encoders\[0\] \(resnet18\) is frozen"):
        config(dataset, tmp_path, f"[{{name: resnet18, frozen: true, stage: 1}}, {LITE2}]")
    config(dataset, tmp_path, f"[{LITE0}, {random_frozen}]", "init_from=outputs/train/previous/final")


def _parse(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)
