"""Control-loop timing: our ControlNode vs a LeRobot-style ``time.sleep`` loop, same run.

Both loops run the same tick (read driver → scheduler → safety → write → observation to the
policy worker) against the same in-process arm driver, at the same rate, one after the other,
while the policy worker process infers concurrently (``work_ms`` of CPU per prediction).
Ours: absolute deadlines, hybrid sleep (sleep, then a short spin), SCHED_FIFO + timer slack
when allowed. LeRobot-style: ``time.sleep(period - elapsed)`` after each tick, no real-time
settings (as lerobot's record/teleoperate loops).

Lateness = tick start − its intended start (ours: the fixed schedule; LeRobot-style: previous
start + period, since it keeps no schedule). Missed deadline = lateness + work > period.

``--probe`` also runs an independent probe process beside each loop: the same hybrid sleep at
the same rate and priority, and nothing else (no GIL shared with the node, no driver, no
worker). A missed tick of the node that falls inside a stall of the probe was a stall of the
machine (the OS or the hypervisor), not of the node. The CPU time stolen by the hypervisor over
each run (/proc/stat) is printed as well.

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
from hardware.control.clock import setup_realtime, sleep_until
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


class SleepLoopNode(ControlNode):
    """The same tick, paced the LeRobot way: sleep for what is left of the period, no RT settings."""

    def _loop(self) -> None:
        self.realtime = {"fifo": False, "note": "time.sleep(period - elapsed), SCHED_OTHER"}
        self._resync = True
        intended = time.monotonic()
        while self._running.is_set():
            t0 = time.monotonic()
            self._tick(t0)
            t1 = time.monotonic()
            self.timer.record(t0 - intended, t1 - t0, t0)
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


def probe_main(out: str, duration: float, rate: float, spin: float, fifo: bool) -> None:
    """The probe process: hybrid sleep to a fixed schedule, one timestamp per tick, nothing else."""
    setup_realtime(fifo, 50, None)
    period, n = 1.0 / rate, int(duration * rate)
    start, late = np.zeros(n), np.zeros(n)
    deadline = time.monotonic()
    for i in range(n):
        sleep_until(deadline, spin)
        t0 = time.monotonic()
        start[i], late[i] = t0, t0 - deadline
        deadline += period
        if t0 > deadline:
            deadline += (int((t0 - deadline) / period) + 1) * period
    np.savez(out, start=start, late=late)


def coincide(miss_start: np.ndarray, miss_late: np.ndarray, probe: dict, min_stall: float = 5e-4) -> int:
    """How many of the node's missed ticks overlap a stall (lateness >= min_stall) of the probe."""
    stalled = probe["late"] >= min_stall
    s_end = probe["start"][stalled]
    s_begin = s_end - probe["late"][stalled]
    hits = 0
    for t, lt in zip(miss_start, miss_late):
        # the node's tick was due at t - lt and started at t; a probe stall overlapping that
        # window (1 ms of slack either side for the two schedules' phase) is the same event
        if np.any((s_begin <= t + 1e-3) & (s_end >= t - lt - 1e-3)):
            hits += 1
    return hits


def run_one(cls, name: str, args, workdir: str) -> dict:
    drv = LoopbackArm(args.rate)
    ep = f"ipc://{workdir}/{name}.sock"
    cmd = [sys.executable, "-m", "robopolicy.deploy.worker", "--endpoint", ep,
           "--policy", f"sine:amp=0.2,work_ms={args.work_ms}", "--parent-pid", str(os.getpid())]
    src = PolicyWorkerSource(ep, cmd, request_hz=args.policy_hz)
    node = cls(drv, src, ActionScheduler("ensemble"), SafetyFilter(drv.spec, 1 / args.rate),
               NodeConfig(rate_hz=args.rate, spin=args.spin_us * 1e-6, fifo=not args.no_fifo))
    node.start()
    deadline = time.monotonic() + 30
    while src.replies == 0 and time.monotonic() < deadline:  # worker start-up is not loop timing
        time.sleep(0.05)
    probe_proc, probe_out = None, os.path.join(workdir, f"probe-{len(name)}.npz")
    if args.probe:
        probe_proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--probe-out", probe_out,
                                       "--duration", str(args.duration + 1.0), "--rate", str(args.rate),
                                       "--spin-us", str(args.spin_us)] + (["--no-fifo"] if args.no_fifo else []))
        time.sleep(0.5)
    skip = node.timer.n
    node.timer.missed = 0
    node.timer.skipped = 0
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
                 "probe_missed": int(np.sum(pr["late"] > 1.0 / args.rate)),
                 "misses_in_probe_stall": coincide(starts[is_miss], late[is_miss] / 1e6, pr)}
    return {**probe, "steal_s": steal,
        "loop": name, "ticks": len(late), "achieved_hz": len(late) / wall,
        "p50_us": float(np.percentile(late, 50)), "p99_us": float(np.percentile(late, 99)),
        "max_us": float(late.max()), "missed": missed, "skipped": node.timer.skipped,
        "work_p50_us": float(np.percentile(work, 50)), "chunks": node.scheduler.received,
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
    p.add_argument("--probe-out", help=argparse.SUPPRESS)  # internal: this process is the probe
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    if args.probe_out:
        probe_main(args.probe_out, args.duration, args.rate, args.spin_us * 1e-6, not args.no_fifo)
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
                     f"{r['probe_stalls']} stalls >= 0.5 ms, {r['probe_missed']} deadlines missed; {r['misses_in_probe_stall']} of {r['missed']} missed "
                     f"ticks fell in a probe stall")
        print(line)
    print(f"ours: realtime {ours['realtime']}; chunks {ours['chunks']}; goal p99 <= 200 us, 0 missed")
    print(f"load average after {load2[0]:.2f} {load2[1]:.2f} {load2[2]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "load_before": load, "load_after": load2}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
