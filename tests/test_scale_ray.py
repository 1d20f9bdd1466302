"""``backend: ray``: collection and evaluation on Ray actors give the episodes of the local worker
processes (same seeds), and a worker killed mid-run is replaced, its episode run again, counted,
and nothing is written twice."""

from __future__ import annotations

import os
import signal
import sys
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
# The Ray workers get the policy itself; this module is not importable there, so its classes travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


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

    killer = Killer("RolloutWorker.run", after_s=0.5)
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


# ----------------------------------------------------------------------------- refinement rollouts
def same_frames(a: list[dict], b: list[dict]) -> None:
    """Two rollouts' labelled frames are the same, frame by frame and in order: the same episodes,
    steps and marks; states and labels equal up to float rounding (the local rollout predicts for
    both envs in one batch, a Ray worker for its own env alone: a network's batched arithmetic can
    differ in the last bits)."""
    assert len(a) == len(b) > 0
    for fa, fb in zip(a, b):
        np.testing.assert_allclose(fa["obs"]["observation.state"], fb["obs"]["observation.state"], atol=1e-5)
        np.testing.assert_allclose(fa["label"], fb["label"], atol=1e-5)
        np.testing.assert_allclose(fa["future"], fb["future"], atol=1e-5)
        assert (fa["index"], len(fa["episode"])) == (fb["index"], len(fb["episode"]))
        assert all(fa.get(k) == fb.get(k) for k in ("pre_failure", "unrecoverable", "rescue", "intervention"))


def test_refinement_rollouts_on_ray_give_the_local_episodes(local_ray):
    from dataclasses import replace

    from robopolicy.refine import dagger
    from robopolicy.refine.ray_rollouts import dagger_rollout, hg_dagger_rollout, rollout_pool
    from robopolicy.teleop import hg_dagger
    from test_teleop_hg_dagger import ENV, tiny_point_policy

    policy = tiny_point_policy()
    cfg = dagger.DAggerConfig(env=ENV, num_envs=2, steps_per_iteration=70, filter=[], progress=False)
    local = dagger.collect(policy, cfg, 0.5, np.random.default_rng(3), None)
    hg = hg_dagger.HGDAggerConfig(env=ENV, num_envs=2, steps_per_iteration=70, progress=False)
    hg_local, hg_counts = hg_dagger.collect(policy, hg, np.random.default_rng(4))
    with rollout_pool(replace(cfg, backend="ray"), policy) as pool:
        assert pool.size == 2
        remote = dagger_rollout(pool, policy, cfg, 0.5, np.random.default_rng(3), None)
        hg_remote, hg_remote_counts = hg_dagger_rollout(pool, policy, hg, np.random.default_rng(4))
        assert pool.stats.reruns == 0
    same_frames(local, remote)
    assert sum(f["index"] == 0 for f in local) >= 4  # several episodes per row: the merge order is tested
    same_frames(hg_local, hg_remote)
    assert hg_counts == hg_remote_counts and hg_counts["takeovers"] >= 1


def test_dagger_on_ray_refines_as_the_local_run_does_even_when_a_worker_dies(local_ray, tmp_path):
    from robopolicy.refine import dagger
    from test_teleop_hg_dagger import ENV, tiny_point_policy

    def run(backend: str, killer: Killer | None = None):
        cfg = dagger.DAggerConfig(env=ENV, num_envs=2, iterations=2, steps_per_iteration=400, finetune_steps=5,
                                  batch_size=8, lr=1e-3, filter=[], eval_episodes=2, eval_envs=1, device="cpu",
                                  progress=False, backend=backend, out=str(tmp_path / backend))
        policy = tiny_point_policy()
        if killer is not None:
            killer.start()
        summary = dagger.train(cfg, policy=policy, log=lambda m: None)
        return summary, policy.state_dict()

    local, local_weights = run("local")
    killer = Killer("RolloutWorker.run", after_s=0.05)  # rows of 200 steps: caught mid-rollout
    remote, remote_weights = run("ray", killer)
    killer.stop.set()
    assert local["rollout_reruns"] == 0
    # the killer finds the worker by its process title, which a long test session does not always
    # show; when it killed one, that worker's row ran again
    if killer.killed is not None:
        assert remote["rollout_reruns"] >= 1
    keys = ("env_steps", "kept_states", "aggregate_states", "before", "after")
    assert [remote[k] for k in keys] == [local[k] for k in keys]
    # the same frames, fine-tuned on with the same draws: the weights part only by float rounding
    # (batched and one-row predictions), which Adam's normalised steps carry to ~1e-4 in 10 steps
    for k in local_weights:
        np.testing.assert_allclose(local_weights[k].numpy(), remote_weights[k].numpy(), atol=2e-3, err_msg=k)


def test_a_saved_camera_policy_with_temporal_context_evaluates_on_ray_as_locally(local_ray, tmp_path):
    """The workers get the loaded checkpoint itself (pickled once) and run its context and chunks as
    a local row does; episodes agree up to the float rounding of one-row against batched predictions."""
    from robopolicy.eval import evaluate
    from robopolicy.models.loading import load_policy
    from test_eval import tiny_policy

    ckpt = tiny_policy().save(tmp_path / "ckpt")
    local = evaluate(load_policy(ckpt), arm_eval(tmp_path / "local", episodes=4), log=lambda m: None).splits[0]
    lines: list[str] = []
    remote = evaluate(load_policy(ckpt), arm_eval(tmp_path / "ray", episodes=4, backend="ray"), log=lines.append)
    remote = remote.splits[0]
    assert remote.reruns == 0 and remote.policy_calls > 0 and remote.start_seconds > 0
    assert [(e["seed"], e["steps"], e["success"]) for e in remote.episodes] == \
        [(e["seed"], e["steps"], e["success"]) for e in local.episodes]
    np.testing.assert_allclose([e["return"] for e in remote.episodes], [e["return"] for e in local.episodes],
                               rtol=1e-4)


def test_workers_that_a_local_ray_cannot_place_are_not_asked_for(local_ray):
    from robopolicy.scale.ray_backend import RayConfig, fit_workers

    lines: list[str] = []
    assert fit_workers(RayConfig(), 2, lines.append) == 2 and not lines
    assert fit_workers(RayConfig(), 5, lines.append) == 2  # the fixture's Ray has 2 CPUs
    assert "running 2" in lines[-1]
    assert fit_workers(RayConfig(num_cpus_per_worker=0.5), 5, lines.append) == 4
