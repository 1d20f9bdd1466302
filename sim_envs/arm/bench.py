"""Throughput and oracle benchmarks for the arm tasks.

    MUJOCO_GL=egl taskset -c 0 python -m sim_envs.arm.bench speed [--steps 2000]
    python -m sim_envs.arm.bench oracle --task pickplace --episodes 200 [--action-mode ee_delta]

``speed`` steps each task with random actions (like gymnasium's Pusher-v5, measured side by
side), state-only and with 96×96 front+wrist images. ``oracle`` reports the oracle's success
rate and mean steps to success over seeds 0..N-1.
"""

from __future__ import annotations

import argparse
import time

import gymnasium
import numpy as np

import sim_envs  # noqa: F401  (registers the tasks)
from sim_envs.core import make_oracle

IDS = {
    "reach": "robopolicy/ArmReach-v0",
    "push": "robopolicy/ArmPushCube-v0",
    "pickplace": "robopolicy/ArmPickPlace-v0",
}


def steps_per_second(env: gymnasium.Env, steps: int, seed: int = 0) -> float:
    env.action_space.seed(seed)
    actions = [env.action_space.sample() for _ in range(100)]
    env.reset(seed=seed)
    t0 = time.perf_counter()
    for k in range(steps):
        _, _, terminated, truncated, _ = env.step(actions[k % 100])
        if terminated or truncated:
            env.reset()
    return steps / (time.perf_counter() - t0)


def speed(steps: int, action_mode: str) -> None:
    try:
        pusher = gymnasium.make("Pusher-v5")
        print(f"Pusher-v5 (random actions): {steps_per_second(pusher, steps):8.0f} steps/s")
    except Exception as exc:  # pragma: no cover - Pusher needs gymnasium[mujoco]
        print(f"Pusher-v5 unavailable: {exc}")
    for task, env_id in IDS.items():
        state_only = steps_per_second(gymnasium.make(env_id, use_cameras=False, action_mode=action_mode), steps)
        images = steps_per_second(gymnasium.make(env_id, action_mode=action_mode), max(steps // 4, 100))
        print(f"{task:10s} {action_mode}: state-only {state_only:8.0f} steps/s | 96x96 front+wrist {images:6.0f} steps/s")


def oracle(task: str, episodes: int, action_mode: str, noise: float, split: str | None) -> None:
    kwargs = {"use_cameras": False, "action_mode": action_mode}
    if split is not None:
        kwargs["split"] = split
    env = gymnasium.make(IDS[task], **kwargs)
    orc = make_oracle(env, noise=noise, seed=0)
    successes, lengths = [], []
    t0 = time.perf_counter()
    n_steps = 0
    for seed in range(episodes):
        obs, info = env.reset(seed=seed)
        orc.reset(obs, info)
        while True:
            obs, _, terminated, truncated, info = env.step(orc.act(obs, info).action)
            n_steps += 1
            if terminated or truncated:
                break
        m = info["episode_metrics"]
        successes.append(m["success"])
        if m["success"]:
            lengths.append(m["steps"])
        else:
            print(f"  seed {seed} failed: {info['task']!r} final distance {m['final_distance']:.3f}")
    print(
        f"{task} {action_mode} noise={noise} split={split}: success {np.mean(successes):.3f} "
        f"({sum(successes)}/{episodes}), mean steps {np.mean(lengths) if lengths else float('nan'):.1f}, "
        f"{n_steps / (time.perf_counter() - t0):.0f} steps/s incl. oracle"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["speed", "oracle"])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--task", choices=list(IDS), default="pickplace")
    p.add_argument("--episodes", type=int, default=100)
    p.add_argument("--action-mode", choices=["joint", "ee_delta"], default="joint")
    p.add_argument("--noise", type=float, default=0.0)
    p.add_argument("--split", choices=["train", "test", "all"], default=None)
    a = p.parse_args()
    if a.what == "speed":
        speed(a.steps, a.action_mode)
    else:
        oracle(a.task, a.episodes, a.action_mode, a.noise, a.split)


if __name__ == "__main__":
    main()
