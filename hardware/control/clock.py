"""Fixed-rate timing: hybrid sleep, real-time scheduling when allowed, and lateness statistics.

Sleeping is ``time.sleep`` until ``spin`` seconds before the deadline, then a short busy-wait.
Under SCHED_FIFO the spin stays short (a fraction of the period): a thread that spins for
whole periods at FIFO priority starves the kernel and gets throttled for tens of milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np

PR_SET_TIMERSLACK = 29


def sleep_until(deadline: float, spin: float) -> None:
    """Sleep until ``spin`` s before ``deadline`` (time.monotonic), then busy-wait the rest."""
    remaining = deadline - time.monotonic()
    if remaining > spin:
        time.sleep(remaining - spin)
    while time.monotonic() < deadline:
        pass


def setup_realtime(fifo: bool = True, priority: int = 50, cpus: list[int] | None = None) -> dict:
    """Best effort for the calling thread: 1 µs timer slack, CPU affinity, SCHED_FIFO.

    Returns what was obtained (``{"fifo": bool, "cpus": [...], "timer_slack_ns": int, "notes": [...]}``);
    nothing here raises when the OS refuses (an unprivileged process keeps SCHED_OTHER).
    """
    got: dict = {"fifo": False, "cpus": None, "timer_slack_ns": None, "notes": []}
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0) == 0:
            got["timer_slack_ns"] = 1000
    except (OSError, AttributeError) as exc:
        got["notes"].append(f"timer slack: {exc}")
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
            got["cpus"] = sorted(os.sched_getaffinity(0))
        except (OSError, ValueError) as exc:
            got["notes"].append(f"affinity {cpus}: {exc}")
    if fifo:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
            got["fifo"] = True
        except (OSError, AttributeError) as exc:
            got["notes"].append(f"SCHED_FIFO refused ({exc.__class__.__name__}): running SCHED_OTHER")
    return got


class TickTimer:
    """Per-tick record of lateness (start - deadline) and work time, in a preallocated buffer."""

    def __init__(self, period: float, capacity: int = 2_000_000):
        self.period = float(period)
        self.lateness = np.zeros(capacity)
        self.work = np.zeros(capacity)
        self.start = np.full(capacity, np.nan)  # tick start, time.monotonic (NaN: not given)
        self.n = 0
        self.missed = 0  # ticks whose work ended after the next deadline
        self.skipped = 0  # deadlines jumped over after an overrun (never executed)
        self.overflow = 0

    def record(self, lateness: float, work: float, start: float = float("nan")) -> None:
        if self.n < len(self.lateness):
            self.lateness[self.n] = lateness
            self.work[self.n] = work
            self.start[self.n] = start
            self.n += 1
        else:
            self.overflow += 1
        if lateness + work > self.period:
            self.missed += 1

    def recent(self, n: int) -> np.ndarray:
        return self.lateness[max(0, self.n - n) : self.n]

    def summary(self) -> dict:
        late, work = self.lateness[: self.n] * 1e6, self.work[: self.n] * 1e6

        def pct(a, q):
            return float(np.percentile(a, q)) if len(a) else float("nan")

        return {
            "ticks": self.n,
            "period_us": self.period * 1e6,
            "lateness_us": {"p50": pct(late, 50), "p99": pct(late, 99), "p999": pct(late, 99.9), "max": float(late.max()) if len(late) else float("nan")},
            "work_us": {"p50": pct(work, 50), "p99": pct(work, 99), "max": float(work.max()) if len(work) else float("nan")},
            "missed_deadlines": self.missed,
            "skipped_ticks": self.skipped,
        }
