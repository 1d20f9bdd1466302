"""``robopolicy collect``: oracle demonstrations into a LeRobot v3.0 dataset.

    robopolicy collect --env robopolicy/PersonFollow-v0 --split dt --episodes 100 --workers 2 \\
        --noise 0.1 --out data/pf_dt
    robopolicy collect --config configs/data/collect_pf.yaml --resume
    robopolicy collect --env robopolicy/ArmPickPlace-v0 --episodes 5000 --poses 8 --out data/pp_posed   # locator frames
    robopolicy collect --unattended --env robopolicy/ArmPickPlace-v0 --episodes 100 --out data/pp_unattended

``--unattended``: one continuous world, the arm resets the scene itself between episodes
(robopolicy.teleop.unattended; ``--config`` is then an UnattendedConfig).
"""

from __future__ import annotations

import argparse

from robopolicy.config import load_config
from robopolicy.data.collect import CollectConfig, collect


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("collect", help="record oracle episodes into a LeRobot dataset (parallel, resumable)")
    p.add_argument("--env", help="task id, e.g. robopolicy/PersonFollow-v0, or module:EnvId (the module is imported)")
    p.add_argument("--split", help="PersonFollow split: stt, dt or at")
    p.add_argument("--episodes", type=int, help="episodes wanted in the dataset")
    p.add_argument("--workers", type=int, help="oracle processes")
    p.add_argument("--noise", type=float, help="DART noise on executed actions (labels stay clean)")
    p.add_argument("--seed", type=int, help="first seed (episode i uses seed + i)")
    p.add_argument("--image-size", type=int, help="camera size in px (96-128 recommended)")
    p.add_argument("--poses", type=int, help="posed frames instead of oracle episodes: K random task poses of "
                   "each episode's layout, no physics (arm tasks; for training a locator)")
    p.add_argument("--out", help="dataset directory")
    p.add_argument("--resume", action="store_true", help="continue the dataset in --out after a stop or crash")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--unattended", action="store_true", help="one continuous world: the arm itself resets the scene "
                   "to a new layout between episodes, no env.reset (arm tasks with cubes)")
    p.add_argument("--config", help="YAML config (CollectConfig)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_collect)


def _overrides(args: argparse.Namespace) -> list[str]:
    out = []
    for flag, key in (("env", "env.id"), ("split", "env.kwargs.split"), ("episodes", "episodes"),
                      ("workers", "workers"), ("noise", "noise"), ("seed", "seed"),
                      ("image_size", "image_size"), ("poses", "poses"), ("out", "out")):
        value = getattr(args, flag)
        if value is not None:
            out.append(f"{key}={value}")
    if args.resume:
        out.append("resume=true")
    if args.no_progress:
        out.append("progress=false")
    return out + list(args.overrides)


def cmd_collect(args: argparse.Namespace) -> int:
    from robopolicy.data.recorder import DatasetError

    if args.unattended:
        return _cmd_unattended(args)
    cfg = load_config(CollectConfig, args.config, _overrides(args))
    try:
        summary = collect(cfg)
    except DatasetError as exc:
        print(f"robopolicy collect: {exc}")
        return 1
    print()
    print(summary.table())
    print(f"\ndataset: {cfg.out}")
    return 1 if summary.errors else 0


def _cmd_unattended(args: argparse.Namespace) -> int:
    from robopolicy.config import ConfigError
    from robopolicy.data.recorder import DatasetError
    from robopolicy.teleop.unattended import UnattendedConfig, collect_unattended

    overrides = _overrides(args)
    for flag in ("workers", "poses", "resume"):
        if getattr(args, flag):
            raise ConfigError(f"collect --unattended: --{flag} does not apply (one world, one process, a new dataset)")
    cfg = load_config(UnattendedConfig, args.config, overrides)
    try:
        stats = collect_unattended(cfg)
    except DatasetError as exc:
        print(f"robopolicy collect: {exc}")
        return 1
    print(f"\ndataset: {cfg.out}\nrecord: {cfg.summary or cfg.out}/summary.json")
    return 0 if stats.episodes == cfg.episodes else 1
