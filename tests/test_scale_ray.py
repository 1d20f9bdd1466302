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
    """Kills (SIGKILL) the first process whose title shows it running ``title`` (a Ray actor method),
    ``after_s`` seconds after that process is first seen (so it dies mid-run, however long the run
    took to start on a loaded machine)."""

    def __init__(self, title: str, after_s: float = 0.0):
        super().__init__(daemon=True)
        self.title, self.after_s, self.killed, self.stop = title, after_s, None, threading.Event()
        self.ignore: set[int] = set()
        self.ignore = set(self._all())  # actors of earlier runs, still exiting, are not this run's

    def _all(self) -> list[int]:
        return [proc.info["pid"] for proc in psutil.process_iter(["pid", "cmdline"])
                if any(self.title in part for part in (proc.info["cmdline"] or []))]

    def _find(self) -> int | None:
        return next((pid for pid in self._all() if pid not in self.ignore), None)

    def run(self) -> None:
        pid = None
        while not self.stop.is_set() and pid is None:
            pid = self._find()
            time.sleep(0.005)
        if pid is None or self.stop.wait(self.after_s):
            return
        try:
            os.kill(pid, signal.SIGKILL)
            self.killed = pid
        except ProcessLookupError:
            pass


def test_ray_collection_gives_the_local_episodes(local_ray, tmp_path):
    # the local backend gives each seed the same episode whatever its worker count (test_collect.py)
    local = collect(CollectConfig(env=POINT, episodes=6, workers=1, out=str(tmp_path / "local"), progress=False),
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


# ----------------------------------------------------------------------------- evaluation
class FeedbackPolicy:
    """A chunk that depends on the state, so every seed gives its own episode."""

    kind = "action"

    def predict(self, obs):
        import torch

        state = obs["observation.state"].reshape(len(obs["task"]), -1).float()
        return torch.tanh(state[:, :6] * 3.0)[:, None].expand(-1, 4, -1).clone()

    def reset(self, rows=None):
        pass


def arm_eval(tmp_path, **kw):
    from robopolicy.eval import EvalConfig

    base = dict(env=EnvConfig("robopolicy/ArmReach-v0", {"max_steps": 15}), episodes=6, workers=2, videos=0,
                out=str(tmp_path), image_size=32, progress=False)
    return EvalConfig(**{**base, **kw})


def test_ray_evaluation_gives_the_local_episodes_even_when_an_env_worker_dies(local_ray, tmp_path):
    from robopolicy.eval import evaluate

    local = evaluate(FeedbackPolicy(), arm_eval(tmp_path / "local"), log=lambda m: None).splits[0]
    remote = evaluate(FeedbackPolicy(), arm_eval(tmp_path / "ray", backend="ray"), log=lambda m: None).splits[0]
    assert remote.reruns == 0
    assert [e["seed"] for e in remote.episodes] == [e["seed"] for e in local.episodes]
    assert remote.episodes == local.episodes

    killer = Killer("ray::EnvActor", after_s=0.5)
    killer.start()
    lines: list[str] = []
    hit = evaluate(FeedbackPolicy(), arm_eval(tmp_path / "kill", backend="ray", episodes=12,
                                              env=EnvConfig("robopolicy/ArmReach-v0", {"max_steps": 40})),
                   log=lines.append).splits[0]
    killer.stop.set()
    assert killer.killed is not None and hit.reruns >= 1
    assert any("died and were replaced" in line for line in lines)
    reference = evaluate(FeedbackPolicy(), arm_eval(tmp_path / "ref", episodes=12,
                                                    env=EnvConfig("robopolicy/ArmReach-v0", {"max_steps": 40})),
                         log=lambda m: None).splits[0]
    assert hit.episodes == reference.episodes  # every seed once, each episode as the local one
