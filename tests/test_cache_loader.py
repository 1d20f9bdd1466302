"""Training cache, loader and normalization statistics, checked against lerobot and numpy."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")

from robopolicy.data import cache as cache_mod  # noqa: E402
from robopolicy.data.cache import DatasetError, TrainingCache, ensure_cache, read_dataset  # noqa: E402
from robopolicy.data.loader import FeatureMap, LoaderConfig, TrainingDataset  # noqa: E402
from robopolicy.data.stats import ImageStats, StreamingStats  # noqa: E402

FPS = 10
STRIDES = (0, 1, 4, 16)
HORIZON = 6
EP_LENGTHS = (30, 12, 25)
IMG = 32


def _image(ep: int, i: int) -> np.ndarray:
    """Big flat blocks, so the codec keeps them nearly exact and frames stay distinguishable."""
    img = np.zeros((IMG, IMG, 3), np.uint8)
    img[:, :, 0] = (i * 8) % 256
    img[:, :, 1] = 40 + 60 * ep
    img[: IMG // 2, : IMG // 2, 2] = 200
    return img


def make_dataset(root: Path, cameras=("observation.images.front",), state_key="observation.state",
                 use_videos=True, lengths=EP_LENGTHS, vcodec="h264") -> Path:
    """A small LeRobot v3 dataset written with lerobot's own API; values encode (episode, frame)."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    features = {cam: {"dtype": "video" if use_videos else "image", "shape": (IMG, IMG, 3),
                      "names": ["height", "width", "channels"]} for cam in cameras}
    features.update({
        state_key: {"dtype": "float32", "shape": (3,), "names": None},
        "action": {"dtype": "float32", "shape": (2,), "names": None},
        "oracle.waypoints": {"dtype": "float32", "shape": (8, 3), "names": None},
        "label.target_box": {"dtype": "float32", "shape": (4,), "names": None},
        "label.target_visible": {"dtype": "bool", "shape": (1,), "names": None},
        "next.reward": {"dtype": "float32", "shape": (1,), "names": None},
    })
    ds = LeRobotDataset.create(repo_id="local/test", fps=FPS, features=features, root=root,
                               use_videos=use_videos, vcodec=vcodec)
    rng = np.random.default_rng(0)
    for ep, length in enumerate(lengths):
        for i in range(length):
            frame = {cam: _image(ep, i) for cam in cameras}
            frame.update({
                state_key: np.array([ep, i, rng.normal()], np.float32),
                "action": np.array([ep * 100 + i, rng.normal() * 5], np.float32),
                "oracle.waypoints": np.full((8, 3), ep * 100 + i, np.float32) + np.arange(8, dtype=np.float32)[:, None],
                "label.target_box": np.array([i, i, i + 1, i + 1], np.float32),
                "label.target_visible": np.array([i % 3 == 0]),
                "next.reward": np.array([rng.uniform()], np.float32),
                "task": f"follow person {ep % 2}",
            })
            ds.add_frame(frame)
        ds.save_episode()
    ds.finalize()
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("ds") / "synthetic")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def training(dataset, cache_dir) -> TrainingDataset:
    return TrainingDataset(dataset, context_strides=STRIDES, horizon=HORIZON, cache_dir=cache_dir,
                           labels=["label.target_box", "label.target_visible", "next.reward"], progress=False)


# ----------------------------------------------------------------------------- equivalence


def test_samples_equal_lerobot_with_delta_timestamps(dataset, training):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ref = LeRobotDataset("local/test", root=dataset, video_backend="pyav", delta_timestamps={
        "observation.images.front": [-s / FPS for s in STRIDES],
        "observation.state": [-s / FPS for s in STRIDES],
        "action": [k / FPS for k in range(HORIZON)],
    })
    assert len(training) == len(ref) == sum(EP_LENGTHS)
    # episode starts and ends, frames whose context crosses the start, and the middle
    for idx in (0, 1, 5, 16, 17, 24, 29, 30, 31, 41, 42, 50, 66):
        ours, theirs = training[idx], ref[idx]
        frames = (theirs["observation.images.front"] * 255).round().to(torch.uint8)
        assert ours["observation.images.front"].dtype == torch.uint8
        assert torch.equal(ours["observation.images.front"], frames), idx
        assert torch.equal(ours["observation.state"], theirs["observation.state"]), idx
        assert torch.equal(ours["observation_is_pad"], theirs["observation.state_is_pad"]), idx
        assert torch.equal(ours["action"], theirs["action"]), idx
        assert torch.equal(ours["action_is_pad"], theirs["action_is_pad"]), idx
        assert ours["task"] == theirs["task"]
        assert int(ours["episode_index"]) == int(theirs["episode_index"])
        assert int(ours["frame_index"]) == int(theirs["frame_index"])


