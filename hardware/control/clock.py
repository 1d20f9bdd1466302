"""Fixed-rate timing: hybrid sleep, real-time scheduling when allowed, and lateness statistics.

Sleeping is ``time.sleep`` until ``spin`` seconds before the deadline, then a short busy-wait.
Under SCHED_FIFO the spin stays short (a fraction of the period): a thread that spins for
whole periods at FIFO priority starves the kernel and gets throttled for tens of milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import time

try:  # per-thread resource usage (Linux); elsewhere misses are recorded without a cause
    import resource

    _RUSAGE_THREAD = resource.RUSAGE_THREAD
except (ImportError, AttributeError):
    resource, _RUSAGE_THREAD = None, None

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


def thread_usage():
    """The calling thread's resource usage so far (``resource.getrusage``), or None where unsupported."""
    return resource.getrusage(_RUSAGE_THREAD) if _RUSAGE_THREAD is not None else None


MISS_CAUSES = ("late_wakeup", "preempted", "page_fault", "off_cpu_wait", "on_cpu", "unknown")


def classify_miss(lateness: float, work: float, cpu: float, u0, u1) -> dict:
    """Why a tick missed its deadline, from what the thread itself can observe.

    * ``late_wakeup``: most of the overrun was before the tick started (the OS, or the
      hypervisor, did not run the thread at its deadline).
    * ``preempted``: another task took the CPU during the tick (involuntary context switch).
    * ``page_fault``: the tick faulted memory in (a major fault, or a minor one).
    * ``off_cpu_wait``: the thread was off the CPU for a good part of the tick without being
      preempted: it blocked (a lock, the GIL held by another thread, a driver's I/O).
    * ``on_cpu``: the thread ran the whole tick, without a switch or a fault, and it still took
      this long: its own work, or a pause of the virtual CPU by the hypervisor (which the guest
      kernel counts as CPU time of whatever thread was running).
    """
    d = {"lateness_us": lateness * 1e6, "work_us": work * 1e6, "cpu_us": cpu * 1e6}
    if u0 is not None and u1 is not None:
        d.update(involuntary_switches=u1.ru_nivcsw - u0.ru_nivcsw, voluntary_switches=u1.ru_nvcsw - u0.ru_nvcsw,
                 minor_faults=u1.ru_minflt - u0.ru_minflt, major_faults=u1.ru_majflt - u0.ru_majflt)
    if lateness > work:
        cause = "late_wakeup"
    elif u0 is None or u1 is None or cpu != cpu:
        cause = "unknown"
    elif d["involuntary_switches"] > 0:
        cause = "preempted"
    elif d["major_faults"] > 0 or d["minor_faults"] > 0:
        cause = "page_fault"
    elif work - cpu > 0.25 * work:
        cause = "off_cpu_wait"
    else:
        cause = "on_cpu"
    d["cause"] = cause
    return d


class TickTimer:
    """Per-tick record of lateness (start - deadline), work time and the thread's CPU time in the
    tick, in preallocated buffers; each missed deadline is also classified (:func:`classify_miss`)."""

    def __init__(self, period: float, capacity: int = 2_000_000, max_miss_details: int = 1000):
        self.period = float(period)
        self.lateness = np.zeros(capacity)
        self.work = np.zeros(capacity)
        self.cpu = np.full(capacity, np.nan)  # thread CPU time during the tick's work (NaN: not given)
        self.start = np.full(capacity, np.nan)  # tick start, time.monotonic (NaN: not given)
        self.n = 0
        self.missed = 0  # ticks whose work ended after the next deadline
        self.skipped = 0  # deadlines jumped over after an overrun (never executed)
        self.overflow = 0
        self.max_miss_details = int(max_miss_details)
        self.miss_details: list[dict] = []  # the first max_miss_details misses, classified
        self.miss_causes: dict[str, int] = dict.fromkeys(MISS_CAUSES, 0)

    def record(self, lateness: float, work: float, start: float = float("nan"), cpu: float = float("nan"),
               usage_before=None, usage_after=None) -> None:
        if self.n < len(self.lateness):
            self.lateness[self.n] = lateness
            self.work[self.n] = work
            self.cpu[self.n] = cpu
            self.start[self.n] = start
            self.n += 1
        else:
            self.overflow += 1
        self.count_miss(lateness, work, start, cpu, usage_before, usage_after)

    def count_miss(self, lateness: float, work: float, start: float, cpu: float, usage_before, usage_after) -> None:
        """Count and classify the tick if its work ended after the next deadline."""
        if lateness + work > self.period:
            self.missed += 1
            d = classify_miss(lateness, work, cpu, usage_before, usage_after)
            self.miss_causes[d["cause"]] += 1
            if len(self.miss_details) < self.max_miss_details:
                d["start"] = start
                self.miss_details.append(d)

    def clear_misses(self) -> None:
        """Forget the misses counted so far (e.g. after a warm-up); the per-tick record stays."""
        self.missed = self.skipped = 0
        self.miss_details.clear()
        self.miss_causes = dict.fromkeys(MISS_CAUSES, 0)

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
            "miss_causes": {k: v for k, v in self.miss_causes.items() if v},
            "skipped_ticks": self.skipped,
        }
