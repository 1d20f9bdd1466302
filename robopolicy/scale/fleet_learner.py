"""The fleet learner: takes finished episodes from many robots, appends them to a LeRobot dataset,
retrains (HG-DAgger's training step) and publishes versioned weights.

Three threads, so that ingest never waits on training nor training on ingest::

    robots ──submit()──► bounded intake queue ──► ingest thread ──► labels (the training aggregate)
                                                        │
                                                        └──► EpisodeRecorder (one atomic commit each)
    trainer thread: every ``retrain_every`` new labels → dagger.finetune → publish version v+1

- **Intake.** :meth:`FleetLearner.submit` puts an episode on a bounded queue. When the learner
  falls behind, the queue fills and the *senders* wait (back-pressure on the robots); the
  trainer never takes a lock that ingest holds for longer than appending to a list.
- **Ingest** turns an episode's intervention frames into HG-DAgger labels
  (:func:`robopolicy.teleop.hg_dagger.interventions`, the filter of ``refine --method hg-dagger``),
  hands them to the trainer, then commits the episode through
  :class:`~robopolicy.data.recorder.EpisodeRecorder`, with its weight version on every frame
  (``policy.version``) and in its episode row (``fleet/weight_version``, ``fleet/actor``,
  ``fleet/eval``).
- **Training** is :func:`robopolicy.refine.dagger.finetune` on the aggregate, the original data
  mixed in, as ``refine --method hg-dagger`` trains between its iterations.
- **Publishing.** Version ``v`` is written to ``<weights>/v<v:06d>/`` (``model.safetensors`` +
  ``config.yaml``, atomically by :meth:`Policy.save`), then ``latest.json`` is replaced
  atomically. Versions only grow; version 0 is the base.

An episode is a dict of numpy columns (``T`` frames)::

    {"actor": int, "seed": int, "version": int, "eval": bool, "success": bool, "task": str, "fps": int,
     "obs": {"observation.state": (T, D), "observation.images.<cam>": (T, H, W, 3) uint8, ...},
     "action": (T, A), "policy.action": (T, A), "oracle.action": (T, A), "intervention": (T,) bool,
     "flags": (T, F) bool, "next.reward": (T,), "next.success": (T,) bool, "wall": (T,) seconds}
"""

from __future__ import annotations

import json
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from robopolicy.data import features as F

POLICY_ACTION = "policy.action"
"""Frame key: the action the policy proposed (the executed ``action`` differs under intervention)."""
POLICY_VERSION = "policy.version"
"""Frame key: the weight version that drove the episode."""


