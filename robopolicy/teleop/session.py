"""``robopolicy teleop``: an operator drives a robot through the control node and records episodes.

The device (:mod:`hardware.teleop`) is the node's action source at the node's rate, behind the
robot's safety filter. Frames are taken from the node's observations at the dataset's ``fps``
and written by :class:`~robopolicy.data.recorder.EpisodeRecorder` (LeRobot v3, one atomic commit
per episode), with lerobot-record's episode controls: an episode ends after ``episode_s`` or
on ``save`` and is committed; ``rerecord`` drops it and records it again; ``discard`` drops it;
``stop`` ends the session; a reset period of ``reset_s`` (the operator still drives, nothing is
recorded) separates episodes. ``success`` / ``failure`` mark the episode good / bad (stored as its
``robopolicy/rating`` and ``robopolicy/success``; training filters on it with ``data.rating``).
From a terminal the same controls are keys + Enter (s, r, d, q).

With ``policy`` set (``robopolicy teleop --checkpoint DIR``) the policy drives and the operator
takes over with the device's button (HG-DAgger interventions): frames carry ``intervention``
and the policy's proposal ``policy.action`` beside the executed ``action``.

A device that disconnects, any fault, or a recording that cannot be written (a full disk) stops
the robot (the node's safe stop), discards the episode in progress and ends the session, saying
why; the committed episodes stay.
"""

from __future__ import annotations

import math
import select
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from robopolicy.config import ConfigError
from robopolicy.deploy.run import RobotConfig, RunConfig
from robopolicy.teleop.ratings import rating_column

POLICY_ACTION = "policy.action"  # float32 (A,): what the policy proposed when the operator drove


@dataclass
class DeviceConfig:
    """The teleoperator: a :func:`hardware.teleop.make_teleop` type and its keyword arguments,
    how often it is read, and the adapter to the robot's action space (see
    :class:`hardware.teleop.ActionAdapter`: mode, keys, scale, offset, step, gripper_step, ...)."""

    type: str = "keyboard"
    kwargs: dict = field(default_factory=dict)
    rate_hz: float = 30.0
    adapter: dict = field(default_factory=dict)
    max_speed: float | None = None  # command units/s on hand-overs; default: the safety step limit × rate


@dataclass
class TeleopConfig:
    """``robopolicy teleop``: a robot, a device, a dataset, the episode schedule."""

    robot: RobotConfig = field(default_factory=RobotConfig)
    teleop: DeviceConfig = field(default_factory=DeviceConfig)
    dataset: str = "outputs/teleop/dataset"
    task: str = ""
    fps: int = 30
    episodes: int = 10
    episode_s: float = 30.0
    reset_s: float = 5.0
    resume: bool = False
    policy: str | None = None  # a checkpoint or scripted policy to take over from (interventions)
    status: bool = True
    vcodec: str = "libsvtav1"


@dataclass
class SessionResult:
    """How a session ended: committed episodes, frames, and why it stopped."""

    episodes: list[int] = field(default_factory=list)
    frames: int = 0
    discarded: int = 0
    rerecorded: int = 0
    interventions: int = 0
    intervention_frames: int = 0
    stopped_by: str = "done"
    fault: str | None = None
    wall_s: float = 0.0

    def line(self) -> str:
        return (f"{len(self.episodes)} episode(s) committed, {self.frames} frames "
                f"({self.intervention_frames} under intervention), {self.rerecorded} re-recorded, "
                f"{self.discarded} discarded, {self.wall_s:.1f}s; stopped by {self.stopped_by}"
                + (f": {self.fault}" if self.fault else ""))


def build_frame(obs: dict, sent: np.ndarray | None, intervening: bool, proposal: np.ndarray | None,
                with_policy: bool) -> tuple[dict, dict]:
    """One dataset frame and its feature declarations (``action`` = the command sent)."""
    from robopolicy.data import features as F

    state = np.asarray(obs[F.STATE], np.float32)
    frame, features = F.robot_frame(obs, state.copy() if sent is None else sent)
    action = frame[F.ACTION]
    frame[F.INTERVENTION] = bool(intervening)
    if with_policy:
        frame[POLICY_ACTION] = action.copy() if proposal is None else np.asarray(proposal, np.float32)
        features[POLICY_ACTION] = F.vector(action.shape[0])
    features.update(F.EXTRA_FEATURES)
    return frame, features


