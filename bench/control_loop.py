"""Control-loop timing: our ControlNode vs a LeRobot-style ``time.sleep`` loop, same run.

Both loops run the same tick (read driver → scheduler → safety → write → observation to the
policy worker) against the same in-process arm driver, at the same rate, one after the other,
while the policy worker process infers concurrently (``work_ms`` of CPU per prediction).
Ours: absolute deadlines, hybrid sleep (sleep, then a short spin), SCHED_FIFO + timer slack
when allowed. LeRobot-style: ``time.sleep(period - elapsed)`` after each tick, no real-time
settings (as lerobot's record/teleoperate loops).

Lateness = tick start − its intended start (ours: the fixed schedule; LeRobot-style: previous
start + period, since it keeps no schedule). Missed deadline = lateness + work > period.

Each missed tick is classified from the loop thread's own view (``hardware.control.clock.classify_miss``):
started late, preempted, page fault, blocked off the CPU (GIL, lock, I/O), or on the CPU the whole
tick and still over time (its own work, or the host slowing or pausing the virtual CPU).

``--probe`` also runs an independent probe process beside each loop: the same hybrid sleep at
the same rate and priority, then a fixed pure-Python computation of ``--probe-work-us`` (no GIL
shared with the node, no driver, no worker). A missed tick of the node that overlaps a stall of
the probe, or a probe tick whose fixed work took 3x its median, happened while the machine itself
was stalled or slowed (the OS or the hypervisor), not because of the node. The CPU time stolen by
the hypervisor over each run (/proc/stat) is printed as well.

    python bench/control_loop.py --duration 60 --rate 500 --work-ms 30 [--probe]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from hardware.control import ActionScheduler, ControlNode, NodeConfig, PolicyWorkerSource, SafetyFilter
from hardware.control.clock import setup_realtime, sleep_until, thread_usage
from hardware.drivers.base import DriverSpec


class LoopbackArm:
    """6 joints that reach the command at once: driver I/O cost ~0, so the timing is the loop's."""

    def __init__(self, rate_hz: float):
        self.spec = DriverSpec("arm", tuple(f"j{i}" for i in range(6)), -np.ones(6) * 3, np.ones(6) * 3,
                               max_rate=5.0, max_rate2=100.0, rate_hz=rate_hz, command_timeout=1.0)
        self.q = np.zeros(6)

    def connect(self):
        pass

    def read(self):
        return {"observation.state": self.q.copy(), "observation.images.front": self._img}

    _img = np.zeros((96, 96, 3), np.uint8)

    def write(self, c):
        self.q = np.asarray(c, float).copy()
        return self.q

    def stop(self):
        pass

    def disconnect(self):
        pass


def _busy(iters: int) -> int:
    x = 0
    for i in range(iters):
        x += i
    return x


def _busy_iters(work_us: float) -> int:
    """How many :func:`_busy` iterations take about ``work_us`` on this machine now."""
    t = time.perf_counter()
    _busy(100_000)
    return max(1, int(100_000 * work_us * 1e-6 / (time.perf_counter() - t)))


class Canary:
    """A fixed pure-Python computation after every tick (``--canary-us``), timed, with the tick's
    start. When it takes several times its median, the CPU itself ran slow during that tick."""

    def __init__(self, work_us: float, capacity: int):
        self.iters = _busy_iters(work_us)
        self.took, self.start, self.n = np.zeros(capacity), np.zeros(capacity), 0

    def __call__(self, tick_start: float) -> None:
        c0 = time.monotonic()
        _busy(self.iters)
        if self.n < len(self.took):
            self.took[self.n], self.start[self.n] = time.monotonic() - c0, tick_start
            self.n += 1

    def slowdown_at(self, tick_start: float) -> float:
        """How many times its median the canary took in the tick that started at ``tick_start``."""
        took, start = self.took[: self.n], self.start[: self.n]
        i = int(np.searchsorted(start, tick_start))
        if i >= len(start) or start[i] != tick_start:
            return float("nan")
        return float(took[i] / np.median(took))


