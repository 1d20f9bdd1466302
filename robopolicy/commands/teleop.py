"""``robopolicy teleop``: drive a robot with a teleoperator and record LeRobot v3 episodes.

    robopolicy teleop --robot configs/robots/sim_arm.yaml --teleop keyboard --dataset data/pick --task "pick the cube"
    robopolicy teleop --robot configs/robots/sim_arm.yaml --teleop configs/teleop/so101_leader.yaml \\
        --dataset data/pick --task "pick the cube" --episodes 20 --episode-s 20 --reset-s 5
    robopolicy teleop ... --checkpoint outputs/train/arm/final   # the policy drives, the operator intervenes

``--teleop`` is a device type (keyboard, gamepad, so101_leader, so100_leader, koch_leader,
scripted) or a YAML file of the ``teleop`` section (type, kwargs, rate_hz, adapter). Episode
controls: the device's buttons or, from a terminal, s / r / d / q / g / b + Enter (save,
re-record, discard, stop, mark good, mark bad). Exit status: 0, 2 for a config or device
error, 3 when a fault (a device that disconnected) ended the session.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from robopolicy.config import build, deep_merge, load_yaml, parse_overrides


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("teleop", help="drive a robot with a teleoperator and record LeRobot episodes")
    p.add_argument("--config", help="YAML TeleopConfig (robot, teleop, dataset, task, episodes, ...)")
    p.add_argument("--robot", help="YAML robot config (configs/robots/*.yaml)")
    p.add_argument("--teleop", help="device type (keyboard, gamepad, so101_leader, ...) or a YAML teleop section")
    p.add_argument("--dataset", help="dataset directory (LeRobot v3)")
    p.add_argument("--task", help="the instruction the episodes are recorded for")
    p.add_argument("--episodes", type=int, help="episodes to record")
    p.add_argument("--episode-s", dest="episode_s", type=float, help="seconds per episode (ends earlier on save)")
    p.add_argument("--reset-s", dest="reset_s", type=float, help="seconds between episodes (not recorded)")
    p.add_argument("--fps", type=int, help="frames per second recorded")
    p.add_argument("--checkpoint", dest="policy", help="a policy to take over from (interventions)")
    p.add_argument("--resume", action="store_true", default=None, help="continue an existing dataset")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_teleop)


def teleop_section(value: str) -> dict:
    """``--teleop``: a device type, or a YAML file of the ``teleop`` section."""
    if value.endswith((".yaml", ".yml")) or Path(value).is_file():
        return load_yaml(value)
    return {"type": value}


def load_teleop_config(args: argparse.Namespace):
    from robopolicy.teleop.session import TeleopConfig

    data = load_yaml(args.config) if args.config else {}
    source = args.config or "<defaults>"
    if args.robot:
        data["robot"] = load_yaml(args.robot)
        source += f" + {args.robot}"
    if args.teleop:
        data = deep_merge(data, {"teleop": teleop_section(args.teleop)})
        source += f" + {args.teleop}"
    flags = {k: getattr(args, k) for k in ("dataset", "task", "episodes", "episode_s", "reset_s", "fps", "policy", "resume")
             if getattr(args, k, None) is not None}
    data = deep_merge(data, flags)
    if args.overrides:
        data = deep_merge(data, parse_overrides(args.overrides))
        source += " + overrides"
    return build(TeleopConfig, data, source)


def cmd_teleop(args: argparse.Namespace) -> int:
    from robopolicy.teleop.session import record_session

    cfg = load_teleop_config(args)
    result = record_session(cfg)
    return 3 if result.fault else 0
