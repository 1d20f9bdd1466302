"""Oracle success on every task over seeded episodes, beside random actions on the same seeds.

    python bench/oracles.py                    # 200 episodes per task/split, 2 workers
    python bench/oracles.py --episodes 50 --tasks PersonFollow-v0:dt ArmPickPlace-v0

Seeds are 0..N-1 for every task, so two runs print the same table. The anchor is a policy of
uniformly random actions (the action space seeded with the episode seed) on the same seeds: the
ratio column is the oracle's successes over the random policy's (with none, over one: a lower
bound, shown as ``>=``). Cameras are off: the
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


def _random_worker(job) -> list[bool]:
    """Success of uniformly random actions on each seed (the anchor)."""
    env_id, kwargs, seeds = job
    import gymnasium

    import sim_envs  # noqa: F401

    env = gymnasium.make(env_id, disable_env_checker=True, **kwargs)
    out = []
    try:
        for seed in seeds:
            env.reset(seed=seed)
            env.action_space.seed(seed)
            term = trunc = False
            while not (term or trunc):
                _obs, _r, term, trunc, info = env.step(env.action_space.sample())
            out.append(bool(info.get("is_success", False)))
    finally:
        env.close()
    return out


def ratio_to_random(oracle_wins: int, random_wins: int) -> str:
    """Oracle successes over random successes; with no random success, over one (a lower bound)."""
    return f"{oracle_wins / random_wins:.1f}x" if random_wins else f">= {oracle_wins:.0f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--noise", type=float, default=0.0)
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--json", help="also write the table as JSON here")
    parser.add_argument("--out", help="also write the run record OUT/summary.json")
    args = parser.parse_args()
    started = time.time()

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
            summary["random_successes"] = sum(sum(part) for part in pool.imap_unordered(
                _random_worker, [(env_id, kwargs, c) for c in chunks if c]))
            rows.append((name, summary))

    print(f"\nOracle success, {args.episodes} seeded episodes per task (noise {args.noise}):\n")
    print("| task | episodes | SR | TR | CR | mean steps to success | time (s) | first failed seeds | random SR | "
          "oracle / random |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for name, s in rows:
        def pct(key):
            return f"{100 * s[key]:.1f}%" if key in s else "—"
        steps = s.get("mean_steps_to_success")
        steps = f"{steps:.1f}" if isinstance(steps, float) else "—"
        print(f"| {name} | {s['episodes']} | {pct('success_rate')} | {pct('tracking_rate')} | "
              f"{pct('collision_rate')} | {steps} | {s['seconds']:.0f} | {s['failed_seeds']} | "
              f"{100 * s['random_successes'] / s['episodes']:.1f}% | "
              f"{ratio_to_random(round(s['success_rate'] * s['episodes']), s['random_successes'])} |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows), indent=2, default=float))
    if args.out:
        from robopolicy.utils.records import write_summary

        write_summary(args.out, kind="bench", config=vars(args), seeds=[0], episodes=args.episodes,
                      metrics=dict(rows), started_at=started, extra={"bench": "oracles"})
    worst = min(s["success_rate"] for _, s in rows)
    best_random = max(s["random_successes"] / s["episodes"] for _, s in rows)
    print(f"\noracles: {len(rows)} tasks, lowest success {100 * worst:.1f}%; random actions at most "
          f"{100 * best_random:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
