"""Control-loop timing: our ControlNode vs a LeRobot-style ``time.sleep`` loop, same run.

Both loops run the same tick (read driver → scheduler → safety → write → observation to the
policy worker) against the same in-process arm driver, at the same rate, one after the other,
while the policy worker process infers concurrently (``work_ms`` of CPU per prediction).
Ours: absolute deadlines, hybrid sleep (sleep, then a short spin), SCHED_FIFO + timer slack
when allowed. LeRobot-style: ``time.sleep(period - elapsed)`` after each tick, no real-time
settings (as lerobot's record/teleoperate loops).

Lateness = tick start − its intended start (ours: the fixed schedule; LeRobot-style: previous
start + period, since it keeps no schedule). Missed deadline = lateness + work > period.

    python bench/control_loop.py --duration 60 --rate 500 --work-ms 30
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from hardware.control import ActionScheduler, ControlNode, NodeConfig, PolicyWorkerSource, SafetyFilter
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
            self.timer.record(t0 - intended, t1 - t0)
            time.sleep(max(self.period - (t1 - t0), 0.0))
            intended = t0 + self.period


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
    skip = node.timer.n
    node.timer.missed = 0
    node.timer.skipped = 0
    t0 = time.monotonic()
    time.sleep(args.duration)
    wall = time.monotonic() - t0
    node.close()
    late = node.timer.lateness[skip : node.timer.n] * 1e6
    work = node.timer.work[skip : node.timer.n] * 1e6
    missed = int(np.sum((late + work) / 1e6 > 1.0 / args.rate))
    return {
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
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
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
    print(f"ours: realtime {ours['realtime']}; chunks {ours['chunks']}; goal p99 <= 200 us, 0 missed")
    print(f"load average after {load2[0]:.2f} {load2[1]:.2f} {load2[2]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "load_before": load, "load_after": load2}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