def with_canary(cls):
    class WithCanary(cls):
        canary: Canary | None = None

        def _tick(self, now: float) -> None:
            super()._tick(now)
            if self.canary is not None:
                self.canary(now)

    WithCanary.__name__ = cls.__name__
    return WithCanary


class SleepLoopNode(ControlNode):
    """The same tick, paced the LeRobot way: sleep for what is left of the period, no RT settings."""

    def _loop(self) -> None:
        self.realtime = {"fifo": False, "note": "time.sleep(period - elapsed), SCHED_OTHER"}
        self._resync = True
        intended = time.monotonic()
        while self._running.is_set():
            t0 = time.monotonic()
            u0, c0 = thread_usage(), time.thread_time()
            self._tick(t0)
            c1, u1 = time.thread_time(), thread_usage()
            t1 = time.monotonic()
            self.timer.record(t0 - intended, t1 - t0, t0, c1 - c0, u0, u1)
            time.sleep(max(self.period - (t1 - t0), 0.0))
            intended = t0 + self.period


def steal_seconds() -> float:
    """CPU time stolen by the hypervisor so far, all CPUs (/proc/stat; NaN where unavailable)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def probe_main(out: str, duration: float, rate: float, spin: float, fifo: bool, work_us: float) -> None:
    """The probe process: hybrid sleep to a fixed schedule, then a fixed pure-Python computation
    of about ``work_us`` (the node's usual tick work), timed; nothing else. A stall of the machine
    shows as lateness, a slowdown of the CPU (host contention) as work far above its median."""
    setup_realtime(fifo, 50, None)
    iters = _busy_iters(work_us)
    period, n = 1.0 / rate, int(duration * rate)
    start, late, work = np.zeros(n), np.zeros(n), np.zeros(n)
    deadline = time.monotonic()
    for i in range(n):
        sleep_until(deadline, spin)
        t0 = time.monotonic()
        _busy(iters)
        t1 = time.monotonic()
        start[i], late[i], work[i] = t0, t0 - deadline, t1 - t0
        deadline += period
        if t1 > deadline:
            deadline += (int((t1 - deadline) / period) + 1) * period
    np.savez(out, start=start, late=late, work=work)


def coincide(miss_start: np.ndarray, miss_late: np.ndarray, miss_work: np.ndarray, probe: dict, min_stall: float = 5e-4,
             slow: float = 3.0) -> int:
    """How many of the node's missed ticks overlap a disturbance of the probe: a stall (lateness
    >= min_stall) or a slowed tick (work >= ``slow`` x its median)."""
    stalled = probe["late"] >= min_stall
    slowed = probe["work"] >= slow * np.median(probe["work"])
    d_begin = np.concatenate([probe["start"][stalled] - probe["late"][stalled], probe["start"][slowed]])
    d_end = np.concatenate([probe["start"][stalled], probe["start"][slowed] + probe["work"][slowed]])
    hits = 0
    for t, lt, w in zip(miss_start, miss_late, miss_work):
        # the node's tick was due at t - lt, started at t and ended at t + w; a disturbance of the
        # probe overlapping that window (1 ms of slack either side for the two schedules' phase)
        if np.any((d_begin <= t + w + 1e-3) & (d_end >= t - lt - 1e-3)):
            hits += 1
    return hits


def run_one(cls, name: str, args, workdir: str) -> dict:
    drv = LoopbackArm(args.rate)
    ep = f"ipc://{workdir}/{name}.sock"
    cmd = [sys.executable, "-m", "robopolicy.deploy.worker", "--endpoint", ep,
           "--policy", f"sine:amp=0.2,work_ms={args.work_ms}", "--parent-pid", str(os.getpid())]
    src = PolicyWorkerSource(ep, cmd, request_hz=args.policy_hz)
    node = with_canary(cls)(drv, src, ActionScheduler("ensemble"), SafetyFilter(drv.spec, 1 / args.rate),
               NodeConfig(rate_hz=args.rate, spin=args.spin_us * 1e-6, fifo=not args.no_fifo))
    if args.canary_us > 0:
        node.canary = Canary(args.canary_us, int((args.duration + 40) * args.rate))
    node.start()
    deadline = time.monotonic() + 30
    while src.replies == 0 and time.monotonic() < deadline:  # worker start-up is not loop timing
        time.sleep(0.05)
    probe_proc, probe_out = None, os.path.join(workdir, f"probe-{len(name)}.npz")
    if args.probe:
        probe_proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--probe-out", probe_out,
                                       "--duration", str(args.duration + 1.0), "--rate", str(args.rate),
                                       "--spin-us", str(args.spin_us), "--probe-work-us", str(args.probe_work_us)] + (["--no-fifo"] if args.no_fifo else []))
        time.sleep(0.5)
    skip = node.timer.n
    node.timer.clear_misses()
    steal0 = steal_seconds()
    t0 = time.monotonic()
    time.sleep(args.duration)
    wall = time.monotonic() - t0
    steal = steal_seconds() - steal0
    node.close()
    late = node.timer.lateness[skip : node.timer.n] * 1e6
    work = node.timer.work[skip : node.timer.n] * 1e6
    is_miss = (late + work) / 1e6 > 1.0 / args.rate
    missed = int(np.sum(is_miss))
    probe = {}
    if probe_proc is not None:
        probe_proc.wait(timeout=30)
        pr = dict(np.load(probe_out))
        keep = (pr["start"] >= t0) & (pr["start"] <= t0 + wall)
        pr = {k: v[keep] for k, v in pr.items()}
        starts = node.timer.start[skip : node.timer.n]
        probe = {"probe_ticks": int(keep.sum()), "probe_p99_us": float(np.percentile(pr["late"], 99) * 1e6),
                 "probe_max_us": float(pr["late"].max() * 1e6),
                 "probe_stalls": int(np.sum(pr["late"] >= 5e-4)),
                 "probe_work_p50_us": float(np.median(pr["work"]) * 1e6),
                 "probe_slowed": int(np.sum(pr["work"] >= 3.0 * np.median(pr["work"]))),
                 "probe_missed": int(np.sum(pr["late"] > 1.0 / args.rate)),
                 "misses_in_probe_stall": coincide(starts[is_miss], late[is_miss] / 1e6, work[is_miss] / 1e6, pr)}
    canary = {}
    if node.canary is not None:
        slow = [node.canary.slowdown_at(m["start"]) for m in node.timer.miss_details]
        canary = {"canary_us_p50": float(np.median(node.canary.took[: node.canary.n]) * 1e6),
                  "misses_cpu_slowed": int(sum(x >= 3.0 for x in slow)), "misses_classified": len(slow)}
    return {**probe, **canary, "steal_s": steal,
        "loop": name, "ticks": len(late), "achieved_hz": len(late) / wall,
        "p50_us": float(np.percentile(late, 50)), "p99_us": float(np.percentile(late, 99)),
        "max_us": float(late.max()), "missed": missed, "skipped": node.timer.skipped,
        "work_p50_us": float(np.percentile(work, 50)), "work_p99_us": float(np.percentile(work, 99)),
        "miss_causes": {k: v for k, v in node.timer.miss_causes.items() if v},
        "miss_details": node.timer.miss_details[:50], "chunks": node.scheduler.received,
        "infer_ms_p50": src.stats()["infer_ms"]["p50"],
        "realtime": node.realtime, "fault": node.fault.as_dict() if node.fault else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds per loop")
    p.add_argument("--rate", type=float, default=500.0)
    p.add_argument("--policy-hz", type=float, default=20.0)
    p.add_argument("--work-ms", type=float, default=30.0, help="CPU burnt per inference in the worker")
    p.add_argument("--spin-us", type=float, default=300.0)
    p.add_argument("--no-fifo", action="store_true")
    p.add_argument("--probe", action="store_true", help="run the independent probe process beside each loop")
    p.add_argument("--canary-us", type=float, default=0.0,
                   help="run a fixed computation of this many us after every tick and report the misses in which it ran >= 3x slower")
    p.add_argument("--probe-work-us", type=float, default=300.0, help="fixed computation per probe tick")
    p.add_argument("--probe-out", help=argparse.SUPPRESS)  # internal: this process is the probe
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--out", help="also write the run record OUT/summary.json")
    args = p.parse_args()
    started = time.time()
    if args.probe_out:
        probe_main(args.probe_out, args.duration, args.rate, args.spin_us * 1e-6, not args.no_fifo, args.probe_work_us)
        return
    load = os.getloadavg()
    print(f"control loop at {args.rate:.0f} Hz for {args.duration:.0f} s each, worker {args.work_ms:.0f} ms/inference "
          f"at {args.policy_hz:.0f} Hz; {os.cpu_count()} CPUs, load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    with tempfile.TemporaryDirectory(prefix="rp-bench-") as wd:
        rows = [run_one(ControlNode, "robopolicy ControlNode", args, wd), run_one(SleepLoopNode, "LeRobot-style sleep", args, wd)]
    load2 = os.getloadavg()
    print(f"\n| loop                    | ticks  | rate Hz | p50 late us | p99 late us | max late us | missed |")
    print("|-------------------------|--------|---------|-------------|-------------|-------------|--------|")
    for r in rows:
        print(f"| {r['loop']:<23} | {r['ticks']:>6} | {r['achieved_hz']:>7.1f} | {r['p50_us']:>11.0f} | {r['p99_us']:>11.0f} "
              f"| {r['max_us']:>11.0f} | {r['missed']:>6} |")
    ours, base = rows
    ratio = lambda a, b: a / b if b else float("nan")  # noqa: E731
    print(f"\nratio ours / LeRobot-style: p50 {ratio(ours['p50_us'], base['p50_us']):.2f}, "
          f"p99 {ratio(ours['p99_us'], base['p99_us']):.2f}, max {ratio(ours['max_us'], base['max_us']):.2f}, "
          f"missed {ours['missed']} vs {base['missed']}")
    for r in rows:
        line = f"{r['loop']}: {r['steal_s'] * 1e3:.0f} ms of CPU stolen by the hypervisor during the run"
        if "probe_ticks" in r:
            line += (f"; probe process beside it: p99 {r['probe_p99_us']:.0f} us, max {r['probe_max_us']:.0f} us, "
                     f"{r['probe_stalls']} stalls >= 0.5 ms, {r['probe_slowed']} ticks whose fixed {r['probe_work_p50_us']:.0f} us "
                     f"of work took >= 3x as long, {r['probe_missed']} deadlines missed; {r['misses_in_probe_stall']} of {r['missed']} missed "
                     f"ticks overlapped a probe stall or slowed tick")
        print(line)
    for r in rows:
        causes = ", ".join(f"{k} {v}" for k, v in sorted(r["miss_causes"].items(), key=lambda kv: -kv[1])) or "none"
        line = f"{r['loop']}: tick work p50 {r['work_p50_us']:.0f} us, p99 {r['work_p99_us']:.0f} us; missed ticks by cause: {causes}"
        if "canary_us_p50" in r:
            line += (f"; in {r['misses_cpu_slowed']} of {r['misses_classified']} missed ticks the fixed {r['canary_us_p50']:.0f} us "
                     f"canary computation ran >= 3x slower (the CPU itself was slow)")
        print(line)
    print("  (late_wakeup: started late; on_cpu: ran the whole tick without a switch or fault, yet overran: its own work\n"
          "   or a hypervisor pause of the vCPU; off_cpu_wait: blocked (GIL, lock, I/O); preempted; page_fault)")
    print(f"ours: realtime {ours['realtime']}; chunks {ours['chunks']}; goal p99 <= 200 us, 0 missed")
    print(f"load average after {load2[0]:.2f} {load2[1]:.2f} {load2[2]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "load_before": load, "load_after": load2}, f, indent=2, default=str)
    if args.out:
        from robopolicy.utils.records import write_summary

        write_summary(args.out, kind="bench", config=vars(args), started_at=started, extra={"bench": "control_loop"},
                      metrics={"loops": {r["loop"]: r for r in rows}, "load_before": load, "load_after": load2})


if __name__ == "__main__":
    main()
