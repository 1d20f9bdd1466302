"""Batch-1 CPU latency of MPPI planning in a world model, against the base policy's own latency (the anchor).

    .venv/bin/python bench/world_mppi.py --base outputs/hg/base/final --world outputs/refine/world_model_point/final \\
        [--env robopolicy/PointReach-v0] [--calls 50] [--repeats 3] [--out outputs/bench/world_mppi]

On ``--calls`` observations of the env (one env, batch 1, one torch thread), times the base policy's
``predict`` alone and the planned policy's (the base's chunk, then MPPI over residual chunks around it),
interleaved call by call. Prints per repeat the median ms per chunk of each (wall, and the thread's CPU
time, which a loaded machine inflates less), the planner's own share (planned − base), and the ratio
planned / base; the figures are the median over ``--repeats``. The goal
is ≤ 20 ms per planned chunk. Writes ``<out>/summary.json``. Without ``--base`` the nominal is the world
model's policy prior, and the anchor is that prior's open-loop chunk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def timed(fn, *args) -> tuple[float, float]:
    """``(wall ms, this thread's CPU ms)`` of one call: on a shared machine the CPU time is the work
    itself, the wall time adds the waits for a core."""
    t0, c0 = time.perf_counter(), time.thread_time()
    fn(*args)
    return 1000.0 * (time.perf_counter() - t0), 1000.0 * (time.thread_time() - c0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", required=True, help="world-model checkpoint")
    parser.add_argument("--base", help="base policy checkpoint (default: none, the world model's policy prior)")
    parser.add_argument("--env", default="robopolicy/PointReach-v0")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="outputs/bench/world_mppi")
    parser.add_argument("overrides", nargs="*", metavar="mppi.key=value")
    args = parser.parse_args()
    started = time.time()

    import gymnasium
    import numpy as np
    import torch

    import sim_envs  # noqa: F401  (registers the tasks)
    from robopolicy.eval.policy_runner import to_policy_batch
    from robopolicy.models.loading import load_policy
    from robopolicy.utils.records import write_summary
    from robopolicy.world.model import WorldModel
    from robopolicy.world.plan import PlannedPolicy, check_base, mppi_config

    torch.set_num_threads(1)
    cfg = mppi_config(args.overrides)
    model = WorldModel.load(args.world)
    base = load_policy(args.base, "cpu").eval() if args.base else None
    if base is not None:
        check_base(base, model, args.base)
    planned = PlannedPolicy(model, cfg, base)
    env = gymnasium.make(args.env)
    obs_list = []
    for i in range(args.calls):
        obs, _ = env.reset(seed=i)
        batch = {k: np.asarray(v)[None] for k, v in obs.items()}
        batch.setdefault("task", [""])
        obs_list.append(to_policy_batch(batch))
    env.close()

    def anchor(obs):
        if base is not None:
            return base.predict(obs)
        return planned.planner.prior_chunk(model.encode(obs["observation.state"].float()), cfg.horizon)

    rows = []
    with torch.inference_mode():
        for obs in obs_list[:3]:  # warm-up
            anchor(obs), planned.predict(obs)
        for r in range(args.repeats):
            base_t, plan_t = [], []
            for obs in obs_list:
                base_t.append(timed(anchor, obs))
                plan_t.append(timed(planned.predict, obs))
            row = [statistics.median(t[i] for t in ts) for ts in (base_t, plan_t) for i in (0, 1)]
            rows.append(row)
            b, bc, p, pc = row
            print(f"repeat {r + 1}: base {b:.2f} ms (cpu {bc:.2f}), planned {p:.2f} ms (cpu {pc:.2f}), "
                  f"ratio {p / b:.1f}x (cpu {pc / bc:.1f}x)")
    b, bc, p, pc = (statistics.median(x[i] for x in rows) for i in range(4))
    load = os.getloadavg()[0]
    print(f"median of {args.repeats}: base {b:.2f} ms per chunk (cpu {bc:.2f}), planned {p:.2f} ms per chunk "
          f"(cpu {pc:.2f}), ratio {p / b:.1f}x (cpu {pc / bc:.1f}x); goal: planned <= 20 ms; load average {load:.1f}")
    metrics = {"base_ms": b, "planned_ms": p, "planner_ms": p - b, "ratio": p / b, "base_cpu_ms": bc,
               "planned_cpu_ms": pc, "cpu_ratio": pc / bc, "load_average": load,
               "repeats_ms": rows, "samples": cfg.samples, "iterations": cfg.iterations,
               "horizon": int(planned.predict(obs_list[0]).shape[1]), "goal_ms": 20.0}
    write_summary(args.out, kind="bench", config={**vars(args), "mppi": vars(cfg)}, started_at=started,
                  metrics=metrics, extra={"bench": "world_mppi"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
