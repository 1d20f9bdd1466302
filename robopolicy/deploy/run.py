"""``robopolicy run``: a robot (sim or real) driven by a policy worker through the control node.

Builds the driver, the scheduler (chunks for an arm, waypoints for a base), the safety filter
and the policy worker process from a :class:`RunConfig`, runs the loop with a live status line,
and writes a JSON timing report at exit. Keys while running (stdin): ``e`` + Enter = e-stop,
``r`` + Enter = reset the latched fault, ``q`` + Enter = quit. SIGUSR1 = e-stop.
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


@dataclass
class TransportConfig:
    endpoint: str | None = None  # None: a private ipc socket; tcp://HOST:PORT for a remote worker
    auth_key_file: str | None = None  # required for a non-loopback endpoint
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
                          None if rc.safety.workspace_high is None else np.asarray(rc.safety.workspace_high), ws_fn)
    tc = rc.transport
    key = Path(tc.auth_key_file).read_bytes().strip() if tc.auth_key_file else None
    endpoint = tc.endpoint or f"ipc://{workdir or tempfile.mkdtemp(prefix='robopolicy-')}/policy.sock"
    command = None
    if tc.spawn_worker:
        command = [sys.executable, "-m", "robopolicy.deploy.worker", "--endpoint", endpoint,
                   "--policy", cfg.policy, "--parent-pid", str(os.getpid())]
        if tc.auth_key_file:
            command += ["--auth-key-file", tc.auth_key_file]
    source = PolicyWorkerSource(endpoint, command, key, request_hz=tc.request_hz)
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


def run(cfg: RunConfig) -> dict[str, Any]:
    """Run until the duration ends (or q / Ctrl-C); returns the report (also written to cfg.report)."""
    driver, node = build_node(cfg)
    signal.signal(signal.SIGUSR1, lambda *_: node.estop("SIGUSR1"))
    driver.connect()
    tty = sys.stdin.isatty()
    t_start = time.monotonic()
    try:
        node.start()
        end = t_start + cfg.duration if cfg.duration else float("inf")
        while time.monotonic() < end:
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
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
                    break
    except KeyboardInterrupt:
        pass
    finally:
        node.close()
        task = getattr(driver, "task_info", None)
        info = task() if task is not None else {}
        driver.disconnect()
    if tty and cfg.status:
        print()
    report = node.report()
    report.update({"robot": cfg.robot.name, "policy": cfg.policy, "wall_s": time.monotonic() - t_start,
                   "task": info, "config": to_dict(cfg)})
    out = Path(cfg.report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    return report
