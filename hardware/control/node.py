"""ControlNode: the fixed-rate loop between an action source and one driver.

Each tick: read the driver → take chunks that arrived → take the due command from the
scheduler → SafetyFilter → write the driver → send the observation to the source when it
wants one → publish → record timing. Any fault (e-stop, driver error or hang, worker death,
non-finite command, command timeout) commands the driver's safe stop in the same tick and
latches until :meth:`reset`. A watchdog thread catches a driver call (read/write) that does not
return: it counts only the time it was awake to see, so a process that the OS (or another thread
holding the GIL) did not run for a while is a *stall* (counted, and the overrun deadlines counted
by the timer), not a driver hang.

What the watchdog cannot see: a driver call that holds the GIL (a C extension that blocks without
releasing it) stops the watchdog as well, exactly as a stall of the whole process does, so it is
counted as a stall, and no thread of this process can act before the call returns. The tick
therefore judges every command's age with a clock read *after* the driver returns, and refuses
to write a command older than ``command_timeout`` (``command_timeout`` fault instead): a frozen
call can delay the stop, never make the robot execute a stale command. Driver calls that overran
``driver_timeout`` are counted (``slow_driver_calls``, longest in ms) in the report. A driver
whose calls may hold the GIL belongs in its own process (``hardware.drivers.sim_process`` runs
the simulated robots that way; the tick then only copies shared memory), where the watchdog's
reach is the driver's whole call.
"""

from __future__ import annotations

import gc
import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from hardware.control.clock import TickTimer, setup_realtime, sleep_until, thread_usage
from hardware.control.faults import FaultLatch
from hardware.control.safety import SafetyFilter, UnsafeCommand
from hardware.control.scheduler import ActionScheduler, WaypointFollower
from hardware.control.source import ActionSource


@dataclass
class NodeConfig:
    """Loop settings. ``rate_hz``/``command_timeout`` default to the driver spec's."""

    rate_hz: float | None = None
    command_timeout: float | None = None
    startup_timeout: float = 120.0  # first chunk (model load) must arrive within this
    driver_timeout: float = 0.05  # a driver call seen stuck this long by the watchdog is a hang
    spin: float = 0.0003  # busy-wait this long before each deadline
    fifo: bool = True
    fifo_priority: int = 50
    cpus: list[int] | None = None


def _source_fault_code(problem: str) -> str:
    """The fault code for a source's health problem."""
    if "handshake" in problem:
        return "auth_refused"
    if "refused" in problem:
        return "session_refused"
    if "worker" in problem and "silent" not in problem:
        return "worker_died"
    return "source_silent"


