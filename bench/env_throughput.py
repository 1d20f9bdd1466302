"""Env steps per second on one core, side by side with gymnasium's Pusher-v5.

    python bench/env_throughput.py [--steps 2000] [--image-size 96]

Each env runs single-process with random actions (resetting at episode end); the ratio
column is steps/s divided by Pusher-v5's steps/s measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MUJOCO_GL", "egl")


def measure(make, steps: int, warmup: int = 50) -> float:
    env = make()
    env.action_space.seed(0)
    env.reset(seed=0)
    for _ in range(warmup):
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        if term or trunc:
            env.reset()
    t0 = time.perf_counter()
    for _ in range(steps):
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        if term or trunc:
            env.reset()
    rate = steps / (time.perf_counter() - t0)
    env.close()
    return rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--out", help="also write the run record OUT/summary.json")
    args = parser.parse_args()
    started = time.time()

    try:  # one core, as the goals are stated per core
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    except (AttributeError, OSError):
        pass
    import gymnasium

    import sim_envs  # noqa: F401

    size = args.image_size
    cases = [
        ("Pusher-v5 (gymnasium, state)", lambda: gymnasium.make("Pusher-v5"), None),
    ]
    for task in ("ArmReach-v0", "ArmPushCube-v0", "ArmPickPlace-v0"):
        env_id = f"robopolicy/{task}"
        cases.append((f"{task} state-only", lambda e=env_id: gymnasium.make(e, use_cameras=False), 1.0))
        cases.append((f"{task} front+wrist {size}px",
                      lambda e=env_id: gymnasium.make(e, image_size=size), None))
    for split in ("stt", "dt"):
        cases.append((f"PersonFollow-v0[{split}] no camera",
                      lambda s=split: gymnasium.make("robopolicy/PersonFollow-v0", split=s, camera=False), None))
        cases.append((f"PersonFollow-v0[{split}] front {size}px",
                      lambda s=split: gymnasium.make("robopolicy/PersonFollow-v0", split=s, image_size=size), None))

    results = []
    for name, make, _ in cases:
        rate = measure(make, args.steps)
        results.append((name, rate))
        print(f"  {name:<40} {rate:8.0f} steps/s", flush=True)
    pusher = results[0][1]
    print(f"\nSteps per second on one core ({args.steps} steps each, random actions):\n")
    print("| env | steps/s | ratio to Pusher-v5 |")
    print("|---|---:|---:|")
    for name, rate in results:
        print(f"| {name} | {rate:.0f} | {rate / pusher:.2f}× |")
    print(f"\nenv_throughput: Pusher-v5 {pusher:.0f} steps/s; "
          f"slowest robopolicy env {min(r for _, r in results[1:]):.0f} steps/s")
    if args.out:
        from robopolicy.utils.records import write_summary

        write_summary(args.out, kind="bench", config=vars(args), started_at=started, extra={"bench": "env_throughput"},
                      metrics={name: {"steps_per_s": rate, "ratio_to_pusher": rate / pusher} for name, rate in results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
