"""Rollouts on Ray actors against the local worker processes, side by side in one run.

    python bench/scale_backends.py [--workers 2] [--repeats 3] [--episodes 8] [--out DIR]

Evaluation: ``robopolicy eval`` with ``backend: local`` (gymnasium AsyncVectorEnv worker
processes, the policy batched in this process) and ``backend: ray`` (one Ray worker per env, each
with a copy of the policy running whole episodes), ArmReach with its two cameras, a
state-feedback chunk policy; env steps/s. Collection: ``robopolicy collect`` with ``workers``
oracle processes against ``workers`` Ray actors, ArmReach state-only; frames/s.

Each timed run creates its worker processes or actors, and its time counts their start. A Ray
worker that runs a torch policy imports torch when it starts, which the local workers (envs only;
the policy runs in this process) never do, so the evaluation reports two rates: with the start
counted, and once the workers run (``env_steps / (seconds - start_seconds)``; the start is the
local env processes' or the Ray workers' loading the policy and building their env). The backends
alternate within each repeat; the table gives the median of the repeats and the ratio ray / local
(the goal: >= 0.9x at 2 workers). Ray itself starts once before the timed runs (a one-off cost of
a session). The record keeps every run and the load average before and after each repeat (the
machine may be shared).
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


def eval_run(backend: str, workers: int, episodes: int, image_size: int, out: str) -> dict:
    """Env steps, seconds and the workers' start seconds of one evaluation run."""
    from robopolicy.envs import EnvConfig
    from robopolicy.eval import EvalConfig, evaluate

    cfg = EvalConfig(env=EnvConfig("robopolicy/ArmReach-v0", {"max_steps": 50}), episodes=episodes, workers=workers,
                     videos=0, image_size=image_size, progress=False, backend=backend, threads=1, out=out)
    split = evaluate(FeedbackPolicy(), cfg, log=lambda m: None, save=False).splits[0]
    return {"env_steps": split.env_steps, "seconds": split.seconds, "start_seconds": split.start_seconds}


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
    parser.add_argument("--only", choices=("eval", "collect"), help="time one of the two rollouts")
    parser.add_argument("--image-size", type=int, default=64, help="camera size of the evaluated env")
    parser.add_argument("--ray-address", default=None, help="a Ray cluster (default: Ray on this machine)")
    parser.add_argument("--out", help="also write the run record OUT/summary.json")
    args = parser.parse_args()
    started = time.time()

    import ray

    import sim_envs  # noqa: F401

    ray.init(address=args.ray_address, include_dashboard=False)
    runs: dict[str, dict[str, list]] = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for backend in (("local", "ray") if rep % 2 == 0 else ("ray", "local")):
                if args.only != "collect":
                    run = eval_run(backend, args.workers, args.episodes, args.image_size, f"{tmp}/eval")
                    rate = run["env_steps"] / run["seconds"]
                    steady = run["env_steps"] / max(run["seconds"] - run["start_seconds"], 1e-9)
                    runs.setdefault("eval", {}).setdefault(backend, []).append(rate)
                    runs.setdefault("eval_steady", {}).setdefault(backend, []).append(steady)
                    runs.setdefault("eval_runs", {}).setdefault(backend, []).append(run)
                    print(f"  repeat {rep + 1} eval    {backend:<5} {rate:8.1f} env steps/s, {steady:.1f} once started "
                          f"({run['env_steps']} steps in {run['seconds']:.1f} s, start {run['start_seconds']:.1f} s)",
                          flush=True)
                if args.only != "eval":
                    r = collect_rate(backend, args.workers, args.episodes, f"{tmp}/collect_{backend}_{rep}")
                    runs.setdefault("collect", {}).setdefault(backend, []).append(r)
                    print(f"  repeat {rep + 1} collect {backend:<5} {r:8.1f} frames/s", flush=True)
            load.append(os.getloadavg()[0])
            print(f"  load average (1 min) {load[-1]:.1f}", flush=True)
    ray.shutdown()

    print(f"\nRay actors vs local worker processes, {args.workers} workers, median of {args.repeats}:\n")
    print("| rollout | local | ray | ray / local |")
    print("|---|---:|---:|---:|")
    metrics: dict = {}
    units = {"eval": "env steps/s, start counted", "eval_steady": "env steps/s once started", "collect": "frames/s"}
    for what, unit in units.items():
        if what not in runs:
            continue
        local, remote = (statistics.median(runs[what][b]) for b in ("local", "ray"))
        metrics[what] = {"local": local, "ray": remote, "ratio": remote / local, "unit": unit, "runs": runs[what]}
        print(f"| {what} ({unit}) | {local:.1f} | {remote:.1f} | {remote / local:.2f}× |")
    if "eval_runs" in runs:
        metrics["eval_runs"] = runs["eval_runs"]  # env steps, seconds and start seconds of every run
    print(f"\nload average (1 min) before and after each repeat: {', '.join(f'{x:.1f}' for x in load)}")
    metrics["load_average_1min"] = load
    if args.out:
        from robopolicy.utils.records import write_summary

        write_summary(args.out, kind="bench", config=vars(args), started_at=started,
                      episodes=args.episodes, extra={"bench": "scale_backends", "ray_version": ray.__version__},
                      metrics=metrics)
    return 0


if __name__ == "__main__":
    sys.exit(main())
