"""Rollouts on Ray actors against the local worker processes, side by side in one run.

    python bench/scale_backends.py [--workers 2] [--repeats 3] [--episodes 8] [--out DIR]

Evaluation: ``robopolicy eval``'s loop with ``backend: local`` (gymnasium AsyncVectorEnv worker
processes) and ``backend: ray`` (one Ray actor per env), ArmReach with its two cameras, a
state-feedback chunk policy in this process; env steps/s. Collection: ``robopolicy collect``
with ``workers`` oracle processes against ``workers`` Ray actors, ArmReach state-only; frames/s.
The backends alternate within each repeat; the table gives the median of the repeats and the
ratio ray / local (the goal: >= 0.9x at 2 workers). Ray starts once before the timed runs (its
start-up is a one-off cost of a session, not of a rollout); each timed run creates its actors
or processes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class FeedbackPolicy:
    """A chunk computed from the state (no network: the bench times the envs and their transport)."""

    kind = "action"

    def predict(self, obs):
        import torch

        state = obs["observation.state"].reshape(len(obs["task"]), -1).float()
        return torch.tanh(state[:, :6] * 3.0)[:, None].expand(-1, 4, -1).clone()

    def reset(self, rows=None):
        pass


def eval_rate(backend: str, workers: int, episodes: int, image_size: int, out: str) -> float:
    from robopolicy.envs import EnvConfig
    from robopolicy.eval import EvalConfig, evaluate

    cfg = EvalConfig(env=EnvConfig("robopolicy/ArmReach-v0", {"max_steps": 50}), episodes=episodes, workers=workers,
                     videos=0, image_size=image_size, progress=False, backend=backend, threads=1, out=out)
    split = evaluate(FeedbackPolicy(), cfg, log=lambda m: None, save=False).splits[0]
    return split.steps_per_s


def collect_rate(backend: str, workers: int, episodes: int, out: str) -> float:
    from robopolicy.data.collect import CollectConfig, collect
    from robopolicy.envs import EnvConfig

    cfg = CollectConfig(env=EnvConfig("robopolicy/ArmReach-v0", {"use_cameras": False}), episodes=episodes,
                        workers=workers, backend=backend, out=out, progress=False)
    return collect(cfg, log=lambda m: None).frames_per_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=8, help="episodes per timed run")
    parser.add_argument("--image-size", type=int, default=64, help="camera size of the evaluated env")
    parser.add_argument("--ray-address", default=None, help="a Ray cluster (default: Ray on this machine)")
    parser.add_argument("--out", help="also write the run record OUT/summary.json")
    args = parser.parse_args()
    started = time.time()

    import ray

    import sim_envs  # noqa: F401

    ray.init(address=args.ray_address, include_dashboard=False)
    rates: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for backend in (("local", "ray") if rep % 2 == 0 else ("ray", "local")):
                r = eval_rate(backend, args.workers, args.episodes, args.image_size, f"{tmp}/eval")
                rates.setdefault(("eval", backend), []).append(r)
                print(f"  repeat {rep + 1} eval    {backend:<5} {r:8.0f} env steps/s", flush=True)
                r = collect_rate(backend, args.workers, args.episodes, f"{tmp}/collect_{backend}_{rep}")
                rates.setdefault(("collect", backend), []).append(r)
                print(f"  repeat {rep + 1} collect {backend:<5} {r:8.0f} frames/s", flush=True)
    ray.shutdown()

    print(f"\nRay actors vs local worker processes, {args.workers} workers, median of {args.repeats}:\n")
    print("| rollout | local | ray | ray / local |")
    print("|---|---:|---:|---:|")
    metrics = {}
    for what, unit in (("eval", "env steps/s"), ("collect", "frames/s")):
        local, remote = (statistics.median(rates[(what, b)]) for b in ("local", "ray"))
        metrics[what] = {"local": local, "ray": remote, "ratio": remote / local, "unit": unit,
                         "runs": {b: rates[(what, b)] for b in ("local", "ray")}}
        print(f"| {what} ({unit}) | {local:.0f} | {remote:.0f} | {remote / local:.2f}× |")
    if args.out:
        from robopolicy.utils.records import write_summary

        write_summary(args.out, kind="bench", config=vars(args), started_at=started, extra={"bench": "scale_backends"},
                      metrics=metrics)
    return 0


if __name__ == "__main__":
    sys.exit(main())
