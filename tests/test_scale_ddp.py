"""DDP training (``robopolicy train --nproc N``): 2 gloo processes on the CPU against one process,
same seed and global batch; rank 0 alone writes; resume continues the run."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")

from robopolicy.data.collect import CollectConfig, collect  # noqa: E402
from robopolicy.envs import EnvConfig  # noqa: E402
from robopolicy.scale.ddp import Dist, launch_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def point_dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp") / "point"
    collect(CollectConfig(env=EnvConfig("robopolicy/PointReach-v0"), episodes=20, noise=0.1, out=str(out),
                          progress=False), log=lambda m: None)
    return out


def overrides(dataset: Path, out: Path, steps: int) -> list[str]:
    return [f"out={out}", f"data.dataset={dataset}", f"steps={steps}", "batch_size=32", "log_every=1",
            "save_every=10", "data.features.cameras=[]", "data.features.state=observation.state",
            "data.features.action=oracle.action", "model.head=chunk_l1", "model.context_strides=[0]",
            "model.horizon=4", "model.language.enabled=false", "model.d_model=32", "model.n_heads=2",
            "model.n_layers=1", "model.head_layers=1", "model.dropout=0.0", "optim.warmup_steps=5",
            "progress=false", "threads=1"]


def robopolicy(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "robopolicy", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def losses(out: Path) -> dict[int, float]:
    with open(out / "metrics.csv") as f:
        return {int(float(r["step"])): float(r["loss/total"]) for r in csv.DictReader(f)}


def test_the_launch_command_is_torchrun_with_the_same_arguments():
    cmd = launch_command(["train", "--config", "x.yaml", "steps=3"], 4)
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nproc_per_node=4" in cmd
    assert cmd[-5:] == ["robopolicy", "train", "--config", "x.yaml", "steps=3"]


def test_shards_split_one_global_batch(point_dataset):
    from robopolicy.train.data import CachedFeatureBatches
    from robopolicy.train.trainer import TrainConfig, build_dataset
    from robopolicy.config import load_config

    cfg = load_config(TrainConfig, None, overrides(point_dataset, Path("unused"), 1))
    ds = build_dataset(cfg, progress=False)
    whole = next(iter(CachedFeatureBatches(ds, {}, 32, seed=5)))["index"]
    parts = [next(iter(CachedFeatureBatches(ds, {}, 32, seed=5, shard=(r, 2))))["index"] for r in range(2)]
    assert [len(p) for p in parts] == [16, 16]
    assert torch.equal(torch.cat(parts), whole)
    assert Dist(rank=1, world=2).check_batch(33) and Dist(rank=1, world=2).check_batch(32) is None


def test_two_processes_follow_the_loss_curve_of_one(point_dataset, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    robopolicy("train", *overrides(point_dataset, one, 30))
    proc = robopolicy("train", "--nproc", "2", *overrides(point_dataset, two, 30))
    assert "data-parallel: 2 processes, 16 samples each" in proc.stdout
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == list(range(1, 31))
    # the first step sees the same weights and samples: only the padded chunk steps, averaged per
    # shard rather than over the whole batch, tell them apart; afterwards the curves stay together
    assert b[1] == pytest.approx(a[1], rel=0.02)
    late_a, late_b = (sum(c[s] for s in range(21, 31)) / 10 for c in (a, b))
    assert late_b == pytest.approx(late_a, rel=0.03)
    assert a[30] < 0.7 * a[1]  # it learned, in both
    # rank 0 alone wrote: one set of checkpoints, one summary, one log line per step
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step_000010", "step_000020", "step_000030"]
    assert json.loads((two / "summary.json").read_text())["metrics"]["processes"] == 2
    assert proc.stdout.count("[train] policy:") == 1

    # resume: 10 more steps from step 30 under DDP continue the curve (metrics keep steps 1..40)
    robopolicy("train", "--nproc", "2", "--resume", *overrides(point_dataset, two, 40))
    resumed = losses(two)
    assert sorted(resumed) == list(range(1, 41)) and all(resumed[s] == b[s] for s in b)
    assert (two / "checkpoints" / "step_000040").is_dir()
