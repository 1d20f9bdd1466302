"""``backend: ray``: collection and evaluation on Ray actors give the episodes of the local worker
processes (same seeds), and a worker killed mid-run is replaced, its episode run again, counted,
and nothing is written twice."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

import sim_envs  # noqa: E402,F401
from robopolicy.data import features as F  # noqa: E402
from robopolicy.data.collect import CollectConfig, collect  # noqa: E402
from robopolicy.data.recorder import STAGING_DIR, read_episodes  # noqa: E402
from robopolicy.envs import EnvConfig  # noqa: E402

POINT = EnvConfig("robopolicy/PointReach-v0")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()


def episodes_by_seed(root: Path) -> dict[int, np.ndarray]:
    """Every committed episode's executed actions, by its seed."""
    import pyarrow.parquet as pq

    seeds = {r["episode_index"]: r[F.EPISODE_SEED] for r in read_episodes(root).to_pylist()}
    table = pq.read_table(sorted(str(p) for p in (root / "data").rglob("*.parquet")))
    index = np.asarray(table["episode_index"].to_pylist())
    actions = np.asarray(table["action"].to_pylist(), dtype=np.float32)
    return {seeds[e]: actions[index == e] for e in sorted(seeds)}


class Killer(threading.Thread):
    """Kills (SIGKILL) the first process whose title shows it running ``title`` (a Ray actor method)."""

    def __init__(self, title: str, after_s: float = 0.0):
        super().__init__(daemon=True)
        self.title, self.after_s, self.killed, self.stop = title, after_s, None, threading.Event()

    def run(self) -> None:
        time.sleep(self.after_s)
        while not self.stop.is_set() and self.killed is None:
            for proc in psutil.process_iter(["pid", "cmdline"]):
                if any(self.title in part for part in (proc.info["cmdline"] or [])):
                    os.kill(proc.info["pid"], signal.SIGKILL)
                    self.killed = proc.info["pid"]
                    return
            time.sleep(0.005)


def test_ray_collection_gives_the_local_episodes(local_ray, tmp_path):
    local = collect(CollectConfig(env=POINT, episodes=6, workers=2, out=str(tmp_path / "local"), progress=False),
                    log=lambda m: None)
    remote = collect(CollectConfig(env=POINT, episodes=6, workers=2, backend="ray", out=str(tmp_path / "ray"),
                                   progress=False), log=lambda m: None)
    assert local.episodes == remote.episodes == 6 and remote.reruns == 0
    a, b = episodes_by_seed(tmp_path / "local"), episodes_by_seed(tmp_path / "ray")
    assert sorted(a) == sorted(b) == list(range(6))
    for seed in a:
        np.testing.assert_array_equal(a[seed], b[seed])


def test_a_killed_collection_worker_is_replaced_and_its_episode_rerun(local_ray, tmp_path):
    killer = Killer("CollectActor.stage")
    killer.start()
    out = tmp_path / "ds"
    summary = collect(CollectConfig(env=POINT, episodes=12, workers=2, backend="ray", out=str(out), progress=False),
                      log=lambda m: None)
    killer.stop.set()
    assert killer.killed is not None
    assert summary.reruns >= 1 and summary.episodes == 12 and summary.total_episodes == 12
    assert "rerun" in summary.table()
    rows = read_episodes(out).to_pylist()
    assert sorted(r[F.EPISODE_SEED] for r in rows) == list(range(12))  # each once
    assert not any((out / STAGING_DIR).glob("*")) if (out / STAGING_DIR).exists() else True
    reference = collect(CollectConfig(env=POINT, episodes=12, out=str(tmp_path / "ref"), progress=False),
                        log=lambda m: None)
    assert reference.episodes == 12
    a, b = episodes_by_seed(tmp_path / "ref"), episodes_by_seed(out)
    for seed in a:
        np.testing.assert_array_equal(a[seed], b[seed])