class ControlNode:
    def __init__(
        self,
        driver,
        source: ActionSource | None,
        scheduler: ActionScheduler | WaypointFollower,
        safety: SafetyFilter,
        config: NodeConfig = NodeConfig(),
        on_observation: Callable[[dict[str, Any], float, np.ndarray | None], None] | None = None,
    ):
        self.driver, self.source, self.scheduler, self.safety = driver, source, scheduler, safety
        self.cfg = config
        spec = driver.spec
        self.kind = spec.kind
        self.rate = float(config.rate_hz or spec.rate_hz)
        self.period = 1.0 / self.rate
        self.command_timeout = float(config.command_timeout or spec.command_timeout)
        self.spin = min(config.spin, 0.2 * self.period)
        self.on_observation = on_observation
        self.faults = FaultLatch()
        self.timer = TickTimer(self.period)
        self.realtime: dict = {}
        self.last_obs: dict[str, Any] | None = None
        self.last_command: np.ndarray | None = None
        self.last_chunk_t_obs = math.nan
        self.driver_errors = 0
        self.slow_driver_calls = 0  # driver calls that returned after more than driver_timeout
        self.longest_driver_call = 0.0
        self.stop_commanded = False  # driver.stop() was called (and returned) at least once
        self.stop_time: float | None = None  # time.monotonic() when the last driver.stop() returned
        self.close_stop_time: float | None = None  # ... the one close() commands first
        self._stop_sent = False
        self._closing = False
        self._stop_lock = threading.Lock()
        self._estop_request: tuple[str, float] | None = None
        self._running = threading.Event()
        self._in_driver: float | None = None  # when the driver call in progress began
        self.stalls = 0  # times the watchdog itself was not run for > driver_timeout / 2
        self.longest_stall = 0.0
        self._thread: threading.Thread | None = None
        self._watchdog: threading.Thread | None = None
        self._t_start = math.nan
        self._got_first_chunk = False

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the source, then the loop and watchdog threads (the driver must be connected)."""
        if self.source is not None:
            self.source.start()
        # The loop shares the GIL with every other thread of this process: make a thread that
        # holds it in pure Python hand it over within 0.5 ms instead of the default 5 ms.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        # Everything allocated so far (models, modules, buffers) is long-lived: keep the cyclic
        # garbage collector from rescanning it, so a full collection cannot pause a tick for ms.
        gc.freeze()
        self._running.set()
        self._thread = threading.Thread(target=self._loop, name="control-loop", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="control-watchdog", daemon=True)
        self._thread.start()
        self._watchdog.start()

    def close(self, timeout: float = 2.0) -> None:
        """Command the driver's safe stop at once (again, even after a fault's), stop the loop,
        command it once more after the loop's last tick, and close the source; the driver stays
        connected."""
        self._closing = True  # the loop writes no command from now on
        self._running.clear()
        self._safe_stop(force=True)  # now, not a period later: stop() is allowed from any thread
        self.close_stop_time = self.stop_time
        if self._thread is not None:
            self._thread.join(timeout)
        self._safe_stop(force=True)  # again, after the loop's last tick: nothing can follow it
        if self._watchdog is not None:
            self._watchdog.join(timeout)
        if self.source is not None:
            self.source.close()

    def run_for(self, seconds: float, on_status: Callable[[dict], None] | None = None, status_every: float = 0.5) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and self._running.is_set():
            time.sleep(min(status_every, max(0.0, end - time.monotonic())))
            if on_status is not None:
                on_status(self.status())

    # -- operator API -----------------------------------------------------------------------
    def estop(self, reason: str = "api") -> None:
        """Latch an emergency stop; the loop commands the safe stop at its next tick."""
        self._estop_request = (reason, time.monotonic())

    def reset(self) -> bool:
        """Clear a latched fault (explicit operator action). Chunks planned before are discarded."""
        if self._estop_request is not None:
            self._estop_request = None
        cleared = self.faults.reset()
        self._resync = True
        restart = getattr(self.source, "restart_silence_clock", None)
        if cleared is not None and restart is not None:
            restart()
        return cleared is not None

    def swap_source(self, new: Any, settle_ticks: int = 2, timeout: float = 1.0) -> Any:
        """Hand the loop a new, already started source and return the old one, once the loop has
        run ``settle_ticks`` ticks past the swap (or ``timeout`` passed), so the caller may close it
        without pulling it from under a tick in progress."""
        old, self.source = self.source, new
        ticks, end = self.timer.n, time.monotonic() + timeout
        while self.timer.n < ticks + settle_ticks and time.monotonic() < end:
            time.sleep(self.period)
        return old

    @property
    def fault(self):
        return self.faults.active

    # -- internals --------------------------------------------------------------------------
    def _safe_stop(self, t_event: float | None = None, force: bool = False) -> None:
        with self._stop_lock:
            if self._stop_sent and not force:
                return
            self._stop_sent = True
        try:
            self.driver.stop()
            self.stop_commanded, self.stop_time = True, time.monotonic()
        except Exception as exc:  # the fault is already latched; keep the reason
            self.faults.trip("driver_error", f"stop() raised {exc!r}")
        fault = self.faults.active
        if fault is not None and fault.stop_latency is None:
            fault.stop_latency = time.monotonic() - (t_event if t_event is not None else fault.t)

    def _trip(self, code: str, reason: str, t_event: float | None = None) -> None:
        self.faults.trip(code, reason, t_event)
        self._safe_stop(t_event)

    def _trip_stale(self, t: float) -> None:
        self._trip("command_timeout", f"no fresh command for {t - self.scheduler.last_fresh:.3f}s "
                                      f"(timeout {self.command_timeout:.3f}s)")

    def _driver_call_took(self, seconds: float) -> None:
        if seconds > self.cfg.driver_timeout:
            self.slow_driver_calls += 1
            self.longest_driver_call = max(self.longest_driver_call, seconds)

    def _hold_command(self, obs: dict[str, Any] | None) -> np.ndarray | None:
        if self.kind == "base":
            return np.zeros(self.driver.spec.dim)
        if self.last_command is not None:
            return self.last_command
        if obs is not None:
            return np.asarray(obs["observation.state"], dtype=np.float64)
        return None

    def _resync_from(self, obs: dict[str, Any] | None) -> None:
        self.scheduler.reset()
        self._got_first_chunk = False
        self._t_start = time.monotonic()
        self._stop_sent = False
        if obs is not None:
            start = np.zeros(self.driver.spec.dim) if self.kind == "base" else np.asarray(obs["observation.state"], float)
            self.safety.reset(start)
            self.last_command = None if self.kind == "base" else start.copy()

    def _watch(self) -> None:
        """Separate thread: a driver call seen stuck for driver_timeout is a hang.

        Only time the watchdog was awake to observe counts: when its own sleep overshoots by more
        than half the timeout, the whole process was not running (CPU contention, a thread holding
        the GIL); that is a stall, and the stuck time restarts from the moment it is back.
        """
        step = max(0.001, self.cfg.driver_timeout / 4)
        if self.cfg.fifo:  # must be able to run while the loop thread is stuck at FIFO priority
            setup_realtime(True, min(99, self.cfg.fifo_priority + 1), None)
        last = time.monotonic()
        seen_from = last  # start of the span the watchdog has observed without a gap
        while self._running.is_set():
            time.sleep(step)
            now = time.monotonic()
            gap = now - last - step
            last = now
            if gap > self.cfg.driver_timeout / 2:
                self.stalls += 1
                self.longest_stall = max(self.longest_stall, gap)
                seen_from = now
                continue
            started = self._in_driver
            if started is None or self.faults.tripped:
                continue
            stuck = now - max(started, seen_from)
            if stuck > self.cfg.driver_timeout:
                self._trip("driver_hang", f"a driver call stuck for > {self.cfg.driver_timeout * 1e3:.0f} ms",
                           now - stuck + self.cfg.driver_timeout)

    def _loop(self) -> None:
        self.realtime = setup_realtime(self.cfg.fifo, self.cfg.fifo_priority, self.cfg.cpus)
        self._resync = True
        deadline = time.monotonic()
        while self._running.is_set():
            sleep_until(deadline, self.spin)
            t0 = time.monotonic()
            u0, c0 = thread_usage(), time.thread_time()
            self._tick(t0)
            c1, u1 = time.thread_time(), thread_usage()
            t1 = time.monotonic()
            self.timer.record(t0 - deadline, t1 - t0, t0, c1 - c0, u0, u1)
            deadline += self.period
            if t1 > deadline:  # overrun: count the deadlines we jump over, do not try to catch up
                missed = int((t1 - deadline) / self.period) + 1
                self.timer.skipped += missed
                deadline += missed * self.period

    def _tick(self, now: float) -> None:
        try:
            self._tick_body(now)
        finally:
            self._in_driver = None

    def _tick_body(self, now: float) -> None:
        # 1. read
        obs = None
        try:
            self._in_driver = now
            obs = self.driver.read()
            t_obs = time.monotonic()
            self._in_driver = None
            self._driver_call_took(t_obs - now)
        except Exception as exc:
            self.driver_errors += 1
            if not self.faults.tripped:
                self._trip("driver_error", f"read() raised {exc!r}")
        if obs is not None:
            self.last_obs = obs
        if self._resync and obs is not None:
            self._resync = False
            self._resync_from(obs)

        # 2. e-stop and source health
        req = self._estop_request
        if req is not None and not self.faults.tripped:
            self._trip("estop", f"e-stop ({req[0]})", req[1])
        if self.source is not None and not self.faults.tripped:
            problem = self.source.health(now)
            if problem is not None:
                self._trip(_source_fault_code(problem), problem)

        # 3. new chunks
        if self.source is not None:
            for chunk in self.source.poll(now):
                if not self.faults.tripped:
                    try:
                        self.scheduler.add(chunk, now)
                    except ValueError as exc:
                        self._trip("bad_chunk", str(exc))
                        break
                    # a first chunk that was late in full (a cold worker) gives no command yet:
                    # the startup allowance, not the command timeout, still applies
                    self._got_first_chunk = self._got_first_chunk or math.isfinite(self.scheduler.last_fresh)
                    self.last_chunk_t_obs = chunk.t_obs

        # 4. command: due and aged by the clock *after* the read returned (a read can freeze)
        sent = None
        if not self.faults.tripped and obs is not None:
            t_cmd = time.monotonic()
            if self.kind == "base":
                self.scheduler.integrate(self.last_command if self.last_command is not None else np.zeros(2), t_cmd)
            cmd = self.scheduler.command_at(t_cmd)
            from_policy = cmd is not None
            if cmd is None:
                if self._got_first_chunk and t_cmd - self.scheduler.last_fresh > self.command_timeout:
                    self._trip_stale(t_cmd)
                elif not self._got_first_chunk and t_cmd - self._t_start > self.cfg.startup_timeout:
                    self._trip("command_timeout", f"no first command within {self.cfg.startup_timeout:.0f}s")
                cmd = self._hold_command(obs)
            elif t_cmd - self.scheduler.last_fresh > self.command_timeout:
                self._trip_stale(t_cmd)
                cmd = None
            if cmd is not None and not self.faults.tripped:
                try:
                    safe = self.safety(cmd)
                except UnsafeCommand as exc:
                    self._trip(exc.code, str(exc))
                    safe = None
                # last look at the clock: never write a policy command older than its limit
                if safe is not None and from_policy \
                        and time.monotonic() - self.scheduler.last_fresh > self.command_timeout:
                    self._trip_stale(time.monotonic())
                    safe = None
                if safe is not None and not self._closing:
                    try:
                        t_write = self._in_driver = time.monotonic()
                        sent = self.driver.write(safe)
                        self._in_driver = None
                        self._driver_call_took(time.monotonic() - t_write)
                        self.last_command = np.asarray(sent, dtype=np.float64)
                    except Exception as exc:
                        self.driver_errors += 1
                        self._trip("driver_error", f"write() raised {exc!r}")

        # 5. observation out
        if obs is not None:
            if self.source is not None and not self.faults.tripped and self.source.wants_observation(t_obs):
                self.source.submit(obs, t_obs)
            if self.on_observation is not None:
                self.on_observation(obs, t_obs, sent)

    # -- reporting --------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """A snapshot for the live status line (cheap; any thread)."""
        n = int(round(self.rate))
        recent = self.timer.recent(n)
        now = time.monotonic()
        src = self.source.stats() if self.source is not None else {}
        fault = self.faults.active
        return {
            "ticks": self.timer.n,
            "rate_hz": self.rate,
            "p99_lateness_us": float(np.percentile(recent, 99) * 1e6) if len(recent) else float("nan"),
            "missed": self.timer.missed,
            "infer_ms": (src.get("infer_ms") or {}).get("last"),
            "round_trip_ms": (src.get("round_trip_ms") or {}).get("p50"),
            "chunk_age_ms": (now - self.last_chunk_t_obs) * 1e3 if not math.isnan(self.last_chunk_t_obs) else None,
            "fault": None if fault is None else f"{fault.code}: {fault.reason}",
            "clamps": sum(self.safety.counts.values()),
        }

    def report(self) -> dict[str, Any]:
        """Everything measured, as plain data (for the JSON timing report)."""
        return {
            "rate_hz": self.rate,
            "timing": self.timer.summary(),
            "missed_ticks": self.timer.miss_details[:200],  # the first misses, each with its cause
            "realtime": self.realtime,
            "spin_us": self.spin * 1e6,
            "scheduler": {
                "type": type(self.scheduler).__name__,
                "blend": getattr(self.scheduler, "blend", "pure_pursuit"),
                "chunks_received": self.scheduler.received,
                "late_steps_dropped": self.scheduler.dropped_steps,
            },
            "safety_clamps": dict(self.safety.counts),
            "driver_errors": self.driver_errors,
            "slow_driver_calls": {"count": self.slow_driver_calls, "longest_ms": self.longest_driver_call * 1e3},
            "stalls": {"count": self.stalls, "longest_ms": self.longest_stall * 1e3},
            "source": self.source.stats() if self.source is not None else None,
            "faults": [f.as_dict() for f in self.faults.history],
            "active_fault": self.faults.active.as_dict() if self.faults.active else None,
        }
