"""Unattended collection with a policy driving the forward episodes: its actions run, the oracle's
relabelled actions are recorded beside them, and the arm's resets carry on between episodes."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("lerobot")
torch = pytest.importorskip("torch")

import sim_envs  # noqa: E402,F401  (registers the tasks)
from robopolicy.config import build  # noqa: E402
from robopolicy.data.collect import CollectConfig, collect  # noqa: E402
from robopolicy.envs import EnvConfig  # noqa: E402
from robopolicy.teleop.unattended import UnattendedConfig, collect_unattended  # noqa: E402
from robopolicy.train.trainer import TrainConfig, train  # noqa: E402

PP = "robopolicy/ArmPickPlace-v0"
STATE_ENV = {"use_cameras": False, "env_state": True}


def test_a_policy_drives_the_forward_episodes(tmp_path):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    demos = tmp_path / "demos"
    collect(CollectConfig(env=EnvConfig(PP, STATE_ENV), episodes=2, noise=0.1, out=str(demos), progress=False),
            log=lambda m: None)
    cfg = {"name": "state", "out": str(tmp_path / "run"), "steps": 10, "batch_size": 8, "save_every": 0,
           "progress": False,
           "data": {"dataset": str(demos), "features": {"cameras": [], "env_state": "observation.environment_state",
                                                        "action": "oracle.action"}},
           "model": {"head": "chunk_l1", "context_strides": [0], "horizon": 4, "language": {"enabled": False},
                     "d_model": 16, "n_heads": 2, "n_layers": 1, "head_layers": 1},
           "optim": {"warmup_steps": 2}}
    checkpoint = train(build(TrainConfig, cfg), log=lambda m: None).final
    out = tmp_path / "unattended"
    lines: list[str] = []
    stats = collect_unattended(UnattendedConfig(env=EnvConfig(PP, {**STATE_ENV, "max_steps": 30}), episodes=2,
                                                policy=str(checkpoint), out=str(out), progress=False), log=lines.append)
    assert stats.episodes == 2 and stats.frames > 0 and stats.resets_attempted >= 1
    assert stats.resets_succeeded + stats.hard_resets >= 1  # the world went on, by the arm or by a counted reset
    ds = LeRobotDataset("robopolicy/local", root=out)
    assert ds.meta.total_episodes == 2
    action = np.stack([np.asarray(a) for a in ds.hf_dataset["action"]])
    label = np.stack([np.asarray(a) for a in ds.hf_dataset["oracle.action"]])
    assert np.abs(action - label).max() > 1e-3  # the policy's actions ran; the oracle's were recorded as labels
    record = json.loads((out / "summary.json").read_text())
    assert record["metrics"]["episodes"] == 2
    assert record["metrics"]["forward_steps"] == stats.frames == ds.meta.total_frames
    assert "forward by " + str(checkpoint) in lines[0]
