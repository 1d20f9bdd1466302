"""Latched faults: once tripped, the node commands a safe stop and stays stopped until reset."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class Fault:
    code: str  # estop, command_timeout, driver_error, driver_hang, worker_died, non_finite, ...
    reason: str
    t: float  # time.monotonic() when it tripped
    stop_latency: float | None = None  # seconds from trip (or the event, if known) to the stop command

    def as_dict(self) -> dict:
        return {"code": self.code, "reason": self.reason, "t": self.t, "stop_latency_s": self.stop_latency}


class FaultLatch:
    """Thread-safe latch: the first fault wins the "active" slot, every fault is logged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active: Fault | None = None
        self.history: list[Fault] = []

    def trip(self, code: str, reason: str, t: float | None = None) -> Fault:
        fault = Fault(code, reason, time.monotonic() if t is None else t)
        with self._lock:
            self.history.append(fault)
            if self.active is None:
                self.active = fault
        return fault

    @property
    def tripped(self) -> bool:
        return self.active is not None

    def reset(self) -> Fault | None:
        """Clear the latch (explicit operator action); returns the fault that was cleared."""
        with self._lock:
            cleared, self.active = self.active, None
        return cleared