def test_context_clamps_at_start_and_chunk_pads_at_end(training):
    s = training[2]  # episode 0, frame 2: t-4 and t-16 fall before the start
    assert s["observation_is_pad"].tolist() == [False, False, True, True]
    assert s["observation.state"][:, 1].tolist() == [2, 1, 0, 0]
    e = training[29 + 30 - 30]  # last frame of episode 0 (length 30)
    assert int(e["frame_index"]) == 29
    assert e["action_is_pad"].tolist() == [False] + [True] * (HORIZON - 1)
    assert torch.all(e["action"][:, 0] == 29)  # padded steps repeat the last action
    m = training[30 + 5]  # episode 1, frame 5: nothing padded in the chunk (length 12)
    assert not m["action_is_pad"].any()
    assert m["action"][:, 0].tolist() == [105 + k for k in range(HORIZON)]
    assert m["task"] == "follow person 1"


def test_shapes_labels_and_waypoint_targets(dataset, cache_dir, training):
    s = training[10]
    assert s["observation.images.front"].shape == (len(STRIDES), 3, IMG, IMG)
    assert s["observation.state"].shape == (len(STRIDES), 3) and s["observation.state"].dtype == torch.float32
    assert s["action"].shape == (HORIZON, 2) and s["action_is_pad"].shape == (HORIZON,)
    assert s["label.target_box"].tolist() == [10, 10, 11, 11]
    assert s["label.target_visible"].dtype == torch.bool and s["label.target_visible"].shape == ()
    assert s["next.reward"].shape == ()
    wp = TrainingDataset(dataset, cameras=[], state_key=None, action_key="oracle.waypoints", horizon=3,
                         context_strides=(0,), cache_dir=cache_dir, progress=False)
    w = wp[30 + 11]  # last frame of episode 1
    assert w["action"].shape == (3, 8, 3)
    assert torch.equal(w["action"][0, :, 1], torch.arange(8, dtype=torch.float32) + 111)
    assert w["action_is_pad"].tolist() == [False, True, True]
    assert "observation.state" not in w and not any(k.startswith("observation.images") for k in w)


def test_episode_subset_and_negative_index(dataset, cache_dir):
    ds = TrainingDataset(dataset, episodes=[2], horizon=2, cache_dir=cache_dir, progress=False)
    assert len(ds) == EP_LENGTHS[2]
    assert int(ds[0]["episode_index"]) == 2 and int(ds[0]["frame_index"]) == 0
    assert int(ds[-1]["frame_index"]) == EP_LENGTHS[2] - 1
    with pytest.raises(IndexError, match="out of range"):
        ds[len(ds)]
    with pytest.raises(DatasetError, match=r"episodes \[7\]"):
        TrainingDataset(dataset, episodes=[7], cache_dir=cache_dir, progress=False)


def test_dataloader_workers_match_single_process(training):
    loader = torch.utils.data.DataLoader(training, batch_size=8, shuffle=False, num_workers=2)
    batches = list(loader)
    assert sum(len(b["task"]) for b in batches) == len(training)
    b = batches[3]
    assert b["observation.images.front"].shape == (8, len(STRIDES), 3, IMG, IMG)
    for j in range(8):
        single = training[24 + j]
        assert torch.equal(b["observation.images.front"][j], single["observation.images.front"])
        assert torch.equal(b["action"][j], single["action"])
        assert b["task"][j] == single["task"]


def test_feature_map_from_config_on_other_key_names(tmp_path):
    """Any LeRobot v3 dataset: a camera stored as PNG images under another name, another state key."""
    from robopolicy.config import load_config

    root = make_dataset(tmp_path / "other", cameras=("observation.images.top",), state_key="observation.joints",
                        use_videos=False, lengths=(9, 7))
    cfg = load_config(LoaderConfig, None, [f"dataset={root}", "features.cameras={front: observation.images.top}",
                                          "features.state=observation.joints", "horizon=3",
                                          "context_strides=[0, 2]", f"cache_dir={tmp_path / 'cache'}"])
    ds = TrainingDataset.from_config(cfg, progress=False)
    s = ds[9 + 3]
    assert s["observation.images.front"].shape == (2, 3, IMG, IMG)
    assert torch.equal(s["observation.images.front"][0], torch.from_numpy(_image(1, 3).transpose(2, 0, 1)))
    assert torch.equal(s["observation.images.front"][1], torch.from_numpy(_image(1, 1).transpose(2, 0, 1)))
    assert s["observation.state"][:, 1].tolist() == [3, 1]
    assert set(ds.stats) >= {"observation.images.front", "observation.state", "action"}


