"""robopolicy collect: oracle episodes in worker processes, loadable by lerobot, resumable."""

from __future__ import annotations

import argparse
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from robopolicy.data import features as F  # noqa: E402
from robopolicy.data.collect import CollectConfig, collect, committed_seeds  # noqa: E402
from robopolicy.data.recorder import DatasetError, read_episodes  # noqa: E402
from robopolicy.envs import EnvConfig  # noqa: E402

PF = EnvConfig(id="robopolicy/PersonFollow-v0", kwargs={"split": "dt", "max_steps": 60})


def parser() -> argparse.ArgumentParser:
    from robopolicy.commands import collect as collect_cmd

    p = argparse.ArgumentParser(prog="robopolicy")
    sub = p.add_subparsers(dest="command")
    collect_cmd.add_parser(sub)
    return p


def test_collect_cli_workers_then_resume_loads_in_lerobot(tmp_path, capsys):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    out = tmp_path / "pf"
    args = parser().parse_args(["collect", "--env", "robopolicy/PersonFollow-v0", "--split", "dt", "--episodes", "3",
                                "--workers", "2", "--noise", "0.1", "--image-size", "96", "--out", str(out),
                                "--no-progress", "env.kwargs.max_steps=60"])
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "frames/s" in table and "oracle success" in table

    ds = LeRobotDataset("local/pf", root=out, video_backend="pyav")
    assert ds.meta.total_episodes == 3
    assert ds.meta.info["features"]["observation.images.front"]["shape"] == (96, 96, 3)
    assert ds.meta.info["fps"] == 10
    item = ds[len(ds) - 1]
    assert item["observation.images.front"].shape == (3, 96, 96)
    assert item[F.ORACLE_WAYPOINTS].shape == (8, 3)
    assert item[F.TARGET_BOX].shape == (4,)
    assert bool(item[F.DONE])
    assert isinstance(item["task"], str) and item["task"]
    assert committed_seeds(out) == {0, 1, 2}
    rows = read_episodes(out).to_pylist()
    assert all(r["length"] <= 60 for r in rows)
    # the recorded label is the clean oracle action, the executed one is noisy
    actions = np.stack([ds[i]["action"].numpy() for i in range(10)])
    labels = np.stack([ds[i][F.ORACLE_ACTION].numpy() for i in range(10)])
    assert not np.allclose(actions, labels)

    with pytest.raises(DatasetError, match="--resume"):
        collect(CollectConfig(env=PF, episodes=4, out=str(out), image_size=96, progress=False), log=lambda m: None)
    summary = collect(CollectConfig(env=PF, episodes=4, out=str(out), image_size=96, resume=True, progress=False),
                      log=lambda m: None)
    assert summary.episodes == 1 and summary.total_episodes == 4
    assert committed_seeds(out) == {0, 1, 2, 3}
    ds = LeRobotDataset("local/pf", root=out, video_backend="pyav")
    assert ds.meta.total_episodes == 4 and len(ds) == sum(r["length"] for r in read_episodes(out).to_pylist())
    _ = ds[len(ds) - 1]["observation.images.front"]


def test_collect_arm_task_two_cameras(tmp_path):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    out = tmp_path / "arm"
    cfg = CollectConfig(env=EnvConfig(id="robopolicy/ArmReach-v0"), episodes=1, workers=1, noise=0.0,
                        image_size=96, out=str(out), progress=False)
    summary = collect(cfg, log=lambda m: None)
    assert summary.episodes == 1 and summary.frames > 0 and summary.frames_per_s > 0
    ds = LeRobotDataset("local/arm", root=out, video_backend="pyav")
    assert set(ds.meta.video_keys) == {"observation.images.front", "observation.images.wrist"}
    assert ds.meta.info["fps"] == 20
    item = ds[0]
    assert item["observation.images.wrist"].shape == (3, 96, 96)
    assert np.allclose(item["action"].numpy(), item[F.ORACLE_ACTION].numpy())  # no noise: label == action
    assert F.ORACLE_WAYPOINTS not in ds.meta.features
    # the goal label: ArmReach has no cube, so the "object" is the tool-centre point
    assert tuple(ds.meta.features[F.GOAL_POS]["shape"]) == (6,)
    assert np.isfinite(item[F.GOAL_POS].numpy()).all() and np.abs(item[F.GOAL_POS].numpy()).max() < 1.0


def test_collect_posed_frames_for_a_locator(tmp_path, capsys):
    """--poses: no oracle; each episode holds several layouts' posed frames with their labels, and
    every frame's action holds its pose."""
    from robopolicy.data.cache import TrainingCache, ensure_cache

    out = tmp_path / "posed"
    args = parser().parse_args(["collect", "--env", "robopolicy/ArmPickPlace-v0", "--episodes", "2", "--poses", "3",
                                "--image-size", "32", "--out", str(out), "--no-progress", "layouts_per_episode=4"])
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "posed frames" in table and "oracle success" not in table
    rows = read_episodes(out).to_pylist()
    assert [r["length"] for r in rows] == [12, 12]
    cache = TrainingCache(ensure_cache(out, cache_dir=tmp_path / "cache", progress=False))
    state = cache.lowdim[F.STATE]
    assert np.allclose(cache.lowdim[F.ACTION], state) and np.allclose(cache.lowdim[F.ORACLE_ACTION], state)
    grip = cache.lowdim[F.GOAL_GRIP]
    assert grip.shape == (24, 6) and np.isfinite(grip).all()
    # four layouts per episode: the bowl (world frame) changes every 3 frames, not within them
    bowls = grip[:12, 3:]
    assert np.allclose(bowls[0], bowls[2]) and not np.allclose(bowls[2], bowls[3])
    assert len(np.unique(bowls.round(6), axis=0)) == 4
    with pytest.raises(DatasetError, match="pose"):
        collect(CollectConfig(env=EnvConfig(id="robopolicy/PointReach-v0"), episodes=1, poses=2,
                              out=str(tmp_path / "point"), progress=False), log=lambda m: None)
    with pytest.raises(DatasetError, match="pose_phases.*hover"):  # refused before anything is written
        collect(CollectConfig(env=EnvConfig(id="robopolicy/ArmPickPlace-v0"), episodes=1, poses=2,
                              pose_phases={"hover": 1.0}, out=str(tmp_path / "bad"), progress=False), log=lambda m: None)
    assert not (tmp_path / "bad").exists()
