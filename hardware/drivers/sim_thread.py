"""A MuJoCo simulation stepped in real time on its own thread, like hardware with its own clock.

The control thread never waits for the simulation: it reads the latest published snapshot and
leaves its command in a slot that the simulation thread picks up before its next step. Both are
plain reference swaps (atomic under the GIL), so no lock is shared with the control loop.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hardware.drivers.base import DriverError


@dataclass
class SimSnapshot:
    """What the simulated robot last reported (``t``: time.monotonic() when it was taken)."""

    t: float
    state: np.ndarray
    images: dict[str, np.ndarray] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


class RealtimeSimThread:
    """Runs ``step(command)`` every ``period`` seconds of wall time on a daemon thread.

    ``step`` returns a :class:`SimSnapshot` (or None to keep the previous one). If the thread
    dies, :meth:`latest` raises with the reason; if it stops publishing for ``stale_after``
    seconds (a hang), :meth:`latest` raises too, so the node sees a driver that stopped answering.
    """

    def __init__(self, name: str, period: float, step, setup=None, teardown=None, stale_after: float = 0.5,
                 fifo_priority: int | None = 40):
        self.name, self.period, self.stale_after = name, float(period), float(stale_after)
        self._step, self._setup, self._teardown = step, setup, teardown
        self.fifo_priority = fifo_priority
        self._snapshot: SimSnapshot | None = None
        self._command: np.ndarray | None = None
        self._error: BaseException | None = None
        self._running = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.late_steps = 0

    def start(self, timeout: float = 30.0) -> None:
        self._running.set()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise DriverError(f"{self.name}: simulation did not start within {timeout:.0f}s")
        if self._error is not None:
            raise DriverError(f"{self.name}: simulation failed to start: {self._error!r}") from self._error

    def _run(self) -> None:
        try:
            if self.fifo_priority is not None:
                # Below the control loop's priority but above ordinary processes: this thread
                # shares the GIL with the loop, and a GIL holder preempted by an unrelated
                # process would stall the loop (priority inversion).
                try:
                    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(self.fifo_priority))
                except (OSError, AttributeError):
                    pass
            if self._setup is not None:
                self._setup()
            next_t = time.monotonic()
            while self._running.is_set():
                snap = self._step(self._command)
                if snap is not None:
                    self._snapshot = snap
                self.steps += 1
                self._ready.set()
                next_t += self.period
                delay = next_t - time.monotonic()
                if delay < -self.period:  # fell behind by a whole step: count it, do not catch up
                    self.late_steps += 1
                    next_t = time.monotonic()
                # Always give up the core for part of a period: at FIFO priority a simulation
                # that cannot keep real time would otherwise spin and starve every ordinary
                # process on its core (the policy worker among them).
                time.sleep(max(delay, 0.25 * self.period))
        except BaseException as exc:  # reported through latest() to the control thread
            self._error = exc
            self._ready.set()
        finally:
            if self._teardown is not None:
                try:
                    self._teardown()
                except Exception:
                    pass

    def set_command(self, command: np.ndarray | None) -> None:
        self._command = command

    def latest(self) -> SimSnapshot:
        if self._error is not None:
            raise DriverError(f"{self.name}: simulation thread died: {self._error!r}")
        snap = self._snapshot
        if snap is None:
            raise DriverError(f"{self.name}: not started")
        if time.monotonic() - snap.t > self.stale_after:
            raise DriverError(f"{self.name}: no state for {time.monotonic() - snap.t:.2f}s (simulation stalled)")
        return snap

    def close(self, timeout: float = 2.0) -> None:
        self._running.clear()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