# ----------------------------------------------------------------------------- cache identity and safety


def test_cache_is_reused_and_a_changed_dataset_gets_a_new_one(dataset, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "copy"
    shutil.copytree(dataset, root)
    builds = []
    real_build = cache_mod.build_cache
    monkeypatch.setattr(cache_mod, "build_cache", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    first = ensure_cache(root, tmp_path / "cache", progress=False)
    assert ensure_cache(root, tmp_path / "cache", progress=False) == first
    assert len(builds) == 1

    # Change one action value in the data parquet (same size, same name): the key must change.
    path = next((root / "data").glob("*/*.parquet"))
    table = pq.read_table(path)
    actions = table.column("action").to_pylist()
    actions[3] = [-7.0, -7.0]
    col = pa.array(actions, type=table.schema.field("action").type)
    pq.write_table(table.set_column(table.schema.get_field_index("action"), "action", col), path)
    second = ensure_cache(root, tmp_path / "cache", progress=False)
    assert second != first and len(builds) == 2
    assert TrainingCache(second).lowdim["action"][3].tolist() == [-7.0, -7.0]
    assert TrainingCache(first).lowdim["action"][3].tolist() != [-7.0, -7.0]

    # Touching a video (new mtime) also invalidates.
    video = next((root / "videos").rglob("*.mp4"))
    os.utime(video, ns=(video.stat().st_atime_ns, video.stat().st_mtime_ns + 10**9))
    assert ensure_cache(root, tmp_path / "cache", progress=False) not in (first, second)


def test_crash_during_build_leaves_nothing_and_next_build_works(dataset, tmp_path, monkeypatch):
    calls = []
    real_decode = cache_mod._decode_video

    def crash(*args, **kwargs):
        calls.append(1)
        raise KeyboardInterrupt("simulated crash in the middle of decoding")

    monkeypatch.setattr(cache_mod, "_decode_video", crash)
    with pytest.raises(KeyboardInterrupt):
        ensure_cache(dataset, tmp_path / "cache", progress=False)
    assert calls and [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.setattr(cache_mod, "_decode_video", real_decode)
    entry = ensure_cache(dataset, tmp_path / "cache", progress=False)
    assert TrainingCache(entry).num_frames == sum(EP_LENGTHS)


def test_direct_frame_reads_equal_zarr_reads(training, tmp_path):
    import zarr

    cache = training.cache
    array = zarr.open_group(cache.entry / "cache.zarr", mode="r")["images"]["observation.images.front"]
    rows = [0, 5, 29, 30, 66, 3, 3]
    cache.read_frames("observation.images.front", [0])
    assert cache._frames["observation.images.front"].direct  # the fast path is the one in use
    assert np.array_equal(cache.read_frames("observation.images.front", rows), array.oindex[np.array(rows)])
    # Small shards (the last one partial): zarr itself reads our hand-written shards, crc checked.
    entry = ensure_cache(training.root, tmp_path / "small", shard_frames=16, progress=False)
    small = zarr.open_group(entry / "cache.zarr", mode="r")["images"]["observation.images.front"]
    assert small.shards[0] == 16 and small.shape[0] % 16 != 0
    every = list(range(small.shape[0]))
    assert np.array_equal(small[:], cache.read_frames("observation.images.front", every))
    assert np.array_equal(TrainingCache(entry).read_frames("observation.images.front", every), small[:])


def test_shard_writer_handles_rows_out_of_order(tmp_path):
    import zarr
    from zarr.codecs import BloscCodec

    array = zarr.open_group(tmp_path / "z.zarr", mode="w").create_array(
        "f", shape=(23, 3, 2, 2), dtype="uint8", shards=(8, 3, 2, 2), chunks=(1, 3, 2, 2),
        compressors=BloscCodec(cname="lz4"), fill_value=0)
    writer = cache_mod._ShardWriter(array, 8)
    rows = np.random.default_rng(0).permutation(23)
    for row in rows:
        writer.put(int(row), np.full((3, 2, 2), row + 1, np.uint8))
    writer.flush()
    assert np.array_equal(array[:][:, 0, 0, 0], np.arange(1, 24))


# ----------------------------------------------------------------------------- statistics


def test_stats_match_numpy_on_the_full_data(training):
    stats = training.cache.stats
    low = training.cache.lowdim
    for key in ("observation.state", "action", "oracle.waypoints", "label.target_box", "next.reward"):
        x = low[key].astype(np.float64).reshape(len(low[key]), -1)
        got = {k: np.asarray(v, np.float64).reshape(-1) for k, v in stats[key].items()}
        np.testing.assert_allclose(got["mean"], x.mean(0), rtol=1e-6, atol=1e-6, err_msg=key)
        np.testing.assert_allclose(got["std"], x.std(0), rtol=1e-5, atol=1e-6, err_msg=key)
        np.testing.assert_array_equal(got["min"], x.min(0).astype(np.float32))
        np.testing.assert_array_equal(got["max"], x.max(0).astype(np.float32))
        tol = 4 * (x.max(0) - x.min(0)) / 2048 + 1e-6
        for q in (0.01, 0.99):
            err = np.abs(got[f"q{round(q * 100):02d}"] - np.quantile(x, q, axis=0))
            assert np.all(err <= tol), (key, q, err, tol)
        assert int(got["count"][0]) == len(x)
    frames = training.cache.read_frames("observation.images.front", range(training.cache.num_frames))
    per_channel = frames.transpose(1, 0, 2, 3).reshape(3, -1) / 255.0
    img = {k: np.asarray(v, np.float64).reshape(-1) for k, v in stats["observation.images.front"].items()}
    np.testing.assert_allclose(img["mean"], per_channel.mean(1), atol=1e-6)
    np.testing.assert_allclose(img["std"], per_channel.std(1), atol=1e-6)
    for name, q in (("q01", 0.01), ("q99", 0.99)):
        np.testing.assert_allclose(img[name], np.quantile(per_channel, q, axis=1), atol=1e-6)
    assert np.asarray(stats["observation.images.front"]["mean"]).shape == (3, 1, 1)
    assert "observation.state" in training.stats and "observation.images.front" in training.stats


def test_streaming_stats_with_growing_range_match_numpy():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(0, 1, (4000, 2, 2)), rng.normal(30, 5, (3000, 2, 2)),
                        rng.uniform(-80, -70, (300, 2, 2)), np.full((10, 2, 2), 5.0)])
    s = StreamingStats((2, 2), bins=1024)
    for part in np.array_split(x, 23):
        s.update(part)
    r = s.result()
    np.testing.assert_allclose(r["mean"], x.mean(0), rtol=1e-10)
    np.testing.assert_allclose(r["std"], x.std(0), rtol=1e-10)
    span = x.max(0) - x.min(0)
    for q, name in ((0.01, "q01"), (0.99, "q99")):
        err = np.abs(r[name] - np.quantile(x, q, axis=0))
        assert np.all(err <= s.bin_width) and np.all(s.bin_width <= 4 * span / 1024), (err, s.bin_width)
    with pytest.raises(ValueError, match="NaN"):
        s.update(np.full((1, 2, 2), np.nan))
    im = ImageStats(3)
    frames = rng.integers(0, 256, (20, 3, 5, 5)).astype(np.uint8)
    im.update(frames[:7])
    im.update(frames[7:])
    flat = frames.transpose(1, 0, 2, 3).reshape(3, -1) / 255.0
    np.testing.assert_allclose(im.result()["q99"].ravel(), np.quantile(flat, 0.99, axis=1), atol=1e-12)


# ----------------------------------------------------------------------------- bad input


def _copy(dataset: Path, tmp_path: Path) -> Path:
    root = tmp_path / "broken"
    shutil.copytree(dataset, root)
    return root


def test_missing_info_json_names_the_file(dataset, tmp_path):
    root = _copy(dataset, tmp_path)
    (root / "meta" / "info.json").unlink()
    with pytest.raises(DatasetError, match=r"meta/info\.json: file is missing"):
        TrainingDataset(root, cache_dir=tmp_path / "c", progress=False)


def test_corrupt_parquet_names_the_file(dataset, tmp_path):
    root = _copy(dataset, tmp_path)
    path = next((root / "data").glob("*/*.parquet"))
    path.write_bytes(b"this is not parquet" * 10)
    with pytest.raises(DatasetError, match=rf"{path.name}: not a readable parquet file"):
        ensure_cache(root, tmp_path / "c", progress=False)
    assert not any((tmp_path / "c").glob("broken-*"))


def test_missing_and_truncated_video_name_the_file(dataset, tmp_path):
    root = _copy(dataset, tmp_path)
    video = next((root / "videos").rglob("*.mp4"))
    data = video.read_bytes()
    video.unlink()
    with pytest.raises(DatasetError, match=rf"{video.name}: video file is missing"):
        read_dataset(root)
    video.write_bytes(data[: len(data) // 3])
    with pytest.raises(DatasetError, match=rf"{video.name}"):
        ensure_cache(root, tmp_path / "c", progress=False)


def test_unknown_feature_and_v21_dataset(dataset, tmp_path, cache_dir):
    with pytest.raises(DatasetError, match="label feature 'label.nope' not in dataset"):
        TrainingDataset(dataset, labels=["label.nope"], cache_dir=cache_dir, progress=False)
    with pytest.raises(DatasetError, match="camera 'wrist'"):
        TrainingDataset(dataset, cameras=["wrist"], cache_dir=cache_dir, progress=False)
    with pytest.raises(DatasetError, match="is a camera"):
        TrainingDataset(dataset, action_key="observation.images.front", cache_dir=cache_dir, progress=False)
    root = _copy(dataset, tmp_path)
    info = (root / "meta" / "info.json").read_text().replace('"v3.0"', '"v2.1"')
    (root / "meta" / "info.json").write_text(info)
    with pytest.raises(DatasetError, match="convert_dataset_v21_to_v30"):
        read_dataset(root)


def test_uncommitted_rows_past_info_totals_are_ignored(dataset, tmp_path):
    """robopolicy's recorder commits by replacing info.json last; rows beyond it are not ours yet."""
    import json

    root = _copy(dataset, tmp_path)
    info = json.loads((root / "meta" / "info.json").read_text())
    info["total_episodes"] = 2
    info["total_frames"] = EP_LENGTHS[0] + EP_LENGTHS[1]
    (root / "meta" / "info.json").write_text(json.dumps(info))
    ds = TrainingDataset(root, cache_dir=tmp_path / "c", horizon=2, progress=False)
    assert len(ds) == EP_LENGTHS[0] + EP_LENGTHS[1]
    assert ds.episodes == [0, 1]


# ----------------------------------------------------------------------------- real task, real recorder


def test_oracle_dataset_from_collect_loads_with_waypoints_and_labels(tmp_path):
    """A PersonFollow dataset written by ``robopolicy collect`` trains through our loader, frames
    identical to lerobot's own decode."""
    collect_mod = pytest.importorskip("robopolicy.data.collect")
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from robopolicy.envs import EnvConfig

    root = tmp_path / "pf"
    collect_mod.collect(collect_mod.CollectConfig(
        env=EnvConfig(id="robopolicy/PersonFollow-v0", kwargs={"split": "dt"}), episodes=2, workers=1,
        out=str(root), image_size=64, vcodec="h264", progress=False), log=lambda s: None)
    ds = TrainingDataset(root, action_key="oracle.waypoints", horizon=1, context_strides=(0, 2),
                         labels=["label.target_box", "label.target_visible"], cache_dir=tmp_path / "c",
                         progress=False)
    ref = LeRobotDataset("local/pf", root=root, video_backend="pyav", delta_timestamps={
        "observation.images.front": [0.0, -2 / ds.fps]})
    for idx in (0, 1, len(ds) // 2, len(ds) - 1):
        ours, theirs = ds[idx], ref[idx]
        assert ours["action"].shape == (1, 8, 3)
        assert torch.equal(ours["action"][0], theirs["oracle.waypoints"])
        assert torch.equal(ours["label.target_box"], theirs["label.target_box"])
        assert bool(ours["label.target_visible"]) == bool(theirs["label.target_visible"])
        frames = (theirs["observation.images.front"] * 255).round().to(torch.uint8)
        assert torch.equal(ours["observation.images.front"], frames)
        assert ours["task"] == theirs["task"]
    assert ds.stats["action"]["mean"].shape == (8, 3)


def test_relative_action_stats_and_missing_labels_name_the_setting(dataset, cache_dir, training):
    rel = training.relative_action_stats([0, 1])
    assert rel["mean"].shape == (2,)
    with pytest.raises(DatasetError, match=r"model.relative_action \[0, 2\]: dims must be below 2"):
        training.relative_action_stats([0, 2])  # a 2-d action: no raw IndexError
    with pytest.raises(DatasetError, match="loss.locate asks for the feature 'label.goal_pos'.*set loss.locate: 0"):
        TrainingDataset(dataset, labels={"label.goal_pos": "loss.locate"}, cache_dir=cache_dir, progress=False)
