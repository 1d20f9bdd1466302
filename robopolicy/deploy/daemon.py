"""``robopolicy serve``: a policy on a robot as a long-running, supervised service.

One process holds the control node (its loop thread and watchdog, as in ``robopolicy run``),
spawns the policy worker process, records episodes, and feeds the HTTP API, which runs in a
process of its own (:mod:`.api`) from snapshots the daemon sends it. Nothing here runs in the control loop's path except :meth:`Daemon._on_tick`,
the node's ``on_observation`` callback, which only keeps references and, at the recording rate,
puts one tuple on a bounded queue (never blocking: a full queue drops the frame and counts it).

Supervision (a thread at ``supervisor.period_s``):

* a newly latched fault is logged, counted and marked in the episode being recorded;
* a dead worker (crash, kill) is restarted with exponential backoff; the fault stays latched
  (the robot holds safe) until an operator resets it;
* ``WATCHDOG=1`` goes to systemd only while the loop's tick counter advances and its last tick is
  recent: a stuck loop stops the pings and systemd restarts the service;
* an episode longer than ``recording.max_episode_s`` is stopped and saved.

Episodes are LeRobot v3 datasets written through :class:`~robopolicy.data.recorder.EpisodeRecorder`
(each episode committed atomically) in *segments*: ``<root>/ds-000000``, ``ds-000001``, … of at
most ``recording.episodes_per_dataset`` episodes each. The disk quota rotates whole segments,
oldest first; when the disk's free space falls under ``recording.min_free_mb`` recording pauses
(the robot keeps running) and the status says why. A ``kill -9`` loses at most the episode in
progress: the next start recovers every segment (:func:`~robopolicy.data.recorder.recover`).

Every event is one JSON line on stderr (journald) and, when configured, in ``log_file``.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hardware.control.clock import TickTimer
from robopolicy.config import ConfigError, build, deep_merge, load_yaml, parse_overrides
from robopolicy.deploy.run import RobotConfig, RunConfig, build_node


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass
class ApiConfig:
    enabled: bool = True
    host: str = "127.0.0.1"  # loopback by default; any other address needs token_file
    port: int = 8765  # 0: an ephemeral port (its number is logged in the api_listening event)
    token_file: str | None = None  # file holding the bearer token every mutating call must carry


@dataclass
class RecordingConfig:
    enabled: bool = True
    root: str = "outputs/deploy/episodes"  # segments ds-000000, ds-000001, ... live here
    fps: int = 20
    task: str | None = None  # the instruction stored with each episode; default: the robot's own
    episodes_per_dataset: int = 20  # episodes per segment (the unit the quota rotates)
    quota_mb: float = 2000.0  # the recordings' total size; the oldest segments go beyond it
    min_free_mb: float = 200.0  # recording pauses while the disk has less free space
    queue_size: int = 256  # frames waiting for the writer thread; beyond, frames are dropped (counted)
    max_episode_s: float = 600.0  # an episode is stopped and saved after this long
    vcodec: str = "libsvtav1"


@dataclass
class SupervisorConfig:
    period_s: float = 0.05  # the supervisor's (and watchdog ping's) period
    restart_backoff_s: float = 0.5  # first delay before restarting a dead worker, doubled per crash
    restart_backoff_max_s: float = 30.0
    healthy_after_s: float = 30.0  # a worker alive this long resets the backoff
    ready_timeout_s: float = 120.0  # robot connected + policy warm within this, or the start fails
    swap_timeout_s: float = 120.0  # a hot-swapped checkpoint must answer within this
    stale_tick_s: float = 0.5  # the loop's last tick older than this: no WATCHDOG=1


@dataclass
class DeployConfig:
    """``robopolicy serve``: ``configs/deploy/*.yaml``.

    ``robot`` is a robot config (``configs/robots/*.yaml``): inline, or the path of that file
    (relative to the deploy config's folder or the working directory).
    """

    robot: RobotConfig = field(default_factory=RobotConfig)
    policy: str = "hold"  # checkpoint directory or scripted spec (hold, sine, arc, replay:FILE)
    api: ApiConfig = field(default_factory=ApiConfig)
    recording: RecordingConfig = field(default_factory=RecordingConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    log_file: str | None = None  # JSON lines, besides stderr
    report: str | None = None  # the node's timing report at exit (JSON), when set


def _resolve_robot(data: dict[str, Any], base: Path | None) -> dict[str, Any]:
    robot = data.get("robot")
    if isinstance(robot, str):
        candidates = [Path(robot)] if base is None else [base / robot, Path(robot)]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            raise ConfigError(f"robot: robot config file {robot!r} not found (looked in {[str(p) for p in candidates]})")
        data = dict(data, robot=load_yaml(path))
    return data


def load_deploy_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> DeployConfig:
    """Read and check a deploy config; every problem is a :class:`ConfigError` raised before
    anything is started, connected or spawned."""
    data = load_yaml(path) if path is not None else {}
    source = str(path) if path is not None else "<defaults>"
    data = _resolve_robot(data, Path(path).parent if path is not None else None)
    if overrides:
        parsed = parse_overrides(overrides)
        if isinstance(parsed.get("robot"), str):
            data = dict(data, robot=parsed.pop("robot"))
            data = _resolve_robot(data, None)
        data = deep_merge(data, parsed)
        source += " + overrides"
    cfg = build(DeployConfig, data, source)
    check_config(cfg, source)
    return cfg


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"api.token_file: {path} does not exist")
    token = p.read_text().strip()
    if len(token) < 16:
        raise ConfigError(f"api.token_file: {path} holds a token of {len(token)} characters; use at least 16")
    return token


def check_config(cfg: DeployConfig, source: str = "<config>") -> None:
    """Refuse a config that cannot work, naming the dotted key and the file."""
    from hardware.drivers import DRIVER_TYPES
    from robopolicy.deploy.worker import SCRIPTED, _parse_options

    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"{source}: {key}: {why}")

    if cfg.robot.driver.type not in DRIVER_TYPES:
        raise bad("robot.driver.type", f"unknown driver {cfg.robot.driver.type!r}; known: {list(DRIVER_TYPES)}")
    tc = cfg.robot.transport
    if not tc.spawn_worker:
        raise bad("robot.transport.spawn_worker", "the daemon supervises (restarts, swaps) its own worker; must be true")
    if tc.endpoint is not None:
        raise bad("robot.transport.endpoint", "the daemon's worker uses a private ipc socket; leave it unset")
    if tc.request_hz <= 0:
        raise bad("robot.transport.request_hz", "must be > 0")
    problem = policy_problem(cfg.policy, SCRIPTED, _parse_options)
    if problem:
        raise bad("policy", problem)
    api = cfg.api
    if not 0 <= api.port <= 65535:
        raise bad("api.port", f"{api.port} is not a port number")
    if api.token_file is not None:
        try:
            read_token(api.token_file)
        except ConfigError as exc:
            raise bad("api.token_file", str(exc).split(": ", 1)[1]) from None
    if api.enabled and not is_loopback(api.host) and api.token_file is None:
        raise bad("api.host", f"{api.host} is not a loopback address: binding it needs api.token_file")
    rec = cfg.recording
    if rec.fps <= 0:
        raise bad("recording.fps", "must be > 0")
    if rec.episodes_per_dataset < 1:
        raise bad("recording.episodes_per_dataset", "must be >= 1")
    if rec.quota_mb <= 0 or rec.min_free_mb < 0:
        raise bad("recording.quota_mb", "quota_mb must be > 0 and min_free_mb >= 0")
    if rec.queue_size < 1:
        raise bad("recording.queue_size", "must be >= 1")
    if rec.enabled:
        from lerobot.datasets.video_utils import VALID_VIDEO_CODECS

        if rec.vcodec not in VALID_VIDEO_CODECS:
            raise bad("recording.vcodec", f"{rec.vcodec!r} is not one of lerobot's {sorted(VALID_VIDEO_CODECS)}")
        root = Path(rec.root)
        parent = next((p for p in [root, *root.parents] if p.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
            raise bad("recording.root", f"{rec.root} cannot be created (no writable parent folder)")
    sup = cfg.supervisor
    if sup.period_s <= 0 or sup.restart_backoff_s <= 0 or sup.restart_backoff_max_s < sup.restart_backoff_s:
        raise bad("supervisor", "period_s and restart_backoff_s must be > 0, restart_backoff_max_s >= restart_backoff_s")


def policy_problem(spec: str, scripted: dict, parse_options) -> str | None:
    """Why a policy spec cannot be loaded (checked without loading a model), or None."""
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.yaml").is_file() and not any(path.glob("*.yaml")):
            return f"{spec}: a folder without a checkpoint config (config.yaml)"
        return None
    name, _, rest = spec.partition(":")
    if name not in scripted:
        return f"{spec!r} is neither a checkpoint folder nor a scripted policy ({sorted(scripted)})"
    if name == "replay":
        file, _, rest = rest.partition(",")
        if not file or not Path(file).is_file():
            return f"replay file {file!r} not found"
    try:
        parse_options(rest)
    except ValueError as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------------------------
# Events, timing, notification
# --------------------------------------------------------------------------------------------


class EventLog:
    """One JSON object per line: ``{"ts": unix time, "event": name, ...fields}``."""

    def __init__(self, path: str | None = None, stream=None, keep: int = 200):
        self._lock = threading.Lock()
        self._stream = sys.stderr if stream is None else stream
        self._file = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)
        self.recent: deque[dict] = deque(maxlen=keep)

    def __call__(self, event: str, **fields: Any) -> dict:
        record = {"ts": round(time.time(), 6), "event": event, **fields}
        line = json.dumps(record, default=str)
        with self._lock:
            self.recent.append(record)
            for out in (self._stream, self._file):
                if out is not None:
                    try:
                        out.write(line + "\n")
                        out.flush()
                    except (OSError, ValueError):
                        pass
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class RingTickTimer(TickTimer):
    """The node's tick record as a ring: a service runs for days, the default timer's buffer
    holds about an hour at 500 Hz. ``n`` counts every tick ever recorded; :meth:`since` returns
    the lateness values recorded after a given count (those still in the ring)."""

    def __init__(self, period: float, capacity: int = 1 << 16, max_miss_details: int = 1000):
        super().__init__(period, capacity, max_miss_details)
        self.capacity = capacity
        self.last_start = math.nan

    def record(self, lateness: float, work: float, start: float = float("nan"), cpu: float = float("nan"),
               usage_before=None, usage_after=None) -> None:
        i = self.n % self.capacity
        self.lateness[i], self.work[i], self.cpu[i], self.start[i] = lateness, work, cpu, start
        self.last_start = start
        self.n += 1
        self.count_miss(lateness, work, start, cpu, usage_before, usage_after)

    def _window(self, a: np.ndarray, first: int, last: int) -> np.ndarray:
        first = max(first, last - self.capacity, 0)
        if first >= last:
            return a[:0]
        i, j = first % self.capacity, last % self.capacity
        return a[i:j].copy() if i < j else np.concatenate([a[i:], a[:j]])

    def since(self, count: int) -> tuple[np.ndarray, int]:
        """(lateness of the ticks after ``count`` still in the ring, the new count)."""
        n = self.n
        return self._window(self.lateness, count, n), n

    def recent(self, n: int) -> np.ndarray:
        last = self.n
        return self._window(self.lateness, last - n, last)

    def summary(self) -> dict:
        late = self._window(self.lateness, 0, self.n) * 1e6
        work = self._window(self.work, 0, self.n) * 1e6

        def pct(a, q):
            return float(np.percentile(a, q)) if len(a) else float("nan")

        return {
            "ticks": self.n,
            "window_ticks": int(len(late)),
            "period_us": self.period * 1e6,
            "lateness_us": {"p50": pct(late, 50), "p99": pct(late, 99), "p999": pct(late, 99.9),
                            "max": float(late.max()) if len(late) else float("nan")},
            "work_us": {"p50": pct(work, 50), "p99": pct(work, 99), "max": float(work.max()) if len(work) else float("nan")},
            "missed_deadlines": self.missed,
            "miss_causes": {k: v for k, v in self.miss_causes.items() if v},
            "skipped_ticks": self.skipped,
        }


class Notifier:
    """systemd's notify protocol through ``sdnotify`` (a no-op without ``NOTIFY_SOCKET``)."""

    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._n = None
        if self.enabled:
            import sdnotify

            self._n = sdnotify.SystemdNotifier()
            # a notify socket nobody reads (its queue full) must never block a daemon thread:
            # a message that cannot go now is dropped (the next ping follows)
            self._n.socket.setblocking(False)
        self.sent: deque[str] = deque(maxlen=64)

    def __call__(self, message: str) -> None:
        if self._n is not None:
            self._n.notify(message)
            self.sent.append(message.split("\n")[0])


# --------------------------------------------------------------------------------------------
# Recording: a writer thread in front of EpisodeRecorder, segments, quota
# --------------------------------------------------------------------------------------------


def folder_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


class EpisodeWriter:
    """Owns the recorder; every dataset operation happens in its own thread.

    The control loop only calls :meth:`offer` (``put_nowait``); the API calls :meth:`start`,
    :meth:`stop` and :meth:`mark`, which are queued in order with the frames.
    """

    SEGMENT = "ds-{:06d}"

    def __init__(self, cfg: RecordingConfig, log: EventLog, robot_type: str):
        self.cfg, self.log, self.robot_type = cfg, log, robot_type
        self.root = Path(cfg.root)
        self.queue: queue.Queue = queue.Queue(cfg.queue_size)
        self.recorder = None
        self.segment: Path | None = None
        self.features: dict | None = None
        self.state = "idle"  # idle | recording | saving | paused
        self.paused_reason: str | None = None
        self.episode: dict | None = None  # the episode in progress (id, task, start, frames, faults, ...)
        self.last_episode: dict | None = None
        self.episodes_saved = 0
        self.episodes_failed = 0
        self.frames_dropped = 0
        self.frames_written = 0
        self.rotated_segments = 0
        self.recovered: list[dict] = []
        self._results: dict[int, threading.Event] = {}
        self._next_id = 0
        self._thread = threading.Thread(target=self._run, name="episode-writer", daemon=True)
        self._stop = threading.Event()

    # -- any thread --------------------------------------------------------------------------
    def open(self) -> None:
        """Recover every segment left by an earlier run (a kill -9 included), then start the thread."""
        self.root.mkdir(parents=True, exist_ok=True)
        from robopolicy.data.errors import DatasetError
        from robopolicy.data.recorder import INFO_PATH, recover

        for seg in sorted(self.root.glob("ds-*")):
            if not (seg / INFO_PATH).is_file():
                shutil.rmtree(seg, ignore_errors=True)
                self.log("dataset_removed", path=str(seg), reason="no meta/info.json (creation interrupted)")
                continue
            try:
                rep = recover(seg)
            except DatasetError as exc:
                self.log("dataset_unrecoverable", path=str(seg), error=str(exc))
                continue
            self.recovered.append({"path": str(seg), "episodes": rep.episodes, "removed": len(rep.removed)})
            if rep.removed:
                self.log("dataset_recovered", path=str(seg), episodes=rep.episodes, removed=rep.removed[:20])
        self._check_space()
        self._thread.start()

    def offer(self, item: tuple) -> None:
        """From the control loop: never blocks."""
        try:
            self.queue.put_nowait(("frame", item))
        except queue.Full:
            self.frames_dropped += 1

    def _command(self, *item: Any) -> None:
        self.queue.put(item, timeout=5.0)

    def start(self, task: str, policy: str) -> dict:
        self._next_id += 1
        info = {"id": self._next_id, "task": task, "policy": policy, "started": time.time(), "frames": 0,
                "faults": [], "worker_restarts": 0, "recorded": self.paused_reason is None,
                "paused_reason": self.paused_reason}
        self.episode = info
        if info["recorded"]:
            self.state = "recording"
        self._command("start", info)
        return info

    def stop(self, success: bool | None, reason: str, wait: float | None = None) -> dict | None:
        info = self.episode
        if info is None:
            return None
        self.episode = None
        done = threading.Event()
        self._results[info["id"]] = done
        info["stop_reason"] = reason
        self._command("stop", info, success)
        if wait:
            done.wait(wait)
        return info

    def mark(self, kind: str, **fields: Any) -> None:
        """Note a fault or a worker restart in the episode in progress."""
        info = self.episode
        if info is None:
            return
        if kind == "fault":
            info["faults"].append(fields)
        elif kind == "worker_restart":
            info["worker_restarts"] += 1

    def close(self, timeout: float = 60.0) -> None:
        self._stop.set()
        try:
            self.queue.put(("quit",), timeout=timeout)
        except queue.Full:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None

    def size_bytes(self) -> int:
        return folder_bytes(self.root) if self.root.exists() else 0

    def status(self) -> dict:
        ep = self.episode
        return {
            "enabled": True, "state": self.state, "paused_reason": self.paused_reason, "root": str(self.root),
            "segment": str(self.segment) if self.segment else None,
            "episode": None if ep is None else {k: ep[k] for k in ("id", "task", "policy", "frames", "recorded")}
            | {"faults": [f.get("code") for f in ep["faults"]], "seconds": time.time() - ep["started"]},
            "last_episode": self.last_episode, "episodes_saved": self.episodes_saved,
            "episodes_failed": self.episodes_failed, "frames_written": self.frames_written,
            "frames_dropped": self.frames_dropped, "queue_depth": self.queue.qsize(),
            "rotated_segments": self.rotated_segments,
        }

    # -- writer thread -----------------------------------------------------------------------
    def _check_space(self) -> None:
        """Pause (or resume) recording on the disk's free space."""
        try:
            free_mb = shutil.disk_usage(self.root).free / 1e6
        except OSError as exc:
            free_mb, why = 0.0, f"cannot read the disk's free space ({exc})"
        else:
            why = f"disk free {free_mb:.0f} MB < recording.min_free_mb {self.cfg.min_free_mb:.0f} MB"
        if free_mb < self.cfg.min_free_mb:
            if self.paused_reason is None:
                self.paused_reason = why
                self.state = "paused"
                self.log("recording_paused", reason=why)
        elif self.paused_reason is not None:
            self.log("recording_resumed", free_mb=round(free_mb))
            self.paused_reason = None
            if self.state == "paused":
                self.state = "idle"

    def _enforce_quota(self) -> None:
        """Delete the oldest segments while the recordings exceed the quota; when the current
        segment alone is over it, later episodes go to a new segment and it is rotated too."""
        quota = self.cfg.quota_mb * 1e6
        total = self.size_bytes()
        if total <= quota:
            return
        segments = sorted(self.root.glob("ds-*"))
        while total > quota and segments:
            oldest = segments.pop(0)
            if oldest == self.segment:
                if self.recorder is not None:
                    self.recorder.close()
                self.recorder, self.segment = None, None
            size = folder_bytes(oldest)
            shutil.rmtree(oldest, ignore_errors=True)
            total -= size
            self.rotated_segments += 1
            self.log("episodes_rotated", path=str(oldest), freed_mb=round(size / 1e6, 3),
                     total_mb=round(total / 1e6, 3), quota_mb=self.cfg.quota_mb)

    def _open_recorder(self, frame_features: dict) -> None:
        from robopolicy.data.errors import DatasetError
        from robopolicy.data.recorder import INFO_PATH, EpisodeRecorder, read_info

        if self.recorder is not None:
            if self.recorder.num_episodes < self.cfg.episodes_per_dataset and self.features == frame_features:
                return
            self.recorder.close()
            self.recorder = None
        segments = sorted(self.root.glob("ds-*"))
        last = segments[-1] if segments else None
        if last is not None and (last / INFO_PATH).is_file():
            try:
                if read_info(last)["total_episodes"] < self.cfg.episodes_per_dataset:
                    self.recorder = EpisodeRecorder(last, frame_features, self.cfg.fps, resume=True,
                                                    vcodec=self.cfg.vcodec)
                    self.segment, self.features = last, frame_features
                    return
            except DatasetError as exc:  # other features (another robot or policy shape): a new segment
                self.log("dataset_new_segment", reason=str(exc)[:300])
        index = int(last.name.split("-")[1]) + 1 if last is not None else 0
        seg = self.root / self.SEGMENT.format(index)
        self.recorder = EpisodeRecorder(seg, frame_features, self.cfg.fps, robot_type=self.robot_type,
                                        vcodec=self.cfg.vcodec)
        self.segment, self.features = seg, frame_features
        self.log("dataset_created", path=str(seg))

    def _run(self) -> None:
        try:  # Linux: a thread's own nice value, inherited by the encoder threads it starts; the
            # encoding must not take the CPU from the policy worker or the simulation
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (OSError, AttributeError):
            pass
        current: dict | None = None  # the episode the thread is writing
        staged = False
        last_space_check = 0.0
        while True:
            try:
                item = self.queue.get(timeout=0.5)
            except queue.Empty:
                item = None
            now = time.monotonic()
            if now - last_space_check > 2.0:
                last_space_check = now
                self._check_space()
            if item is None:
                continue
            kind = item[0]
            try:
                if kind == "quit":
                    if current is not None and staged:
                        self._save(current, None)
                    return
                if kind == "start":
                    if current is not None and staged:
                        self._save(current, None)
                    current, staged = item[1], False
                    self._enforce_quota()
                    self._check_space()
                    if self.paused_reason is not None:
                        current["recorded"], current["paused_reason"] = False, self.paused_reason
                elif kind == "frame":
                    if current is None or not current["recorded"]:
                        continue
                    if self.paused_reason is not None:  # paused in the middle: keep what was written
                        current["paused_reason"] = self.paused_reason
                        continue
                    frame, features = build_frame(*item[1])
                    t_obs = item[1][5]
                    if not staged:
                        self._open_recorder(features)
                        self.recorder.start_episode()
                        staged, current["t0"] = True, t_obs
                    # the frame's real time is its observation's, not the writer's
                    self.recorder.add_frame(frame, current["task"], wall_time=t_obs - current["t0"])
                    current["frames"] += 1
                    self.frames_written += 1
                elif kind == "stop":
                    info, success = item[1], item[2]
                    if current is not None and current["id"] == info["id"]:
                        if staged:
                            self._save(current, success)
                        else:
                            current["saved"] = False
                            self.last_episode = _episode_summary(current)
                            self.log("episode_not_recorded", id=current["id"],
                                     reason=current.get("paused_reason") or "no frames")
                        current, staged = None, False
                    ev = self._results.pop(info["id"], None)
                    if ev is not None:
                        ev.set()
                    if self.episode is None and self.state != "paused":
                        self.state = "idle"
            except Exception as exc:  # noqa: BLE001 - a recording error never takes the robot down
                self.episodes_failed += 1
                self.log("recording_error", error=f"{type(exc).__name__}: {exc}"[:500],
                         episode=None if current is None else current["id"])
                if self.recorder is not None:
                    try:
                        self.recorder.discard_episode()
                    except Exception:  # noqa: BLE001
                        self.recorder = None
                if current is not None:
                    current["saved"] = False
                    current["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    self.last_episode = _episode_summary(current)
                current, staged = None, False
                if kind == "stop":
                    ev = self._results.pop(item[1]["id"], None)
                    if ev is not None:
                        ev.set()

    def _save(self, info: dict, success: bool | None) -> None:
        self.state = "saving" if self.episode is None else self.state
        meta = {"robopolicy/policy": info["policy"], "robopolicy/faults": json.dumps(info["faults"], default=str),
                "robopolicy/worker_restarts": int(info["worker_restarts"]),
                "robopolicy/stop_reason": str(info.get("stop_reason", "shutdown")),
                "robopolicy/recording_paused": bool(info.get("paused_reason"))}
        summary = self.recorder.save_episode(success=success, metadata=meta)
        info.update(saved=True, episode_index=summary.episode_index, dataset=str(self.segment),
                    frames=summary.frames)
        self.episodes_saved += 1
        self.last_episode = _episode_summary(info)
        self.log("episode_saved", id=info["id"], dataset=str(self.segment), episode_index=summary.episode_index,
                 frames=summary.frames, faults=[f.get("code") for f in info["faults"]],
                 worker_restarts=info["worker_restarts"], cadence=summary.cadence.line())
        self._enforce_quota()


def _episode_summary(info: dict) -> dict:
    keep = ("id", "task", "policy", "frames", "saved", "episode_index", "dataset", "stop_reason", "error",
            "paused_reason", "worker_restarts")
    out = {k: info.get(k) for k in keep if k in info}
    out["faults"] = [f.get("code") for f in info["faults"]]
    return out


CHUNK = "policy.chunk"  # (H, A) the chunk (or waypoints) the policy last sent, as received
CHUNK_NEW = "policy.chunk_new"  # bool (1,): that chunk arrived since the previous frame
CHUNK_AGE = "policy.chunk_age"  # float32 (1,): seconds since the observation the chunk was computed from
FAULT = "fault.active"  # bool (1,): a fault was latched (the robot held safe)


def build_frame(obs: dict, sent, chunk, chunk_new: bool, chunk_t_obs: float, t_obs: float, faulted: bool,
                estop: bool) -> tuple[dict, dict]:
    """One dataset frame and its feature declarations from what the loop handed over.

    ``action`` is the command actually written; with none written (a fault) the state itself:
    the robot held its position (an arm) or stood (a base: zeros, the state's shape differs).
    """
    from robopolicy.data import features as F

    state = np.asarray(obs[F.STATE], dtype=np.float32)
    if sent is not None:
        action = np.asarray(sent, dtype=np.float32)
    else:
        action = state.copy() if chunk is None or chunk.shape[-1] == state.shape[0] else np.zeros(chunk.shape[-1], np.float32)
    frame, features = F.robot_frame(obs, action)
    if chunk is not None:
        frame[CHUNK] = np.asarray(chunk, np.float32)
        features[CHUNK] = F.vector(tuple(chunk.shape))
        frame[CHUNK_NEW] = bool(chunk_new)
        features[CHUNK_NEW] = F.scalar("bool")
        frame[CHUNK_AGE] = np.float32(t_obs - chunk_t_obs)
        features[CHUNK_AGE] = F.scalar("float32")
    frame[FAULT] = bool(faulted)
    features[FAULT] = F.scalar("bool")
    frame[F.INTERVENTION] = bool(estop)  # an operator's e-stop took the robot from the policy
    features.update(F.EXTRA_FEATURES)
    return frame, features


# --------------------------------------------------------------------------------------------
# The daemon
# --------------------------------------------------------------------------------------------


class Daemon:
    """Supervisor of the control node, the policy worker and the episode writer."""

    def __init__(self, cfg: DeployConfig, log: EventLog | None = None, workdir: str | None = None):
        self.cfg = cfg
        self.log = log or EventLog(cfg.log_file)
        self.notify = Notifier()
        self.workdir = workdir or tempfile.mkdtemp(prefix="robopolicy-serve-")
        self.policy = cfg.policy
        self.t_start = time.monotonic()
        self.driver = self.node = None
        self.writer: EpisodeWriter | None = None
        self.api = None
        self.connected = False
        self.ready_sent = False
        self.stopping = threading.Event()
        self.lock = threading.RLock()  # episode start/stop, policy swap, worker restart
        self.generation = 0
        self.worker_restarts = 0
        self.restart_at: float | None = None
        self.backoff = cfg.supervisor.restart_backoff_s
        self.worker_started_at = math.nan
        self.swap_in_progress = False
        self.policy_swaps = 0
        self.policy_refusals = 0
        self.last_refusal: dict | None = None
        self.fault_history: deque[dict] = deque(maxlen=200)
        self.fault_counts: dict[str, int] = {}
        self._seen_faults = 0
        self._last_fault_obj = None
        # written by the control loop's callback, read by other threads (plain references)
        self.history: deque[tuple] = deque(maxlen=int(50 * 20))  # (t, state, command) at <= 50 Hz
        self._next_hist = 0.0
        self._next_frame = 0.0
        self.last_chunk = None  # (values, t_obs, t_received)
        self._chunk_new = False
        self.last_chunk_time = math.nan
        self._sup_thread: threading.Thread | None = None
        self._watchdog_ticks = -1
        self.metrics = None

    # -- life cycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Connect the robot, start the loop and the worker, wait until warm, then serve."""
        cfg = self.cfg
        self.log("starting", robot=cfg.robot.name, driver=cfg.robot.driver.type, policy=self.policy, pid=os.getpid())
        if cfg.recording.enabled:
            # lerobot's dataset writer is imported now: importing it in the writer thread, with the
            # loop running, would hold the GIL for seconds
            import lerobot.datasets.lerobot_dataset  # noqa: F401

            self.writer = EpisodeWriter(cfg.recording, self.log, cfg.robot.driver.type)
            self.writer.open()
        run_cfg = RunConfig(robot=cfg.robot, policy=self.policy, status=False)
        self.driver, self.node = build_node(run_cfg, self.workdir)
        node = self.node
        node.timer = RingTickTimer(node.period)
        node.source = self._make_source(self.policy)
        node.on_observation = self._on_tick
        self._tap(node.source)
        from robopolicy.deploy.metrics import DaemonMetrics

        self.metrics = DaemonMetrics(self)
        if cfg.api.enabled:  # up early: /livez answers and /readyz says why it is not ready yet
            from robopolicy.deploy.api import ApiProcess

            self.api = ApiProcess(self, cfg.api)
            self.api.start()
            self.log("api_listening", host=cfg.api.host, port=self.api.port, token=cfg.api.token_file is not None)
        self.driver.connect()
        self.connected = True
        self.log("robot_connected", robot=cfg.robot.name)
        node.start()
        self.worker_started_at = time.monotonic()
        self._sup_thread = threading.Thread(target=self._supervise, name="deploy-supervisor", daemon=True)
        self._sup_thread.start()
        end = time.monotonic() + cfg.supervisor.ready_timeout_s
        while not self.ready()[0]:
            if node.fault is not None:
                raise RuntimeError(f"not ready: {node.fault.code}: {node.fault.reason}")
            if time.monotonic() > end:
                raise RuntimeError(f"not ready within {cfg.supervisor.ready_timeout_s:.0f}s: {self.ready()[1]}")
            time.sleep(0.02)
        self.notify("READY=1\nSTATUS=serving")
        self.ready_sent = True
        self.log("ready", seconds=round(time.monotonic() - self.t_start, 3))

    def shutdown(self, reason: str = "stop") -> dict:
        """Safe stop: the episode flushed, the loop stopped with the driver's safe stop, the
        worker ended, the driver disconnected, the API closed. Each step runs even if one fails."""
        self.stopping.set()
        self.notify("STOPPING=1")
        self.log("stopping", reason=reason)
        out: dict[str, Any] = {"reason": reason}
        steps = []
        if self.writer is not None:
            steps.append(("episode", lambda: self.writer.stop(None, reason, wait=120.0)))
        if self.node is not None:
            steps.append(("node", self.node.close))
        if self._sup_thread is not None:
            steps.append(("supervisor", lambda: self._sup_thread.join(2.0)))
        if self.writer is not None:
            steps.append(("writer", self.writer.close))
        if self.driver is not None and self.connected:
            steps.append(("driver", self.driver.disconnect))
        if self.api is not None:
            steps.append(("api", self.api.stop))
        for name, step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001
                out[f"{name}_error"] = repr(exc)
        self.connected = False
        if self.node is not None:
            out["driver_stopped"] = self.node.stop_commanded
            if self.cfg.report:
                report = self.node.report()
                report.update(robot=self.cfg.robot.name, policy=self.policy, shutdown=out)
                Path(self.cfg.report).parent.mkdir(parents=True, exist_ok=True)
                Path(self.cfg.report).write_text(json.dumps(report, indent=2, default=str))
        self.log("stopped", **out)
        return out

    # -- the control loop's callback: references and a non-blocking put only -----------------
    def _on_tick(self, obs: dict, t_obs: float, sent) -> None:
        if t_obs >= self._next_hist:
            self._next_hist = t_obs + 0.02
            self.history.append((t_obs, obs["observation.state"], sent))
        writer = self.writer
        if writer is not None and writer.episode is not None and t_obs >= self._next_frame:
            period = 1.0 / self.cfg.recording.fps
            self._next_frame = self._next_frame + period if t_obs - self._next_frame < period else t_obs + period
            chunk = self.last_chunk
            fault = self.node.faults.active
            writer.offer((obs, sent, None if chunk is None else chunk[0], self._chunk_new,
                          math.nan if chunk is None else chunk[1], t_obs, fault is not None,
                          fault is not None and fault.code == "estop"))
            self._chunk_new = False

    def _tap(self, source) -> None:
        """Observe the chunks the loop takes from ``source`` (for the recording and readiness)."""
        poll = source.poll

        def tapped(now: float):
            chunks = poll(now)
            if chunks:
                c = chunks[-1]
                self.last_chunk = (c.values, c.t_obs, now)
                self._chunk_new = True
                self.last_chunk_time = now
            return chunks

        source.poll = tapped

    # -- workers -------------------------------------------------------------------------------
    def _make_source(self, policy: str):
        """A worker source (not started) on a fresh ipc socket; the worker's stderr goes to a file."""
        from hardware.control import PolicyWorkerSource

        tc = self.cfg.robot.transport
        self.generation += 1
        endpoint = f"ipc://{self.workdir}/policy-{self.generation}.sock"
        errlog = Path(self.workdir) / f"worker-{self.generation}.log"
        cmd = [sys.executable, "-m", "robopolicy.deploy.worker", "--endpoint", endpoint, "--policy", policy,
               "--parent-pid", str(os.getpid())]
        if tc.auth_key_file:
            cmd += ["--auth-key-file", tc.auth_key_file]
        shell = ["/bin/sh", "-c", 'exec "$@" 2>>"$0"', str(errlog), *cmd]
        key = Path(tc.auth_key_file).read_bytes().strip() if tc.auth_key_file else None
        source = PolicyWorkerSource(endpoint, shell, key, request_hz=tc.request_hz)
        source.errlog = errlog
        return source

    def _replace_source(self, new) -> None:
        """Hand the loop a new (started) source, then close the old one once the loop has moved on."""
        self._tap(new)
        old = self.node.swap_source(new)
        try:
            old.close()
        except Exception as exc:  # noqa: BLE001
            self.log("worker_close_error", error=repr(exc))

    def _restart_worker(self) -> None:
        src = self._make_source(self.policy)
        src.start()
        self._replace_source(src)
        self.worker_restarts += 1
        self.worker_started_at = time.monotonic()
        if self.writer is not None:
            self.writer.mark("worker_restart")
        self.log("worker_restarted", generation=self.generation, restarts=self.worker_restarts,
                 backoff_s=round(self.backoff, 3))

    def swap_policy(self, spec: str) -> tuple[bool, str]:
        """Load ``spec`` in a fresh worker, check its answer to the present observation, and swap it
        in between episodes. Returns (swapped, reason)."""
        from robopolicy.deploy.worker import SCRIPTED, _parse_options

        def refuse(why: str) -> tuple[bool, str]:
            self.policy_refusals += 1
            self.last_refusal = {"policy": spec, "reason": why, "ts": time.time()}
            self.log("policy_refused", policy=spec, reason=why)
            return False, why

        problem = policy_problem(spec, SCRIPTED, _parse_options)
        if problem:
            return refuse(problem)
        with self.lock:
            if self.swap_in_progress:
                return refuse("another policy swap is in progress")
            if self.writer is not None and self.writer.episode is not None:
                return refuse("an episode is in progress: policies are swapped only between episodes")
            self.swap_in_progress = True
        src = None
        try:
            src = self._make_source(spec)
            src.start()
            chunk, why = self._probe(src)
            if chunk is None:
                src.close()
                return refuse(why)
            with self.lock:
                if self.writer is not None and self.writer.episode is not None:
                    src.close()
                    return refuse("an episode started while the policy loaded: not swapped")
                from hardware.transport.messages import Message

                src.client.send(Message("reset", 0, time.monotonic()))  # the probe's context is not the run's
                self._replace_source(src)
                old, self.policy = self.policy, spec
                self.policy_swaps += 1
                self.worker_started_at = time.monotonic()
            self.log("policy_swapped", policy=spec, previous=old, chunk_shape=list(chunk.shape))
            return True, "swapped"
        except Exception as exc:  # noqa: BLE001
            if src is not None:
                src.close()
            return refuse(f"{type(exc).__name__}: {exc}"[:500])
        finally:
            self.swap_in_progress = False

    def _probe(self, src) -> tuple[np.ndarray | None, str]:
        """Send the robot's latest observation until the new worker answers; check the answer."""
        node = self.node
        end = time.monotonic() + self.cfg.supervisor.swap_timeout_s
        spec = self.driver.spec
        while time.monotonic() < end:
            code = src.proc.poll() if src.proc is not None else None
            if code is not None:
                return None, f"the worker could not load it: {src.health(time.monotonic())}; {_tail(src.errlog)}"
            obs = node.last_obs
            now = time.monotonic()
            if obs is not None and src.wants_observation(now):
                src.submit(obs, now)
            for chunk in src.poll(time.monotonic()):
                v = chunk.values
                if spec.kind == "arm" and (chunk.kind != "action" or v.shape[-1] != spec.dim):
                    return None, f"it answers {chunk.kind} of shape {tuple(v.shape)}; this arm takes ({spec.dim},) actions"
                if spec.kind == "base" and (chunk.kind != "waypoints" or v.shape[-1] != 3):
                    return None, f"it answers {chunk.kind} of shape {tuple(v.shape)}; this base follows (K, 3) waypoints"
                if not np.all(np.isfinite(v)):
                    return None, "its chunk holds non-finite values"
                return v, "ok"
            if src.errors and src.last_error:
                return None, f"the worker failed on the robot's observation: {src.last_error}"
            time.sleep(0.01)
        return None, f"no answer within {self.cfg.supervisor.swap_timeout_s:.0f}s"

    # -- operator actions ----------------------------------------------------------------------
    def start_episode(self, task: str | None = None) -> tuple[bool, dict | str]:
        if self.writer is None:
            return False, "recording is disabled (recording.enabled: false)"
        with self.lock:
            ok, why = self.ready()
            if not ok:
                return False, f"not ready: {why}"
            if self.swap_in_progress:
                return False, "a policy swap is in progress"
            if self.writer.episode is not None:
                return False, f"episode {self.writer.episode['id']} is already in progress"
            task = task or self.cfg.recording.task or getattr(self.driver, "instruction", "") or self.cfg.robot.name
            self._next_frame = 0.0
            info = self.writer.start(task, self.policy)
        self.log("episode_started", id=info["id"], task=task, policy=self.policy, recorded=info["recorded"],
                 paused_reason=info["paused_reason"])
        return True, dict(info)

    def stop_episode(self, success: bool | None = None, wait: float = 120.0) -> tuple[bool, dict | str]:
        if self.writer is None:
            return False, "recording is disabled (recording.enabled: false)"
        with self.lock:
            info = self.writer.stop(success, "api", wait=None)
        if info is None:
            return False, "no episode in progress"
        self.log("episode_stopped", id=info["id"], frames=info["frames"])
        ev = self.writer._results.get(info["id"])
        if ev is not None and wait:
            ev.wait(wait)
        return True, self.writer.last_episode if (self.writer.last_episode or {}).get("id") == info["id"] else dict(info)

    def estop(self, reason: str = "api") -> None:
        self.node.estop(reason)
        self.log("estop", reason=reason)

    def reset_faults(self) -> tuple[bool, str]:
        fault = self.node.fault
        if fault is None:
            return False, "no fault latched"
        src = self.node.source
        if src.proc is not None and src.proc.poll() is not None:
            return False, "the policy worker is down (a restart is pending): reset refused"
        # node.reset() restarts the source's silence clock: while a fault is latched the worker is
        # sent nothing and answers nothing, which must not count as silence afterwards
        self.node.reset()
        self._last_fault_obj = None
        self.log("fault_reset", code=fault.code)
        return True, f"cleared {fault.code}"

    # -- health --------------------------------------------------------------------------------
    _UNREAD = object()

    def ready(self, fault: Any = _UNREAD) -> tuple[bool, str]:
        """(ready, why not): robot connected, loop ticking, no fault, worker alive and answering.
        ``fault``: the latched fault as the caller already read it (one consistent status)."""
        node = self.node
        if node is None or not self.connected:
            return False, "robot not connected"
        if self.stopping.is_set():
            return False, "stopping"
        if fault is Daemon._UNREAD:
            fault = node.faults.active
        if fault is not None:
            return False, f"fault latched: {fault.code}: {fault.reason}"
        if not self._loop_alive():
            return False, "control loop not ticking"
        src = node.source
        if src.proc is None or src.proc.poll() is not None:
            return False, "policy worker not running"
        age = time.monotonic() - self.last_chunk_time
        if not age < max(1.0, 2 * node.command_timeout):
            return False, "policy not answering (no chunk yet)" if math.isnan(age) else f"no chunk for {age:.2f}s"
        return True, "ready"

    def _loop_alive(self) -> bool:
        t = getattr(self.node.timer, "last_start", math.nan)
        return bool(time.monotonic() - t < self.cfg.supervisor.stale_tick_s)

    def _supervise(self) -> None:
        sup = self.cfg.supervisor
        last_ping = 0.0
        while not self.stopping.is_set():
            time.sleep(sup.period_s)
            try:
                self._supervise_once()
                self.metrics.sample()
            except Exception as exc:  # noqa: BLE001 - keep supervising
                self.log("supervisor_error", error=f"{type(exc).__name__}: {exc}"[:500])
            now = time.monotonic()
            ticks = self.node.timer.n
            if ticks > self._watchdog_ticks and self._loop_alive() and now - last_ping > 0.5:
                self._watchdog_ticks = ticks
                last_ping = now
                self.notify("WATCHDOG=1")

    def _supervise_once(self) -> None:
        if self.stopping.is_set():  # the shutdown ends the worker itself
            return
        node, sup = self.node, self.cfg.supervisor
        history = node.faults.history
        while self._seen_faults < len(history):
            f = history[self._seen_faults]
            self._seen_faults += 1
            self.fault_counts[f.code] = self.fault_counts.get(f.code, 0) + 1
            entry = {"code": f.code, "reason": f.reason, "ts": time.time() - (time.monotonic() - f.t),
                     "stop_latency_s": f.stop_latency}
            self.fault_history.append(entry)
            self.log("fault", **entry)
            if self.writer is not None:
                self.writer.mark("fault", **entry)
        src = node.source
        now = time.monotonic()
        dead = src.proc is not None and src.proc.poll() is not None
        if dead and not self.swap_in_progress:
            if self.restart_at is None:
                if now - self.worker_started_at > sup.healthy_after_s:
                    self.backoff = sup.restart_backoff_s
                self.restart_at = now + self.backoff
                self.log("worker_died", status=src.health(now), restart_in_s=round(self.backoff, 3),
                         stderr=_tail(getattr(src, "errlog", None)))
            elif now >= self.restart_at:
                with self.lock:
                    self._restart_worker()
                self.restart_at = None
                self.backoff = min(self.backoff * 2, sup.restart_backoff_max_s)
        writer = self.writer
        if writer is not None and writer.episode is not None:
            if time.time() - writer.episode["started"] > self.cfg.recording.max_episode_s:
                info = writer.stop(None, "max_episode_s")
                self.log("episode_stopped", id=info["id"], reason="max_episode_s")

    def status(self) -> dict:
        node = self.node
        fault = node.faults.active if node is not None else None
        ok, why = self.ready(fault)
        out: dict[str, Any] = {
            "robot": self.cfg.robot.name, "kind": self.driver.spec.kind if self.driver else None,
            "policy": self.policy, "ready": ok, "why": why, "uptime_s": time.monotonic() - self.t_start,
            "connected": self.connected, "worker_restarts": self.worker_restarts, "policy_swaps": self.policy_swaps,
            "policy_refusals": self.policy_refusals, "last_refusal": self.last_refusal,
            "fault_counts": dict(self.fault_counts), "fault_history": list(self.fault_history)[-20:],
            "systemd": {"notify": self.notify.enabled, "ready_sent": self.ready_sent},
        }
        if node is not None:
            s = node.status()
            s["fault"] = None if fault is None else {"code": fault.code, "reason": fault.reason}
            out["node"] = s
            out["names"] = list(self.driver.spec.names)
            obs = node.last_obs
            out["state"] = None if obs is None else np.asarray(obs["observation.state"]).round(5).tolist()
            out["command"] = None if node.last_command is None else np.asarray(node.last_command).round(5).tolist()
            out["cameras"] = [] if obs is None else [k.rsplit(".", 1)[1] for k in obs if k.startswith("observation.images.")]
        out["recording"] = self.writer.status() if self.writer is not None else {"enabled": False}
        return out

    def timing(self, ticks: int = 500) -> dict:
        """Loop lateness percentiles (us) over the last ``ticks`` ticks."""
        node = self.node
        if node is None:
            return {"ticks_total": 0, "window": 0, "missed": 0, "lateness_us": None}
        late = node.timer.recent(max(1, min(int(ticks), 65536))) * 1e6
        if not len(late):
            return {"ticks_total": node.timer.n, "window": 0, "missed": node.timer.missed, "lateness_us": None}
        return {"ticks_total": node.timer.n, "window": int(len(late)), "missed": node.timer.missed,
                "lateness_us": {"p50": float(np.percentile(late, 50)), "p99": float(np.percentile(late, 99)),
                                "max": float(late.max())}}

    def history_since(self, seconds: float) -> dict:
        items = list(self.history)
        if not items:
            return {"t": [], "state": [], "command": []}
        t_end = items[-1][0]
        items = [it for it in items if it[0] >= t_end - seconds]
        return {"t": [round(it[0] - t_end, 4) for it in items],
                "state": [np.asarray(it[1]).round(4).tolist() for it in items],
                "command": [None if it[2] is None else np.asarray(it[2]).round(4).tolist() for it in items]}


def _tail(path: Path | None, lines: int = 5) -> str:
    if path is None or not Path(path).is_file():
        return ""
    text = Path(path).read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:])[-800:]


# --------------------------------------------------------------------------------------------
# The process
# --------------------------------------------------------------------------------------------

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def serve(cfg: DeployConfig, duration: float | None = None) -> int:
    """Run the daemon until SIGTERM / SIGINT / SIGHUP (or ``duration``); returns the exit code:
    0 after a clean stop, 1 when it could not start."""
    log = EventLog(cfg.log_file)
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum, frame):
        received.append(signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    daemon = Daemon(cfg, log)
    code = 0
    try:
        try:
            daemon.start()
        except Exception as exc:  # noqa: BLE001
            log("start_failed", error=f"{type(exc).__name__}: {exc}"[:800])
            code = 1
        if code == 0:
            stop.wait(duration)
    finally:
        daemon.shutdown(received[0] if received else ("start_failed" if code else "duration"))
        for s, h in previous.items():
            signal.signal(s, h)
        log.close()
        shutil.rmtree(daemon.workdir, ignore_errors=True)
    return code