def state_arrays(policy: torch.nn.Module) -> dict[str, np.ndarray]:
    """The policy's weights and buffers as numpy arrays (what travels to the actors)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in policy.state_dict().items()}


def load_arrays(policy: torch.nn.Module, arrays: dict[str, np.ndarray]) -> None:
    """Load :func:`state_arrays` output into a policy of the same architecture."""
    policy.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in arrays.items()})


def episode_features(ep: dict) -> dict[str, dict]:
    """The dataset features of a fleet episode (see the module docstring)."""
    feats: dict[str, dict] = {}
    for key, arr in ep["obs"].items():
        if key.startswith(F.IMAGE_PREFIX):
            feats[key] = F.camera(arr.shape[1], arr.shape[2])
        else:
            feats[key] = F.vector(tuple(arr.shape[1:]))
    for key in (F.ACTION, POLICY_ACTION, F.ORACLE_ACTION):
        feats[key] = F.vector(tuple(ep[key].shape[1:]))
    feats[POLICY_VERSION] = F.scalar("int64")
    feats.update(F.EXTRA_FEATURES)
    return feats


def training_frames(ep: dict, label: str) -> list[dict]:
    """The episode as HG-DAgger's per-step records (``label``: ``operator`` learns the executed
    action, ``oracle`` the clean one), ready for :func:`hg_dagger.interventions`."""
    target = ep[F.ACTION] if label == "operator" else ep[F.ORACLE_ACTION]
    out = []
    for t in range(len(target)):
        obs = {k: v[t] for k, v in ep["obs"].items()}
        obs["task"] = ep.get("task", "")
        out.append({"obs": obs, "label": np.asarray(target[t], np.float32), "intervention": bool(ep[F.INTERVENTION][t]),
                    "flags": np.asarray(ep["flags"][t]), "waypoints": None, "scene": None, "chunk": None})
    return out


@dataclass
class IngestStats:
    """What ingest did: episodes, the time they waited in the queue, the time each commit took."""

    episodes: int = 0
    frames: int = 0
    labels: int = 0
    queue_wait_s: list[float] = field(default_factory=list)
    commit_s: list[float] = field(default_factory=list)
    submit_wait_s: float = 0.0
    max_depth: int = 0


class FleetLearner:
    """Ingests fleet episodes, retrains with ``hg`` (a :class:`HGDAggerConfig`'s training settings)
    and publishes weights; see the module docstring. ``share(arrays)`` turns published weights into
    what the actors receive (``ray.put`` on Ray; the arrays themselves in one process).
    ``dataset``: the LeRobot dataset folder (``None``: keep no dataset, labels only)."""

    def __init__(self, policy, hg, weights_dir: str | Path, dataset: str | Path | None, retrain_every: int,
                 queue_size: int = 64, original=None, share: Callable[[dict], Any] = lambda a: a,
                 resume: bool = False, vcodec: str = "libsvtav1", log: Callable[[str], None] = print, seed: int = 0):
        from robopolicy.refine import dagger

        self.policy, self.hg, self.original, self.share, self.log = policy, hg, original, share, log
        self.trainee, _ = dagger.resolve_learner(policy, "policy")
        self.weights_dir = Path(weights_dir)
        self.dataset, self.resume, self.vcodec = (Path(dataset) if dataset else None), resume, vcodec
        self.retrain_every = int(retrain_every)
        self.intake: queue.Queue = queue.Queue(maxsize=int(queue_size))
        self.prng = random.Random(seed)
        self.labels: list[dict] = []
        self.rows: list[dict] = []
        self.versions: list[dict] = []
        self.stats = IngestStats()
        self.train_steps, self.train_s, self.losses = 0, 0.0, []
        self.error: BaseException | None = None
        self._new = 0
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._recorder = None
        self._t0 = time.perf_counter()
        if (self.weights_dir / "latest.json").exists():
            raise FileExistsError(f"{self.weights_dir}: weights of an earlier run are here; choose a new out")
        self.version = -1
        self.latest: Any = None
        self.publish(loss=None)  # version 0: the base
        self._ingest = threading.Thread(target=self._guard, args=(self._ingest_loop,), name="fleet-ingest", daemon=True)
        self._trainer = threading.Thread(target=self._guard, args=(self._train_loop,), name="fleet-train", daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self, train: bool = True) -> "FleetLearner":
        self._t0 = time.perf_counter()
        self._ingest.start()
        if train:
            self._trainer.start()
        return self

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def current(self) -> tuple[int, Any]:
        """``(version, shared weights)`` of the newest published version."""
        with self._cv:
            return self.version, self.latest

    def submit(self, episode: dict) -> None:
        """Hand a finished episode to the learner (waits only while the intake queue is full)."""
        self._raise()
        t0 = time.perf_counter()
        self.intake.put((time.perf_counter(), episode))
        self.stats.submit_wait_s += time.perf_counter() - t0
        self.stats.max_depth = max(self.stats.max_depth, self.intake.qsize())

    def close(self, final_step: bool = False) -> None:
        """Ingest everything submitted, optionally train once more on what arrived since the last
        step, stop the threads and close the dataset."""
        self.intake.put(None)
        if self._ingest.is_alive():
            self._ingest.join()
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._trainer.is_alive():
            self._trainer.join()
        if final_step and self._new > 0 and self.error is None:
            self._train_once()
        if self._recorder is not None:
            self._recorder.close()
        self._raise()

    def _guard(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as exc:  # noqa: BLE001 - reported by submit / close in the caller's thread
            self.error = exc
            self._stop.set()
            with self._cv:
                self._cv.notify_all()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"fleet learner: {self.error}") from self.error

    # ------------------------------------------------------------------ ingest
    def _ingest_loop(self) -> None:
        from robopolicy.refine import dagger
        from robopolicy.teleop.hg_dagger import interventions

        while True:
            item = self.intake.get()
            if item is None:
                return
            queued_at, ep = item
            self.stats.queue_wait_s.append(time.perf_counter() - queued_at)
            kept = [f for f in interventions(training_frames(ep, self.hg.label)) if dagger.keep(f, self.hg.filter)]
            with self._cv:
                self.labels += kept
                if self.hg.max_states and len(self.labels) > self.hg.max_states:
                    self.labels = self.labels[-self.hg.max_states:]
                self._new += len(kept)
                self.stats.labels += len(kept)
                if self._new >= self.retrain_every:
                    self._cv.notify_all()
            if self.dataset is not None:
                t0 = time.perf_counter()
                self._commit(ep)
                self.stats.commit_s.append(time.perf_counter() - t0)
            n = len(ep[F.ACTION])
            self.stats.episodes += 1
            self.stats.frames += n
            self.rows.append({"wall_s": round(self.elapsed(), 3), "actor": int(ep["actor"]), "seed": int(ep["seed"]),
                              "version": int(ep["version"]), "eval": bool(ep["eval"]), "success": bool(ep["success"]),
                              "frames": n, "intervention_frames": int(np.sum(ep[F.INTERVENTION])), "labels": len(kept)})

    def _commit(self, ep: dict) -> None:
        from robopolicy.data.recorder import EpisodeRecorder

        if self._recorder is None:
            from robopolicy.data.collect import quiet_encoders

            quiet_encoders()
            exists = (self.dataset / "meta" / "info.json").exists()
            self._recorder = EpisodeRecorder(self.dataset, features=episode_features(ep), fps=int(ep["fps"]),
                                             resume=self.resume and exists, vcodec=self.vcodec)
        rec = self._recorder
        rec.start_episode(seed=int(ep["seed"]))
        n = len(ep[F.ACTION])
        for t in range(n):
            frame = {k: v[t] for k, v in ep["obs"].items()}
            for key in (F.ACTION, POLICY_ACTION, F.ORACLE_ACTION, F.INTERVENTION, F.REWARD, F.SUCCESS):
                frame[key] = ep[key][t]
            frame[POLICY_VERSION] = int(ep["version"])
            rec.add_frame(frame, task=ep.get("task", ""), wall_time=float(ep["wall"][t]))
        rec.save_episode(success=bool(ep["success"]),
                         metadata={"fleet/weight_version": int(ep["version"]), "fleet/actor": int(ep["actor"]),
                                   "fleet/eval": bool(ep["eval"])})

    # ------------------------------------------------------------------ training
    def _train_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop.is_set() or self._new >= self.retrain_every)
                if self._stop.is_set():
                    return
            self._train_once()

    def _train_once(self) -> None:
        from robopolicy.refine import dagger

        with self._cv:
            data, self._new = list(self.labels), 0
        t0 = time.perf_counter()
        loss = dagger.finetune(self.trainee, data, self.hg, self.prng, self.original)
        self.train_s += time.perf_counter() - t0
        self.train_steps += self.hg.finetune_steps
        self.losses.append(loss)
        self.publish(loss)

    def publish(self, loss: float | None) -> int:
        """Write the next version's checkpoint and point ``latest.json`` at it; returns the version."""
        from robopolicy.utils.files import atomic_write_text

        version = self.version + 1
        path = self.weights_dir / f"v{version:06d}"
        self.policy.save(path)
        atomic_write_text(self.weights_dir / "latest.json",
                          json.dumps({"version": version, "checkpoint": path.name}) + "\n")
        shared = self.share(state_arrays(self.policy))
        with self._cv:
            self.version, self.latest = version, shared
        self.versions.append({"version": version, "wall_s": round(self.elapsed(), 3), "labels": len(self.labels),
                              "loss": loss})
        if version > 0:
            self.log(f"[fleet] published v{version} at {self.elapsed():.0f}s: {len(self.labels)} labels, loss {loss:.4f}")
        return version
