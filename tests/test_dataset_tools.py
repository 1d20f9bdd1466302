"""Interchange and inspection: lerobot-written datasets, zarr round trip, info/viz/filter/split, bad input."""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from robopolicy.data import features as F  # noqa: E402
from robopolicy.data import inspect as I  # noqa: E402
from robopolicy.data import interchange as X  # noqa: E402
from robopolicy.data import recorder as R  # noqa: E402

FPS = 10
SIZE = 32


def cli(*argv: str) -> int:
    from robopolicy.commands import dataset

    p = argparse.ArgumentParser(prog="robopolicy")
    sub = p.add_subparsers(dest="command")
    dataset.add_parser(sub)
    args = p.parse_args(list(argv))
    return args.func(args)


@pytest.fixture(scope="module")
def lerobot_ds(tmp_path_factory):
    """A dataset written with lerobot's own API: 3 episodes in one data file and one mp4."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    root = tmp_path_factory.mktemp("lr") / "ds"
    features = {
        "observation.images.top": {"dtype": "video", "shape": (SIZE, SIZE, 3), "names": ["height", "width", "channels"]},
        "observation.state": {"dtype": "float32", "shape": (2,), "names": None},
        "action": {"dtype": "float32", "shape": (2,), "names": None},
    }
    ds = LeRobotDataset.create("someone/pusht_like", fps=FPS, features=features, root=root)
    for ep in range(3):
        for i in range(8 + ep):
            ds.add_frame({"observation.images.top": np.full((SIZE, SIZE, 3), 20 * ep + 10 * i, np.uint8),
                          "observation.state": np.array([ep, i], np.float32),
                          "action": np.array([i, -ep], np.float32), "task": f"push {ep % 2}"})
        ds.save_episode()
    ds.finalize()
    return root


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """A dataset from our recorder with alternating oracle success."""
    import gymnasium as gym

    root = tmp_path_factory.mktemp("ours") / "ds"
    obs = gym.spaces.Dict({"observation.images.front": gym.spaces.Box(0, 255, (SIZE, SIZE, 3), np.uint8),
                           "observation.state": gym.spaces.Box(-1, 1, (2,), np.float32)})
    features = F.dataset_features(obs, gym.spaces.Box(-1, 1, (2,), np.float32), {F.TARGET_BOX: (4,)})
    rec = R.EpisodeRecorder(root, features, fps=FPS)
    for ep in range(4):
        rec.start_episode(seed=100 + ep)
        for i in range(6):
            rec.add_frame({"observation.images.front": np.full((SIZE, SIZE, 3), 30 * ep, np.uint8),
                           "observation.state": np.array([ep, i], np.float32),
                           "action": np.array([0.1 * i, ep], np.float32),
                           F.ORACLE_ACTION: np.zeros(2, np.float32),
                           F.TARGET_BOX: np.array([4, 4, 20, 28], np.float32),
                           F.SUCCESS: ep % 2 == 0 and i == 5},
                          task="follow red" if ep < 2 else "follow blue", wall_time=i / FPS)
        rec.save_episode()
    rec.close()
    return root


def test_lerobot_written_dataset_loads_in_ours_and_accepts_our_episodes(lerobot_ds, tmp_path):
    report = X.validate_dataset(lerobot_ds)
    assert (report.episodes, report.frames, report.fps) == (3, 27, FPS)
    ep = X.read_episode(lerobot_ds, 2)
    assert ep["observation.state"].shape == (10, 2) and ep["observation.images.top"].shape == (10, SIZE, SIZE, 3)
    assert np.allclose(ep["observation.state"][:, 1], np.arange(10))
    assert abs(int(ep["observation.images.top"][3].mean()) - 70) <= 3
    info = I.dataset_info(lerobot_ds)
    assert info["episodes"] == 3 and set(info["tasks"]) == {"push 0", "push 1"} and info["success_share"] is None

    copy = tmp_path / "copy"
    assert cli("dataset", "import", str(lerobot_ds), "--out", str(copy)) == 0
    rec = R.EpisodeRecorder(copy, resume=True)  # our recorder appends to a lerobot-written dataset
    rec.start_episode()
    for i in range(5):
        rec.add_frame({"observation.images.top": np.full((SIZE, SIZE, 3), 200, np.uint8),
                       "observation.state": np.array([9, i], np.float32), "action": np.zeros(2, np.float32)},
                      task="push 1")
    assert rec.save_episode().episode_index == 3
    ds = X.load_lerobot_dataset(copy)
    assert ds.meta.total_episodes == 4 and len(ds) == 32
    assert float(ds[31]["observation.state"][0]) == 9 and float(ds[26]["observation.state"][1]) == 9
    assert abs(float(ds[30]["observation.images.top"].mean()) - 200 / 255) < 0.02
    X.validate_dataset(copy)


def test_zarr_round_trip_through_cli(tmp_path):
    import zarr

    src = tmp_path / "replay.zarr"
    g = zarr.open_group(str(src), mode="w", zarr_format=2)
    rng = np.random.default_rng(0)
    img = np.repeat((np.arange(20) * 10).astype(np.uint8)[:, None, None, None], SIZE, 1).repeat(SIZE, 2).repeat(3, 3)
    state, action = rng.normal(size=(20, 2)).astype(np.float32), rng.normal(size=(20, 2)).astype(np.float32)
    g.create_array("data/img", data=img)
    g.create_array("data/state", data=state)
    g.create_array("data/action", data=action)
    g.create_array("meta/episode_ends", data=np.array([7, 20]))
    ds_dir, back = tmp_path / "ds", tmp_path / "back.zarr"
    assert cli("dataset", "import", str(src), "--out", str(ds_dir), "--fps", "10", "--task", "push the T") == 0
    lr = X.load_lerobot_dataset(ds_dir)
    assert lr.meta.total_episodes == 2 and len(lr) == 20 and lr[8]["task"] == "push the T"
    assert "observation.images.img" in lr.meta.video_keys
    assert cli("dataset", "export", str(ds_dir), "--out", str(back)) == 0
    h = zarr.open_group(str(back), mode="r")
    assert h["meta/episode_ends"][:].tolist() == [7, 20]
    assert np.array_equal(h["data/action"][:], action) and np.array_equal(h["data/state"][:], state)
    assert np.abs(h["data/img"][:].astype(int) - img).max() <= 4  # video is lossy


def test_bad_zarr_is_named(tmp_path):
    import zarr

    src = tmp_path / "bad.zarr"
    g = zarr.open_group(str(src), mode="w", zarr_format=2)
    g.create_array("data/action", data=np.zeros((5, 2), np.float32))
    g.create_array("meta/episode_ends", data=np.array([3, 9]))
    with pytest.raises(R.DatasetError, match="data/action: 5 rows but episode_ends reaches 9"):
        X.import_zarr(src, tmp_path / "out")


def test_info_viz_filter_split(ours, tmp_path, capsys):
    assert cli("dataset", "info", str(ours), "--json") == 0
    info = json.loads(capsys.readouterr().out)
    assert info["episodes"] == 4 and info["frames"] == 24 and info["fps"] == FPS
    assert info["success_share"] == 0.5 and info["tasks"] == {"follow red": 2, "follow blue": 2}
    assert info["features"]["label.target_box"]["shape"] == [4]

    out = tmp_path / "ep1.mp4"
    assert cli("dataset", "viz", str(ours), "--episode", "1", "--out", str(out)) == 0
    import av

    with av.open(str(out)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(frames) == 6 and frames[0].shape[1] > 3 * SIZE  # camera tile plus the curve panel

    ok = tmp_path / "ok"
    assert cli("dataset", "filter", str(ours), "--success", "--out", str(ok)) == 0
    lr = X.load_lerobot_dataset(ok)
    assert lr.meta.total_episodes == 2
    assert [float(lr[i]["observation.state"][0]) for i in (0, 6)] == [0.0, 2.0]
    assert R.read_episodes(ok)[F.EPISODE_SEED].to_pylist() == [100, 102]
    assert I.dataset_info(ok)["success_share"] == 1.0

    parts = I.split_dataset(ours, tmp_path / "by_task", by="task")
    assert sorted(parts) == ["task-000", "task-001"]
    assert {X.validate_dataset(p).episodes for p in parts.values()} == {2}
    assert cli("dataset", "filter", str(ours), "--task", "nothing like this", "--out", str(tmp_path / "none")) == 1
    assert not (tmp_path / "none").exists()


def test_episode_out_of_range_is_clear(ours, tmp_path, capsys):
    with pytest.raises(R.DatasetError, match=r"episode 7 out of range: .* has 4 episodes \(0..3\)"):
        X.read_episode(ours, 7)
    assert cli("dataset", "viz", str(ours), "--episode", "7", "--out", str(tmp_path / "x.mp4")) == 1
    assert "out of range" in capsys.readouterr().out
    with pytest.raises(R.DatasetError, match="out of range"):
        I.copy_episodes(ours, tmp_path / "y", [0, 9])
    assert not (tmp_path / "y").exists()


def _broken_copy(src, tmp_path, name="broken"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def test_bad_files_are_named_and_source_untouched(ours, tmp_path):
    # corrupt parquet
    d = _broken_copy(ours, tmp_path, "parquet")
    data = d / "data/chunk-000/file-001.parquet"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(R.DatasetError, match=r"data/chunk-000/file-001\.parquet: corrupt parquet"):
        X.validate_dataset(d)
    # missing mp4
    d = _broken_copy(ours, tmp_path, "nomp4")
    (d / "videos/observation.images.front/chunk-000/file-002.mp4").unlink()
    with pytest.raises(R.DatasetError, match=r"file-002\.mp4: missing video"):
        X.validate_dataset(d)
    # corrupt mp4
    d = _broken_copy(ours, tmp_path, "badmp4")
    (d / "videos/observation.images.front/chunk-000/file-000.mp4").write_bytes(b"\x00not a video" * 50)
    with pytest.raises(R.DatasetError, match=r"file-000\.mp4: unreadable MP4"):
        X.validate_dataset(d)
    # corrupt / missing info.json
    d = _broken_copy(ours, tmp_path, "badinfo")
    (d / "meta/info.json").write_text('{"fps": 10,')
    with pytest.raises(R.DatasetError, match=r"meta/info\.json: corrupt JSON"):
        X.validate_dataset(d)
    (d / "meta/info.json").unlink()
    with pytest.raises(R.DatasetError, match=r"meta/info\.json: missing"):
        X.validate_dataset(d)
    # a feature with the wrong shape
    d = _broken_copy(ours, tmp_path, "shape")
    info = json.loads((d / "meta/info.json").read_text())
    info["features"]["observation.state"]["shape"] = [3]
    (d / "meta/info.json").write_text(json.dumps(info))
    with pytest.raises(R.DatasetError, match=r"feature 'observation.state' has shape \(2,\) per frame, info.json declares \(3,\)"):
        X.validate_dataset(d)
    # v2.1 gets the conversion command
    d = _broken_copy(ours, tmp_path, "v21")
    info = json.loads((d / "meta/info.json").read_text())
    info["codebase_version"] = "v2.1"
    (d / "meta/info.json").write_text(json.dumps(info))
    with pytest.raises(R.DatasetError, match="convert_dataset_v21_to_v30 --repo-id=.* --root="):
        X.validate_dataset(d)
    X.validate_dataset(ours)  # the source was never touched


def test_disk_full_on_export_and_filter_writes_nothing(ours, tmp_path, monkeypatch):
    import zarr

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(zarr.Group, "create_array", full)
    with pytest.raises(R.DatasetError, match="disk full|No space left"):
        X.export_zarr(ours, tmp_path / "out.zarr")
    assert not (tmp_path / "out.zarr").exists() and not list(tmp_path.glob(".*tmp"))
    monkeypatch.undo()

    import lerobot.datasets.dataset_tools as tools

    monkeypatch.setattr(tools, "_copy_and_reindex_data", full)
    with pytest.raises(R.DatasetError, match="No space left"):
        I.filter_dataset(ours, tmp_path / "ok", success=True)
    assert not (tmp_path / "ok").exists() and not list(tmp_path.glob(".*tmp"))
    X.validate_dataset(ours)
