"""Cost of the control tick's parts on this machine, one at a time (µs per call, median of runs).

The scheduler's ``command_at`` with ``--chunks`` overlapping chunks in flight (each blend), the
safety filter on a command no limit binds and on one that is clamped, and for scale the
loopback driver's read. Compare with the period: 2,000 µs at 500 Hz.

    python experiments/probes/tick_parts.py [--chunks 10] [--calls 5000]
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np

from hardware.control import ActionScheduler, SafetyFilter
from hardware.control.scheduler import Chunk
from hardware.drivers.base import DriverSpec


def per_call_us(fn, calls: int, repeats: int = 5) -> float:
    return float(np.median(timeit.repeat(fn, number=calls, repeat=repeats)) / calls * 1e6)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=10, help="overlapping chunks in flight")
    p.add_argument("--horizon", type=int, default=20)
    p.add_argument("--calls", type=int, default=5000)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for blend in ("ensemble", "rtc", "latest"):
        s = ActionScheduler(blend, max_chunks=args.chunks)
        for k in range(args.chunks):  # one chunk every 50 ms, each covering 1 s
            s.add(Chunk(rng.normal(size=(args.horizon, 6)), 0.05 * k, 0.05), 0.05 * k)
        t = 0.05 * (args.chunks - 1) + 0.013
        covering = len(s._covering(t))
        rows.append((f"scheduler.command_at, {blend}, {covering} chunks covering", per_call_us(lambda: s.command_at(t), args.calls)))
    spec = DriverSpec("arm", tuple(f"j{i}" for i in range(6)), -np.ones(6) * 3, np.ones(6) * 3, max_rate=5.0,
                      max_rate2=100.0, rate_hz=500.0, command_timeout=1.0)
    f = SafetyFilter(spec, 1 / 500)
    f.reset(np.zeros(6))
    free = np.zeros(6)
    rows.append(("safety filter, no limit binds", per_call_us(lambda: f(free), args.calls)))
    g = SafetyFilter(spec, 1 / 500)
    g.reset(np.zeros(6))
    far = np.full(6, 5.0)
    rows.append(("safety filter, clamped (position, velocity)", per_call_us(lambda: (g.reset(np.zeros(6)), g(far)), args.calls)))
    print("| part | µs per call |\n|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")
    print(f"summary: at 500 Hz the period is 2000 us; ensemble blend of {args.chunks} chunks {rows[0][1]:.0f} us, "
          f"unclamped safety {rows[3][1]:.0f} us per tick")


if __name__ == "__main__":
    main()
