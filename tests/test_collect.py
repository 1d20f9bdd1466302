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
