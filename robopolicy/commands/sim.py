"""``robopolicy sim``: look at the simulated tasks through their oracles.

    robopolicy sim list
    robopolicy sim view robopolicy/PersonFollow-v0 --split dt --video out.mp4
    robopolicy sim demo --config configs/sim/demo.yaml
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from robopolicy.config import load_config
from robopolicy.envs import EnvConfig, make_env


@dataclass
class SimViewConfig:
    """One oracle episode of one task rendered to video, with its metrics printed."""

    env: EnvConfig = field(default_factory=EnvConfig)
    seed: int = 0
    noise: float = 0.0
    video: str | None = "outputs/sim_view.mp4"


@dataclass
class SimDemoConfig:
    """An oracle episode of each listed task, each rendered to ``out/<task>.mp4``."""

    tasks: list[EnvConfig] = field(default_factory=lambda: [EnvConfig()])
    seed: int = 0
    noise: float = 0.0
    out: str = "outputs/sim_demo"


def add_parser(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser("sim", help="simulated tasks: list, view an oracle episode, demo all tasks")
    simsub = sim.add_subparsers(dest="sim_command", metavar="SIM_COMMAND")
    simsub.required = True

    p = simsub.add_parser("list", help="list the registered robopolicy tasks")
    p.set_defaults(func=cmd_list)

    p = simsub.add_parser("view", help="render one oracle episode (egocentric + top-down) to mp4")
    p.add_argument("env_id", nargs="?", help="task id, e.g. robopolicy/PersonFollow-v0, or module:EnvId")
    p.add_argument("--split", help="PersonFollow split: stt, dt or at")
    p.add_argument("--seed", type=int)
    p.add_argument("--noise", type=float, help="DART noise on the oracle's executed actions")
    p.add_argument("--video", help="output mp4 path")
    p.add_argument("--config", help="YAML config (SimViewConfig)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_view)

    p = simsub.add_parser("demo", help="an oracle episode of every task in the config, to mp4, with metrics")
    p.add_argument("--config", default=None, help="YAML config (SimDemoConfig), e.g. configs/sim/demo.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_demo)


def cmd_list(args: argparse.Namespace) -> int:
    import sim_envs

    for env_id in sim_envs.ENV_IDS:
        print(env_id)
    return 0


def _view_overrides(args: argparse.Namespace) -> list[str]:
    out = []
    if args.env_id and "=" in args.env_id:  # no env id given: the first override landed here
        args.overrides = [args.env_id, *args.overrides]
        args.env_id = None
    if args.env_id:
        out.append(f"env.id={args.env_id}")
    if args.split:
        out.append(f"env.kwargs.split={args.split}")
    if args.seed is not None:
        out.append(f"seed={args.seed}")
    if args.noise is not None:
        out.append(f"noise={args.noise}")
    if args.video:
        out.append(f"video={args.video}")
    return out + list(args.overrides)


def _format_metrics(metrics: dict) -> str:
    parts = []
    for key, value in metrics.items():
        if isinstance(value, float):
            parts.append(f"{key}={value:.3f}")
        elif isinstance(value, (int, bool, str)):
            parts.append(f"{key}={value}")
    return " ".join(parts)


def _run_one(env_cfg: EnvConfig, seed: int, noise: float, video: str | None) -> dict:
    from sim_envs.rollout import run_oracle_episode

    from robopolicy.utils.video import write_mp4

    env = make_env(env_cfg)
    try:
        result = run_oracle_episode(env, seed=seed, noise=noise, render=video is not None)
        fps = env.metadata.get("render_fps", 10)
    finally:
        env.close()
    row = {
        "task": env_cfg.label(),
        "seed": seed,
        "instruction": result.task,
        "steps": result.steps,
        "success": result.success,
        "seconds": round(result.seconds, 2),
        "metrics": {k: v for k, v in result.episode_metrics.items() if isinstance(v, (int, float, bool, str))},
    }
    if video is not None:
        row["video"] = str(write_mp4(video, result.frames, fps))
    return row


def cmd_view(args: argparse.Namespace) -> int:
    cfg = load_config(SimViewConfig, args.config, _view_overrides(args))
    row = _run_one(cfg.env, cfg.seed, cfg.noise, cfg.video)
    print(f"task: {row['instruction']!r}")
    print(f"metrics: {_format_metrics(row['metrics'])}")
    where = f", video {row['video']}" if "video" in row else ""
    print(f"{row['task']} seed {cfg.seed}: {'success' if row['success'] else 'failure'} "
          f"in {row['steps']} steps ({row['seconds']:.1f}s){where}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    cfg = load_config(SimDemoConfig, args.config, args.overrides)
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = []
    for env_cfg in cfg.tasks:
        name = env_cfg.label().replace("[", "_").replace("]", "")
        print(f"[sim demo] {env_cfg.label()}: rolling out the oracle ...", flush=True)
        rows.append(_run_one(env_cfg, cfg.seed, cfg.noise, str(out_dir / f"{name}.mp4")))
    header = f"| {'task':<22} | {'result':<7} | {'steps':>5} | key metrics"
    print()
    print(header)
    print("|" + "-" * 24 + "|" + "-" * 9 + "|" + "-" * 7 + "|" + "-" * 40)
    for row in rows:
        m = row["metrics"]
        keys = [k for k in ("tracking_rate", "following_steps", "final_distance", "collision", "lost",
                            "steps_to_success", "final_error") if k in m]
        extra = _format_metrics({k: m[k] for k in keys}) or _format_metrics(m)
        print(f"| {row['task']:<22} | {'success' if row['success'] else 'FAIL':<7} | {row['steps']:>5} | {extra}")
    (out_dir / "metrics.json").write_text(json.dumps(rows, indent=2, default=str))
    ok = sum(r["success"] for r in rows)
    print(f"\nsim demo: {ok}/{len(rows)} oracle episodes succeeded in {time.perf_counter() - t0:.1f}s; "
          f"videos and metrics.json in {out_dir}/")
    return 0
