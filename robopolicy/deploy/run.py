"""``robopolicy run``: a robot (sim or real) driven by a policy worker through the control node.

Builds the driver, the scheduler (chunks for an arm, waypoints for a base), the safety filter
and the policy worker process from a :class:`RunConfig`, runs the loop with a live status line,
and writes a JSON timing report at exit. Keys while running (stdin): ``e`` + Enter = e-stop,
``r`` + Enter = reset the latched fault, ``q`` + Enter = quit. SIGUSR1 = e-stop.

Every way out (the duration, ``q``, SIGINT, SIGTERM, SIGHUP, an exception) takes the same path:
the loop stops and commands the driver's safe stop, the worker is ended, the driver is
disconnected and the report is written. A signal that arrives while that path runs (a second
Ctrl-C, systemd's SIGTERM after SIGINT) is noted in the report, never allowed to cut it short.
The exit code (:func:`exit_code`) says how the run ended: 128 + the signal's number (130 SIGINT,
143 SIGTERM, 129 SIGHUP), 3 with a fault latched at the end, 0 otherwise.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from robopolicy.utils.files import atomic_write_text
from robopolicy.config import ConfigError, to_dict


@dataclass
class DriverConfig:
    """Which driver and its keyword arguments (see hardware.drivers.make_driver)."""

    type: str = "sim_arm"  # sim_arm | sim_base | lerobot
    kwargs: dict = field(default_factory=dict)


@dataclass
class SchedulerConfig:
    blend: str = "ensemble"  # ensemble | rtc | latest (arm chunks)
    ensemble_k: float = 0.01
    crossfade: float = 0.1  # seconds (rtc)
    lookahead: float = 0.4  # metres (base waypoint follower)


@dataclass
class SafetyConfig:
    max_step: float | None = None  # largest change of any command value per tick
    workspace_low: list[float] | None = None  # tool-centre-point box (arm, needs forward kinematics)
    workspace_high: list[float] | None = None
    fault_spans: float | None = 3.0  # a command this many spans beyond its bounds is a fault (None: clamp all)


@dataclass
class TransportConfig:
    endpoint: str | None = None  # None: a private ipc socket; tcp://HOST:PORT for a remote worker
    auth_key_file: str | None = None  # shared key (CURVE); required for every tcp:// endpoint
    insecure_loopback: bool = False  # allow tcp://127.0.0.1 without a key (any local user can connect)
    encrypt: bool | None = None  # CURVE-encrypt messages; None: across a network only (see hardware.transport)
    spawn_worker: bool = True  # False: connect to a worker started elsewhere
    request_hz: float = 20.0  # observations sent to the worker per second (at most)


@dataclass
class LoopConfig:
    rate_hz: float | None = None  # default: the driver's (500 arm, 50 base)
    command_timeout: float | None = None  # default: the driver's
    startup_timeout: float = 120.0
    driver_timeout: float = 0.05
    spin_us: float = 300.0
    fifo: bool = True
    fifo_priority: int = 50
    cpus: list[int] | None = None


@dataclass
class RobotConfig:
    """One robot: ``configs/robots/*.yaml``."""

    name: str = "sim_arm"
    driver: DriverConfig = field(default_factory=DriverConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)


@dataclass
class RunConfig:
    """``robopolicy run``: a robot config, a policy, how long, where the report goes."""

    robot: RobotConfig = field(default_factory=RobotConfig)
    policy: str = "hold"  # checkpoint directory or scripted spec (hold, sine, arc, replay:FILE)
    duration: float | None = None  # seconds; None = until q / Ctrl-C
    report: str = "outputs/run/timing.json"
    status: bool = True  # live status line


def build_node(cfg: RunConfig, workdir: str | None = None):
    """(driver, node) ready to start: the driver is constructed but not yet connected."""
    import numpy as np

    from hardware.control import ActionScheduler, ControlNode, NodeConfig, PolicyWorkerSource, SafetyFilter, WaypointFollower
    from hardware.drivers import make_driver

    rc = cfg.robot
    driver = make_driver(rc.driver.type, **rc.driver.kwargs)
    spec = driver.spec
    rate = rc.loop.rate_hz or spec.rate_hz
    if spec.kind == "base":
        scheduler = WaypointFollower(v_max=float(spec.command_high[0]), omega_max=float(spec.command_high[1]),
                                     lookahead=rc.scheduler.lookahead)
    else:
        scheduler = ActionScheduler(rc.scheduler.blend, rc.scheduler.ensemble_k, rc.scheduler.crossfade)
    ws_fn = getattr(driver, "tool_position", None) if rc.safety.workspace_low is not None else None
    if rc.safety.workspace_low is not None and ws_fn is None:
        raise ConfigError(f"{rc.name}: a workspace box needs a driver with forward kinematics (tool_position)")
    safety = SafetyFilter(spec, 1.0 / rate, rc.safety.max_step,
                          None if rc.safety.workspace_low is None else np.asarray(rc.safety.workspace_low),
                          None if rc.safety.workspace_high is None else np.asarray(rc.safety.workspace_high), ws_fn,
                          fault_spans=rc.safety.fault_spans)
    tc = rc.transport
    key = Path(tc.auth_key_file).read_bytes().strip() if tc.auth_key_file else None
    endpoint = tc.endpoint or f"ipc://{workdir or tempfile.mkdtemp(prefix='robopolicy-')}/policy.sock"
    from hardware.transport import TransportError, check_bind

    try:
        check_bind(endpoint, key, tc.insecure_loopback)
    except TransportError as exc:
        raise ConfigError(f"{rc.name}: robot.transport.endpoint: {exc} (robot.transport.auth_key_file, "
                          f"robot.transport.insecure_loopback)") from None
    command = None
    if tc.spawn_worker:
        command = [sys.executable, "-m", "robopolicy.deploy.worker", "--endpoint", endpoint,
                   "--policy", cfg.policy, "--parent-pid", str(os.getpid())]
        if tc.auth_key_file:
            command += ["--auth-key-file", tc.auth_key_file]
        if tc.insecure_loopback:
            command += ["--insecure-loopback"]
        if tc.encrypt:
            command += ["--encrypt"]
    source = PolicyWorkerSource(endpoint, command, key, request_hz=tc.request_hz, insecure_loopback=tc.insecure_loopback,
                                encrypt=tc.encrypt)
    lc = rc.loop
    node_cfg = NodeConfig(rate_hz=rate, command_timeout=lc.command_timeout, startup_timeout=lc.startup_timeout,
                          driver_timeout=lc.driver_timeout, spin=lc.spin_us * 1e-6, fifo=lc.fifo,
                          fifo_priority=lc.fifo_priority, cpus=lc.cpus)
    return driver, ControlNode(driver, source, scheduler, safety, node_cfg)


def format_status(s: dict[str, Any]) -> str:
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    return (f"[run] {s['ticks']:>7} ticks @ {s['rate_hz']:.0f} Hz | p99 late {num(s['p99_lateness_us'], '6.0f')} us "
            f"| missed {s['missed']} | infer {num(s['infer_ms'], '.1f')} ms | rtt {num(s['round_trip_ms'], '.1f')} ms "
            f"| chunk age {num(s['chunk_age_ms'], '.0f')} ms | clamps {s['clamps']} | fault {s['fault'] or 'none'}")


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
FAULT_EXIT = 3  # a run that ended with a latched fault


class Interrupted(BaseException):
    """Raised in the main thread by the first stop signal (a BaseException, like KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP all end the run through the same shutdown path.

    A signal is always recorded. The first one raises :class:`Interrupted` only while the main
    loop has ``armed`` the handler (its sleep); anywhere else the loop sees ``first`` at its next
    check. So no signal, first or later, can interrupt the safe stop, the driver's disconnect or
    the report. The previous handlers come back on :meth:`restore`.
    """

    def __init__(self) -> None:
        self.received: list[tuple[str, float]] = []  # (signal name, time.monotonic())
        self.first: int | None = None
        self.armed = False
        self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received.append((signal.Signals(signum).name, time.monotonic()))
        if self.first is None:
            self.first = signum
            if self.armed:
                self.armed = False
                raise Interrupted(signum)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def exit_code(report: dict[str, Any]) -> int:
    """128 + signal number when a signal ended the run, 3 with a latched fault, else 0."""
    signum = (report.get("shutdown") or {}).get("signum")
    if signum:
        return 128 + int(signum)
    return FAULT_EXIT if report.get("active_fault") else 0


def run(cfg: RunConfig) -> dict[str, Any]:
    """Run until the duration ends (q, a stop signal or an exception); returns the report (also
    written to cfg.report). An exception is re-raised after the shutdown and the report."""
    driver, node = build_node(cfg)
    signals = StopSignals()
    signal.signal(signal.SIGUSR1, lambda *_: node.estop("SIGUSR1"))
    tty = sys.stdin.isatty()
    t_start = time.monotonic()
    error: BaseException | None = None
    shutdown: dict[str, Any] = {"cause": "duration"}
    info: dict[str, Any] = {}
    try:
        driver.connect()
        node.start()
        end = t_start + cfg.duration if cfg.duration else float("inf")
        while time.monotonic() < end and signals.first is None:
            signals.armed = True
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
            signals.armed = False
            if cfg.status:
                line = format_status(node.status())
                print(("\r" + line) if tty else line, end="" if tty else "\n", flush=True)
            if tty and select.select([sys.stdin], [], [], 0)[0]:
                key = sys.stdin.readline().strip().lower()
                if key == "e":
                    node.estop("key")
                elif key == "r":
                    node.reset()
                elif key == "q":
                    shutdown["cause"] = "quit"
                    break
    except Interrupted:
        pass
    except BaseException as exc:  # noqa: BLE001 - the robot is stopped whatever went wrong
        error = exc
        shutdown.update(cause="exception", error=f"{type(exc).__name__}: {exc}"[:500])
    finally:
        signals.armed = False
        t_close = time.monotonic()
        shutdown.update(_close(node, driver))
        if signals.first is not None and signals.received:
            shutdown["signal_to_stop_s"] = shutdown.get("stopped_at", t_close) - signals.received[0][1]
        info = shutdown.pop("task", {})
    if signals.first is not None and error is None:
        shutdown.update(cause="signal", signal=signal.Signals(signals.first).name, signum=int(signals.first))
    if tty and cfg.status:
        print()
    report = node.report()
    shutdown["signals"] = [name for name, _ in signals.received]
    shutdown.pop("stopped_at", None)
    report.update({"robot": cfg.robot.name, "policy": cfg.policy, "wall_s": time.monotonic() - t_start,
                   "task": info, "shutdown": shutdown, "config": to_dict(cfg)})
    report["exit_code"] = exit_code(report)
    atomic_write_text(cfg.report, json.dumps(report, indent=2, default=str))
    signals.restore()
    if error is not None:
        raise error
    return report


def _close(node, driver) -> dict[str, Any]:
    """The one shutdown path: safe stop (in the loop's last tick or right after it), the worker
    ended, the driver disconnected. Each step runs even if an earlier one raised."""
    out: dict[str, Any] = {}
    try:
        node.close()
        out["driver_stopped"] = node.stop_commanded
        out["stopped_at"] = node.close_stop_time or node.stop_time
    except Exception as exc:  # noqa: BLE001
        out["close_error"] = repr(exc)
        try:
            driver.stop()
            out["driver_stopped"] = True
        except Exception as exc2:  # noqa: BLE001
            out["stop_error"] = repr(exc2)
    try:
        task = getattr(driver, "task_info", None)
        out["task"] = task() if task is not None else {}
    except Exception as exc:  # noqa: BLE001
        out["task"] = {"error": repr(exc)}
    try:
        driver.disconnect()
        out["driver_disconnected"] = True
    except Exception as exc:  # noqa: BLE001
        out["disconnect_error"] = repr(exc)
    return out
