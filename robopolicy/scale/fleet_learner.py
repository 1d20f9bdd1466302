"""The fleet learner: takes finished episodes from many robots, appends them to a LeRobot dataset,
retrains (HG-DAgger's training step) and publishes versioned weights.

Training runs in its own process, so that ingest never takes the trainer's time (nor its GIL)::

    robots ──submit()──► bounded intake queue ──► ingest thread ──► EpisodeRecorder (one atomic commit each)
                                                        │ intervention episodes
                                                        ▼
    training process: takes what arrived between steps → labels → every ``retrain_every`` new
    labels dagger.finetune → publish version v+1 ──► collector thread: the actors' next weights

- **Intake.** :meth:`FleetLearner.submit` puts an episode on a bounded queue. When ingest falls
  behind, the queue fills and the *senders* wait (back-pressure on the robots), never the trainer.
- **Ingest** (a thread of this process) forwards the episodes with interventions to the training
  process, then commits each episode through :class:`~robopolicy.data.recorder.EpisodeRecorder`,
  with its weight version on every frame (``policy.version``) and in its episode row
  (``fleet/weight_version``, ``fleet/actor``, ``fleet/eval``).
- **Training** (a spawned process) turns the interventions into HG-DAgger labels
  (:func:`robopolicy.teleop.hg_dagger.interventions` and the filter of ``refine --method
  hg-dagger``) between its steps, and trains with :func:`robopolicy.refine.dagger.finetune`, the
  original data mixed in, as ``refine --method hg-dagger`` trains between its iterations.
- **Publishing.** Version ``v`` is written to ``<weights>/v<v:06d>/`` (``model.safetensors`` +
  ``config.yaml``, atomically by :meth:`Policy.save`), then ``latest.json`` is replaced
  atomically; the weights come back to this process for the actors. Versions only grow; version
  0 is the base.

An episode is a dict of numpy columns (``T`` frames)::

    {"actor": int, "seed": int, "version": int, "eval": bool, "success": bool, "task": str, "fps": int,
     "obs": {"observation.state": (T, D), "observation.images.<cam>": (T, H, W, 3) uint8, ...},
     "action": (T, A), "policy.action": (T, A), "oracle.action": (T, A), "intervention": (T,) bool,
     "flags": (T, F) bool, "next.reward": (T,), "next.success": (T,) bool, "wall": (T,) seconds}
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import random
import threading
import time
import traceback
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


def label_columns(ep: dict) -> dict | None:
    """What training needs of an episode (``None`` when nobody intervened: nothing to learn)."""
    if not np.any(ep[F.INTERVENTION]):
        return None
    return {k: ep[k] for k in ("obs", F.ACTION, F.ORACLE_ACTION, F.INTERVENTION, "flags", "task") if k in ep}


def write_version(policy, weights_dir: Path, version: int) -> Path:
    """``<weights_dir>/v<version>/`` (atomic, by ``policy.save``), then ``latest.json`` pointing at it."""
    from robopolicy.utils.files import atomic_write_text

    path = Path(weights_dir) / f"v{version:06d}"
    policy.save(path)
    atomic_write_text(Path(weights_dir) / "latest.json", json.dumps({"version": version, "checkpoint": path.name}) + "\n")
    return path


class _StepCount:
    """``dagger.finetune``'s progress bar, counting steps into a value shared with the parent."""

    def __init__(self, value):
        self.value = value

    def update(self, n: int) -> None:
        with self.value.get_lock():
            self.value.value += n

    def set_postfix(self, *args, **kwargs) -> None:
        pass