def _max_speed(cfg: TeleopConfig, spec, rate: float) -> float | np.ndarray:
    if cfg.teleop.max_speed is not None:
        return float(cfg.teleop.max_speed)
    speed = np.full(spec.dim, np.inf)
    if cfg.robot.safety.max_step is not None:
        speed = np.minimum(speed, float(cfg.robot.safety.max_step) * rate)
    if spec.max_rate is not None:
        speed = np.minimum(speed, spec.max_rate)
    return speed


def build_session(cfg: TeleopConfig, device=None):
    """(driver, node, source) ready to start; ``device`` overrides the configured one (tests)."""
    from hardware.control import ActionScheduler
    from hardware.teleop import ActionAdapter, TeleopError, TeleopSource, make_teleop
    from robopolicy.deploy.run import build_node

    driver, node = build_node(RunConfig(robot=cfg.robot, policy=cfg.policy or "hold"))
    try:
        device = device if device is not None else make_teleop(cfg.teleop.type, **cfg.teleop.kwargs)
        adapter = ActionAdapter(driver.spec, **cfg.teleop.adapter)
    except TypeError as exc:
        raise ConfigError(f"teleop.kwargs / teleop.adapter: {exc}") from None
    except TeleopError as exc:
        raise ConfigError(f"teleop: {exc}") from None
    source = TeleopSource(device, adapter, cfg.teleop.rate_hz, _max_speed(cfg, driver.spec, node.rate),
                          policy=node.source if cfg.policy else None)
    # the newest chunk alone commands: an ensemble would keep voting for the policy's older chunks
    node.source, node.scheduler = source, ActionScheduler("latest")
    return driver, node, source


class _FrameTap:
    """The node's observation callback: keeps one frame per ``1/fps`` for the recording loop.
    Runs in the control loop: it copies references and small arrays, nothing more."""

    def __init__(self, source, fps: int, with_policy: bool):
        self.source, self.period, self.with_policy = source, 1.0 / fps, with_policy
        self.frames: deque = deque()
        self.next_t = -math.inf

    def __call__(self, obs: dict, t_obs: float, sent: np.ndarray | None) -> None:
        if t_obs < self.next_t:
            return
        self.next_t = t_obs + self.period if not math.isfinite(self.next_t) else max(self.next_t + self.period, t_obs)
        prop = self.source.proposal(t_obs) if self.with_policy else None
        copy = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in obs.items()}
        self.frames.append((t_obs, copy, None if sent is None else np.array(sent), self.source.intervening, prop))


def _stdin_events() -> list[str]:
    keys = {"s": "save", "r": "rerecord", "d": "discard", "q": "stop", "g": "success", "b": "failure"}
    if not sys.stdin.isatty() or not select.select([sys.stdin], [], [], 0)[0]:
        return []
    key = sys.stdin.readline().strip().lower()
    return [(keys[key], time.monotonic())] if key in keys else []


class _Schedule:
    """The episode state machine, run on the frames' own times (the recording loop may lag the
    robot: an event ends the episode at the frame it was given at, not when it is handled)."""

    def __init__(self, cfg: TeleopConfig, result: SessionResult, say: Callable[[str], None]):
        self.cfg, self.result, self.say = cfg, result, say
        self.recorder = None
        self.phase, self.phase_end = "episode", math.inf  # the first frame starts the clock
        self.frames, self.mark, self.was_intervening, self.done = 0, None, False, False

    def event(self, name: str, t: float) -> None:
        if name in ("success", "failure"):
            self.mark = name == "success"
        elif name == "stop":
            self.result.stopped_by = "operator (stop)"
            self.done = True
        elif self.phase == "episode" and name in ("save", "rerecord", "discard"):
            self.end_episode(name, t)
        elif self.phase == "reset" and name == "save":
            self.phase_end = t  # skip the rest of the reset

    def end_episode(self, how: str, t: float) -> None:
        r = self.result
        if how == "save" and self.frames > 0:
            summary = self.recorder.save_episode(success=self.mark, metadata=rating_column(self.mark))
            r.episodes.append(summary.episode_index)
            r.frames += summary.frames
            self.say(f"[teleop] episode {summary.episode_index} saved: {summary.frames} frames"
                     + ("" if self.mark is None else f", marked {'good' if self.mark else 'bad'}"))
        elif self.recorder is not None:
            self.recorder.discard_episode()
            if how == "rerecord":
                r.rerecorded += 1
                self.say("[teleop] episode dropped: re-recording it")
            else:
                r.discarded += 1
                self.say("[teleop] episode discarded")
        self.frames, self.mark = 0, None
        if len(r.episodes) >= self.cfg.episodes:
            r.stopped_by, self.done = "done", True
        self.phase, self.phase_end = "reset", t + self.cfg.reset_s

    def frame(self, t: float, obs: dict, sent, intervening: bool, proposal) -> None:
        from robopolicy.data.recorder import EpisodeRecorder

        cfg = self.cfg
        if self.phase == "episode" and t >= self.phase_end:
            self.end_episode("save", self.phase_end)
        if self.done:
            return
        if self.phase == "reset":
            if t < self.phase_end:
                return
            self.phase, self.phase_end = "episode", t + cfg.episode_s
        if not math.isfinite(self.phase_end):
            self.phase_end = t + cfg.episode_s
        frame, features = build_frame(obs, sent, intervening, proposal, cfg.policy is not None)
        if self.recorder is None:
            self.recorder = EpisodeRecorder(cfg.dataset, features, cfg.fps, robot_type=cfg.robot.name,
                                            resume=cfg.resume, vcodec=cfg.vcodec)
        self.recorder.add_frame(frame, task=cfg.task)
        self.frames += 1
        self.result.intervention_frames += int(intervening)
        self.result.interventions += int(intervening and not self.was_intervening)
        self.was_intervening = intervening


