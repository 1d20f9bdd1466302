"""Oracle success on every task over seeded episodes, as a table.

    python bench/oracles.py                    # 200 episodes per task/split, 2 workers
    python bench/oracles.py --episodes 50 --tasks PersonFollow-v0:dt ArmPickPlace-v0

Seeds are 0..N-1 for every task, so two runs print the same table. Cameras are off: the
oracles act on privileged state, and PersonFollow judges visibility by ray casts against the
scene whether or not a camera image is rendered, so the metrics are the same.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MUJOCO_GL", "egl")

TASKS = {
    "PersonFollow-v0:stt": ("robopolicy/PersonFollow-v0", {"split": "stt", "camera": False}),
    "PersonFollow-v0:dt": ("robopolicy/PersonFollow-v0", {"split": "dt", "camera": False}),
    "PersonFollow-v0:at": ("robopolicy/PersonFollow-v0", {"split": "at", "camera": False}),
    "ArmReach-v0": ("robopolicy/ArmReach-v0", {"use_cameras": False}),
    "ArmPushCube-v0": ("robopolicy/ArmPushCube-v0", {"use_cameras": False}),
    "ArmPickPlace-v0": ("robopolicy/ArmPickPlace-v0", {"use_cameras": False}),
}


def _worker(job):
    env_id, kwargs, seeds, noise = job
    import gymnasium

    import sim_envs  # noqa: F401
    from sim_envs.rollout import run_oracle_episode

    env = gymnasium.make(env_id, disable_env_checker=True, **kwargs)
    try:
        return [run_oracle_episode(env, seed=s, noise=noise) for s in seeds]
    finally:
        env.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--noise", type=float, default=0.0)
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--json", help="also write the table as JSON here")
    args = parser.parse_args()

    from sim_envs.rollout import summarize
    from tqdm import tqdm

    rows = []
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.workers) as pool:
        for name in args.tasks:
            env_id, kwargs = TASKS[name]
            seeds = list(range(args.episodes))
            chunks = [seeds[i::args.workers * 4] for i in range(args.workers * 4)]
            jobs = [(env_id, kwargs, c, args.noise) for c in chunks if c]
            t0 = time.perf_counter()
            results = []
            with tqdm(total=len(seeds), desc=name, unit="ep", leave=False) as bar:
                for part in pool.imap_unordered(_worker, jobs):
                    results.extend(part)
                    bar.update(len(part))
            summary = summarize(env_id, sorted(results, key=lambda r: r.seed))
            summary["seconds"] = time.perf_counter() - t0
            summary["failed_seeds"] = sorted(r.seed for r in results if not r.success)[:10]
            rows.append((name, summary))

    print(f"\nOracle success, {args.episodes} seeded episodes per task (noise {args.noise}):\n")
    print("| task | episodes | SR | TR | CR | mean steps to success | time (s) | first failed seeds |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, s in rows:
        def pct(key):
            return f"{100 * s[key]:.1f}%" if key in s else "—"
        steps = s.get("mean_steps_to_success")
        steps = f"{steps:.1f}" if isinstance(steps, float) else "—"
        print(f"| {name} | {s['episodes']} | {pct('success_rate')} | {pct('tracking_rate')} | "
              f"{pct('collision_rate')} | {steps} | {s['seconds']:.0f} | {s['failed_seeds']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows), indent=2, default=float))
    worst = min(s["success_rate"] for _, s in rows)
    print(f"\noracles: {len(rows)} tasks, lowest success {100 * worst:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
