"""One checkpoint, the same seeds, two ways: the gymnasium evaluation vs the real-time node.

Gym: ``robopolicy.eval.evaluate`` steps the env synchronously, one chunk step (arm) or one
waypoint decision (base) per env step. Node: the same scenes (env seed = episode seed) in the
simulated driver, stepped in real time in its own process, driven by the ``ControlNode`` from a
policy worker process over the ZeroMQ link, exactly as on hardware.

Arm (``ArmPickPlace-v0`` or any arm task, ``SimArmDriver`` at 500 Hz): chunks are
latency-compensated, ensembled and interpolated; an episode succeeds when the task's success
condition holds for ``--hold`` seconds before ``max_steps * dt`` of wall time has passed.

Base (``PersonFollow-v0``, ``--split``, ``SimBaseDriver`` at 50 Hz): the worker's waypoints are
followed by pure pursuit at the control rate while the people walk on in real time; the episode
ends as the env ends it (success, collision, target lost, time limit) and its success, tracking
rate and collision come from the env's own episode metrics, as in the gymnasium evaluation.

    python bench/node_vs_gym.py --checkpoint outputs/train/arm_chunk_l1/final \
        --env robopolicy/ArmPickPlace-v0 --episodes 20
    python bench/node_vs_gym.py --checkpoint outputs/train/track_stage3/final \
        --env robopolicy/PersonFollow-v0 --split dt --episodes 60

The issue's goal: the node's success rate within 5 points of the gymnasium evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def gym_eval(args) -> list[bool]:
    from robopolicy.envs import EnvConfig
    from robopolicy.eval import EvalConfig
    from robopolicy.eval.rollout import evaluate
    from robopolicy.models.loading import load_policy

    policy = load_policy(args.checkpoint)
    cfg = EvalConfig(checkpoint=args.checkpoint, env=EnvConfig(args.env), episodes=args.episodes,
                     workers=args.workers, seed=args.seed, videos=0, threads=1, progress=True,
                     out=str(Path(args.out) / "gym"))
    if args.base:
        cfg.splits = [args.split]
    else:
        cfg.chunk.mode = args.chunk_mode
    report = evaluate(policy, cfg)
    return [_metrics(e.get("episode_metrics") or e) for e in report.splits[0].episodes]


TRACKING_KEYS = ("following_steps", "steps", "reference_steps", "tracking_rate", "collision", "lost")


def _metrics(m: dict) -> dict:
    """success (+ the env's episode metrics for tracking episodes) of one episode."""
    out = {"success": bool(m.get("success"))}
    if "tracking_rate" in m:
        out.update({k: m[k] for k in TRACKING_KEYS if k in m})
    return out


def node_episode(args, seed: int, endpoint: str, max_s: float) -> dict:
    """One episode on the simulated driver the robot config names, driven by the node from the
    running worker at ``endpoint``."""
    from robopolicy.config import build, load_yaml
    from robopolicy.deploy.run import RunConfig, build_node

    robot = load_yaml(args.robot)
    kw = robot["driver"]["kwargs"]
    kw.update({"env_id": args.env, "seed": seed})
    if args.base:  # one episode, this split
        kw["env_kwargs"] = {**(kw.get("env_kwargs") or {}), "split": args.split}
        kw["auto_reset"] = False
    else:
        cams, scene = args.needs  # a state-based checkpoint: no cameras, the scene state on
        if not cams:
            kw["cameras"] = False
        if scene:
            kw["env_kwargs"] = {**(kw.get("env_kwargs") or {}), "env_state": True}
    robot["transport"] = {**robot.get("transport", {}), "endpoint": endpoint, "spawn_worker": False}
    cfg = build(RunConfig, {"robot": robot, "policy": args.checkpoint, "status": False}, args.robot)
    driver, node = build_node(cfg)
    driver.connect()
    t0 = time.monotonic()
    try:
        node.start()
        row = (_base_loop if args.base else _arm_loop)(args, driver, node, t0, max_s)
        timing = node.report()["timing"]
    finally:
        node.close()
        driver.disconnect()
    row.update(seed=seed, seconds=time.monotonic() - t0, p99_lateness_us=timing["lateness_us"]["p99"],
               missed=timing["missed_deadlines"])
    return row


def _fault(node) -> str | None:
    return f"{node.fault.code}: {node.fault.reason}" if node.fault is not None else None


def _arm_loop(args, driver, node, t0: float, max_s: float) -> dict:
    """Success once the task's condition holds for ``--hold`` s; the clock starts with the first
    chunk (model warm-up), the arm holding still until then."""
    held_since, t_first = None, None
    while time.monotonic() - t0 < max_s + args.startup_s:
        time.sleep(0.01)
        if node.fault is not None:
            return {"success": False, "fault": _fault(node)}
        if not node._got_first_chunk:
            continue
        if t_first is None:
            t_first = time.monotonic()
        if time.monotonic() - t_first > max_s:
            break
        if driver.task_info().get("is_success"):
            held_since = held_since or time.monotonic()
            if time.monotonic() - held_since >= args.hold:
                return {"success": True, "fault": None}
        else:
            held_since = None
    return {"success": False, "fault": None}


def _base_loop(args, driver, node, t0: float, max_s: float) -> dict:
    """A PersonFollow episode on ``SimBaseDriver`` runs from ``connect()`` (the people walk from
    then on, as they would for a real robot) until the env ends it; its metrics are the env's."""
    metrics, first_chunk_s = None, None
    while time.monotonic() - t0 < max_s + args.startup_s:
        time.sleep(0.01)
        if first_chunk_s is None and node._got_first_chunk:
            first_chunk_s = time.monotonic() - t0
        if node.fault is not None:
            break
        episodes = driver.task_info()["episodes"]
        if episodes:
            metrics = episodes[0]
            break
    row = _metrics(metrics or {})
    row.update(fault=_fault(node), finished=metrics is not None, first_chunk_s=first_chunk_s)
    return row


def wait_for_worker(endpoint: str, timeout: float = 180.0) -> float:
    """Seconds until the worker answers a ping: it has loaded the checkpoint (and its language
    model), so no episode starts while the worker is still starting up."""
    from hardware.transport import Message, PolicyClient

    client, t0 = PolicyClient(endpoint), time.monotonic()
    try:
        while time.monotonic() - t0 < timeout:
            client.send(Message("ping", 0, time.monotonic()))
            for _ in range(50):
                time.sleep(0.01)
                if any(m.kind == "pong" for m in client.poll()):
                    return time.monotonic() - t0
        raise RuntimeError(f"the policy worker did not answer within {timeout:.0f} s")
    finally:
        client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--env", default="robopolicy/ArmPickPlace-v0")
    p.add_argument("--robot", default=None, help="default: configs/robots/sim_base.yaml for PersonFollow, "
                   "else configs/robots/sim_arm.yaml")
    p.add_argument("--split", default="dt", help="PersonFollow split")
    p.add_argument("--episodes", type=int, default=20)
    p.add_argument("--seed", type=int, default=100_000)
    p.add_argument("--workers", type=int, default=2, help="env workers of the gym evaluation")
    p.add_argument("--chunk-mode", default="ensemble", choices=["chunk", "ensemble"],
                   help="gym chunk execution (the node ensembles)")
    p.add_argument("--hold", type=float, default=0.15, help="seconds the success condition must hold")
    p.add_argument("--startup-s", type=float, default=60.0, help="allowance for the first chunk")
    p.add_argument("--skip-gym", action="store_true")
    p.add_argument("--out", default="outputs/bench/node_vs_gym")
    args = p.parse_args()
    started = time.time()
    args.base = "PersonFollow" in args.env
    if args.robot is None:
        args.robot = f"configs/robots/{'sim_base' if args.base else 'sim_arm'}.yaml"

    import gymnasium

    import sim_envs  # noqa: F401

    from robopolicy.eval.rollout import observation_needs
    from robopolicy.models.loading import load_policy
    from sim_envs.arm import so101

    args.needs = observation_needs(load_policy(args.checkpoint))
    if args.base:
        from sim_envs.person_follow import env as pf_env

        env = gymnasium.make(args.env, camera=False)
        max_s = float(env.unwrapped.max_steps) * pf_env.DT
    else:
        env = gymnasium.make(args.env, use_cameras=False)
        max_s = float(env.unwrapped.max_episode_steps) * so101.CONTROL_DT  # the env's own time limit
    env.close()

    gym = None if args.skip_gym else gym_eval(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rp-e2e-") as wd:
        endpoint = f"ipc://{wd}/policy.sock"
        worker = subprocess.Popen([sys.executable, "-m", "robopolicy.deploy.worker", "--endpoint", endpoint,
                                   "--policy", args.checkpoint, "--parent-pid", str(os.getpid())])
        try:
            print(f"[node] worker ready after {wait_for_worker(endpoint):.1f} s", flush=True)
            for i in range(args.episodes):
                row = node_episode(args, args.seed + i, endpoint, max_s)
                rows.append(row)
                extra = f", TR {row['tracking_rate']:.2f}, collision {row['collision']}" if "tracking_rate" in row else ""
                print(f"[node] seed {row['seed']}: {'success' if row['success'] else 'fail'}{extra} "
                      f"({row['seconds']:.1f}s, p99 late {row['p99_lateness_us']:.0f} us, missed {row['missed']}"
                      f"{', fault ' + row['fault'] if row['fault'] else ''})", flush=True)
        finally:
            worker.terminate()
            worker.wait(10)
    node_sr = float(np.mean([r["success"] for r in rows]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"checkpoint": args.checkpoint, "env": args.env, "seeds": [args.seed, args.seed + args.episodes - 1],
              "node": rows, "node_success": node_sr}
    if args.base:
        result["split"] = args.split
    table = [("gymnasium eval", gym)] if gym is not None else []
    table.append(("control node, real time", rows))
    from sim_envs.person_follow import summarize_episodes

    if args.base:
        print("\n| path | episodes | SR | TR | CR |\n|------|----------|----|----|----|")
    else:
        print("\n| path | episodes | success |\n|------|----------|---------|")
    for name, eps in table:
        sr = 100 * np.mean([e["success"] for e in eps])
        if args.base:  # pooled as robopolicy eval pools them; an episode that never finished counts as failed
            pooled = summarize_episodes([e for e in eps if "following_steps" in e])
            print(f"| {name} | {len(eps)} | {sr:.1f}% | {100 * pooled['tracking_rate']:.1f}% | "
                  f"{100 * sum(e.get('collision', False) for e in eps) / len(eps):.1f}% |")
        else:
            print(f"| {name} | {len(eps)} | {sr:.0f}% |")
    if gym is not None:
        result["gym"] = gym
        result["gym_success"] = float(np.mean([e["success"] for e in gym]))
        both = sum(g["success"] and r["success"] for g, r in zip(gym, rows))
        ratio = f"{node_sr / result['gym_success']:.2f}" if result["gym_success"] > 0 else "- (gymnasium 0%)"
        print(f"ratio node / gymnasium success: {ratio}; difference: {100 * (node_sr - result['gym_success']):+.1f} pts "
              f"(goal: within 5); {both} succeed both ways")
    (out / "node_vs_gym.json").write_text(json.dumps(result, indent=2))
    from robopolicy.utils.records import write_summary

    write_summary(out, kind="bench", config={k: v for k, v in vars(args).items() if k != "needs"}, seeds=[args.seed],
                  episodes=args.episodes, started_at=started, extra={"bench": "node_vs_gym", "checkpoint": args.checkpoint},
                  metrics={k: result[k] for k in ("node_success", "gym_success") if k in result})


if __name__ == "__main__":
    main()