def record_session(cfg: TeleopConfig, device=None, on_status: Callable[[str], None] | None = None,
                   stop_event: threading.Event | None = None) -> SessionResult:
    """Run a recording session; returns its :class:`SessionResult` (see the module docstring)."""
    from hardware.teleop import TeleopError

    if not cfg.task:
        raise ConfigError("teleop: --task (the instruction the episodes are recorded for) is empty")
    driver, node, source = build_session(cfg, device)
    say = on_status or (lambda line: print(line, flush=True))
    try:
        source.device.connect()  # before the robot moves: a missing display or device is an error, not a fault
    except TeleopError as exc:
        raise ConfigError(f"teleop: {exc}") from None
    import robopolicy.data.recorder  # noqa: F401  (lerobot's dataset stack loads in seconds: not with the robot moving)

    if getattr(source.device, "url", None):
        say(f"[teleop] the teleop page: {source.device.url}")
    tap = _FrameTap(source, cfg.fps, cfg.policy is not None)
    node.on_observation = tap
    result = SessionResult()
    sched = _Schedule(cfg, result, say)
    events: deque = deque()
    t0 = last_status = time.monotonic()
    try:
        driver.connect()
        node.start()
        while not sched.done:
            if stop_event is not None and stop_event.is_set():
                result.stopped_by = "stop request"
                break
            fault = node.fault
            events.extend(source.take_events() + _stdin_events())
            for _ in range(len(tap.frames)):  # the frames there now; the loop comes back for more
                t, obs, sent, intervening, prop = tap.frames.popleft()
                while events and events[0][1] <= t and not sched.done:
                    sched.event(*events.popleft())
                if sched.done:
                    break
                sched.frame(t, obs, sent, intervening, prop)
                if time.monotonic() - last_status > 0.5:
                    break  # keep the status line and the fault check alive while lagging
            if not tap.frames:
                while events and not sched.done:
                    sched.event(*events.popleft())
            if fault is not None and not tap.frames:
                result.stopped_by, result.fault = "fault", f"{fault.code}: {fault.reason}"
                break
            now = time.monotonic()
            if now - last_status >= 0.5:
                last_status = now
                line = (f"[teleop] {sched.phase} | episodes {len(result.episodes)}/{cfg.episodes} | frames {sched.frames} "
                        f"| {now - t0:.0f}s | {'operator' if source.operator_driving else 'policy'} drives | "
                        f"behind {len(tap.frames)} frames | clamps {sum(node.safety.counts.values())}")
                if hasattr(source.device, "status"):
                    source.device.status(line)  # the web page shows it
                if cfg.status:
                    say(line)
            time.sleep(0.005)
    except KeyboardInterrupt:
        result.stopped_by = "interrupt"
    except OSError as exc:  # a full disk, a dataset directory gone: the robot stops, committed episodes stay
        result.stopped_by, result.fault = "recording error", f"writing {cfg.dataset} failed: {exc}"
    finally:
        node.close()  # the safe stop, the device and the policy closed
        if sched.recorder is not None:
            sched.recorder.close()  # an episode in progress is dropped; committed ones stay
        try:
            driver.disconnect()
        except Exception as exc:  # noqa: BLE001
            say(f"[teleop] driver disconnect raised {exc!r}")
    result.wall_s = time.monotonic() - t0
    if result.fault:
        say(f"[teleop] stopped: {result.fault}. The robot was commanded to its safe stop; "
            f"{len(result.episodes)} committed episode(s) in {cfg.dataset} are kept, the episode in progress was dropped.")
    say(f"[teleop] {result.line()}")
    return result