def _trainer_main(weights_dir: str, hg, retrain_every: int, seed: int, threads: int, inbox, outbox, steps) -> None:
    """The training process: labels from what ``inbox`` brings, a step when due, each new version
    sent back on ``outbox``; ``("close", final_step)`` ends it."""
    try:
        from robopolicy.models.loading import load_policy
        from robopolicy.refine import dagger
        from robopolicy.teleop.hg_dagger import interventions

        torch.manual_seed(seed)
        torch.set_num_threads(max(1, threads))
        policy = load_policy(Path(weights_dir) / "v000000")
        trainee, _ = dagger.resolve_learner(policy, "policy")
        original = dagger.original_dataset(hg, trainee)
        prng, bar = random.Random(seed), _StepCount(steps)
        labels: list[dict] = []
        new, version, closing, final = 0, 0, False, False
        while True:
            due = new >= retrain_every if retrain_every > 0 else bool(labels)
            got: list = []
            try:  # wait only while no step is due; take at most 256 arrivals before the next step
                got.append(inbox.get(timeout=0.5) if not due else inbox.get_nowait())
                while len(got) < 256:
                    got.append(inbox.get_nowait())
            except queue.Empty:
                pass
            for kind, payload in got:
                if kind == "close":
                    closing, final = True, bool(payload)
                    continue
                kept = [f for f in interventions(training_frames(payload, hg.label)) if dagger.keep(f, hg.filter)]
                labels += kept
                new += len(kept)
            if hg.max_states and len(labels) > hg.max_states:
                labels = labels[-hg.max_states:]
            due = new >= retrain_every if retrain_every > 0 else bool(labels)
            if (closing and final and new > 0) or (not closing and due):
                new, t0 = 0, time.perf_counter()
                loss = dagger.finetune(trainee, labels, hg, prng, original, bar=bar)
                version += 1
                write_version(policy, Path(weights_dir), version)
                outbox.put(("version", version, state_arrays(policy), loss, len(labels), time.perf_counter() - t0))
            if closing:
                break
        outbox.put(("done", None))
    except BaseException:  # noqa: BLE001 - the parent reports it
        outbox.put(("error", traceback.format_exc()))


@dataclass
class IngestStats:
    """What ingest did: episodes, frames, intervention frames sent to training, the time episodes
    waited in the intake queue, the time each commit took, the time the senders waited."""

    episodes: int = 0
    frames: int = 0
    labels: int = 0
    queue_wait_s: list[float] = field(default_factory=list)
    commit_s: list[float] = field(default_factory=list)
    submit_wait_s: float = 0.0


class FleetLearner:
    """Ingests fleet episodes, retrains with ``hg`` (a :class:`HGDAggerConfig`'s training settings)
    in a training process and publishes weights; see the module docstring. ``retrain_every``: new
    labels per training step (0: train back to back while there are any labels). ``share(arrays)``
    turns published weights into what the actors receive (``ray.put`` on Ray; the arrays
    themselves in one process). ``dataset``: the LeRobot dataset folder (``None``: no dataset)."""

    def __init__(self, policy, hg, weights_dir: str | Path, dataset: str | Path | None, retrain_every: int,
                 queue_size: int = 64, share: Callable[[dict], Any] = lambda a: a, resume: bool = False,
                 vcodec: str = "libsvtav1", log: Callable[[str], None] = print, seed: int = 0, threads: int = 1):
        self.hg, self.share, self.log = hg, share, log
        self.weights_dir = Path(weights_dir)
        if (self.weights_dir / "latest.json").exists():
            raise FileExistsError(f"{self.weights_dir}: weights of an earlier run are here; choose a new out")
        self.dataset, self.resume, self.vcodec = (Path(dataset) if dataset else None), resume, vcodec
        self.intake: queue.Queue = queue.Queue(maxsize=int(queue_size))
        self.rows: list[dict] = []
        self.versions: list[dict] = []
        self.stats = IngestStats()
        self.train_s, self.aggregate = 0.0, 0
        self.error: BaseException | None = None
        self._recorder = None
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        ctx = mp.get_context("spawn")
        # bounded: when training cannot take labels as fast as they come, ingest waits, not training
        self._inbox, self._outbox, self._steps = ctx.Queue(4 * max(16, int(queue_size))), ctx.Queue(), ctx.Value("q", 0)
        self.version, self.latest = -1, None
        write_version(policy, self.weights_dir, 0)
        self._set_version(0, state_arrays(policy), None)
        self._proc = ctx.Process(target=_trainer_main, name="fleet-trainer", daemon=True,
                                 args=(str(self.weights_dir), hg, int(retrain_every), seed, threads, self._inbox,
                                       self._outbox, self._steps))
        self._ingest = threading.Thread(target=self._guard, args=(self._ingest_loop,), name="fleet-ingest", daemon=True)
        self._collector = threading.Thread(target=self._guard, args=(self._collect_loop,), name="fleet-collect",
                                           daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "FleetLearner":
        self._proc.start()
        self._t0 = time.perf_counter()
        self._ingest.start()
        self._collector.start()
        return self

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    @property
    def train_steps(self) -> int:
        """Fine-tuning steps taken so far (counted as they are taken)."""
        return int(self._steps.value)

    def current(self) -> tuple[int, Any]:
        """``(version, shared weights)`` of the newest published version."""
        with self._lock:
            return self.version, self.latest

    def submit(self, episode: dict) -> None:
        """Hand a finished episode to the learner (waits only while the intake queue is full)."""
        self._raise()
        t0 = time.perf_counter()
        self.intake.put((time.perf_counter(), episode))
        self.stats.submit_wait_s += time.perf_counter() - t0

    def add_labels(self, episodes: list[dict]) -> None:
        """Send the episodes' interventions to training (ingest does it for every episode; called alone,
        e.g. with the interventions of an earlier run, nothing is recorded)."""
        for ep in episodes:
            cols = label_columns(ep)
            if cols is not None:
                self._inbox.put(("labels", cols))

    def close(self, final_step: bool = False) -> None:
        """Ingest everything submitted, let training take one more step on what arrived since its
        last one (``final_step``), stop, close the dataset."""
        self.intake.put(None)
        if self._ingest.is_alive():
            self._ingest.join()
        self._inbox.put(("close", final_step))
        if self._collector.is_alive():
            self._collector.join()
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.terminate()
        if self._recorder is not None:
            self._recorder.close()
        self._raise()

    def _guard(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as exc:  # noqa: BLE001 - reported by submit / close in the caller's thread
            self.error = exc

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"fleet learner: {self.error}") from self.error

    # ------------------------------------------------------------------ ingest
    def _ingest_loop(self) -> None:
        while True:
            item = self.intake.get()
            if item is None:
                return
            queued_at, ep = item
            self.stats.queue_wait_s.append(time.perf_counter() - queued_at)
            self.add_labels([ep])
            if self.dataset is not None:
                t0 = time.perf_counter()
                self._commit(ep)
                self.stats.commit_s.append(time.perf_counter() - t0)
            n, labels = len(ep[F.ACTION]), int(np.sum(ep[F.INTERVENTION]))
            self.stats.episodes += 1
            self.stats.frames += n
            self.stats.labels += labels
            self.rows.append({"wall_s": round(self.elapsed(), 3), "actor": int(ep["actor"]), "seed": int(ep["seed"]),
                              "version": int(ep["version"]), "eval": bool(ep["eval"]), "success": bool(ep["success"]),
                              "frames": n, "intervention_frames": labels})

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
        for t in range(len(ep[F.ACTION])):
            frame = {k: v[t] for k, v in ep["obs"].items()}
            for key in (F.ACTION, POLICY_ACTION, F.ORACLE_ACTION, F.INTERVENTION, F.REWARD, F.SUCCESS):
                frame[key] = ep[key][t]
            frame[POLICY_VERSION] = int(ep["version"])
            rec.add_frame(frame, task=ep.get("task", ""), wall_time=float(ep["wall"][t]))
        rec.save_episode(success=bool(ep["success"]),
                         metadata={"fleet/weight_version": int(ep["version"]), "fleet/actor": int(ep["actor"]),
                                   "fleet/eval": bool(ep["eval"])})

    # ------------------------------------------------------------------ published versions
    def _collect_loop(self) -> None:
        while True:
            try:
                kind, *payload = self._outbox.get(timeout=1.0)
            except queue.Empty:
                if not self._proc.is_alive():
                    raise RuntimeError(f"the training process ended (exit code {self._proc.exitcode})") from None
                continue
            if kind == "error":
                raise RuntimeError(f"the training process failed:\n{payload[0]}")
            if kind == "done":
                return
            version, arrays, loss, aggregate, seconds = payload
            self.train_s += seconds
            self.aggregate = aggregate
            self._set_version(version, self.share(arrays), loss)
            self.log(f"[fleet] published v{version} at {self.elapsed():.0f}s: {aggregate} labels, loss {loss:.4f}")

    def _set_version(self, version: int, shared: Any, loss: float | None) -> None:
        if version <= self.version:
            raise RuntimeError(f"version {version} published after {self.version}: versions must grow")
        with self._lock:
            self.version, self.latest = version, shared
        self.versions.append({"version": version, "wall_s": round(self.elapsed(), 3), "labels": self.aggregate,
                              "loss": loss, "steps": self.train_steps})
