"""``robopolicy serve``: the deployment daemon (control node + policy worker + recorder + HTTP API).

    robopolicy serve --config configs/deploy/sim_arm.yaml
    robopolicy serve --config configs/deploy/sim_arm.yaml --checkpoint outputs/train/arm_reach/final
    robopolicy serve --config configs/deploy/sim_arm.yaml api.token_file=/etc/robopolicy/token api.host=0.0.0.0
    robopolicy serve --config configs/deploy/sim_arm.yaml --check      # validate the config, start nothing

Runs until SIGTERM / SIGINT (or ``--duration``); a stop saves the episode in progress, commands
the safe stop and exits 0. A config that cannot work exits 2 before anything moves. See
docs/deploy.md.
"""

from __future__ import annotations

import argparse

from robopolicy.config import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="deployment daemon: a policy on a robot as a service (API, metrics, dashboard, recording)")
    p.add_argument("--config", help="YAML DeployConfig (configs/deploy/*.yaml)")
    p.add_argument("--robot", help="YAML robot config (configs/robots/*.yaml); replaces the config's robot")
    p.add_argument("--checkpoint", help="policy checkpoint directory to serve")
    p.add_argument("--policy", help="scripted source instead of a checkpoint: hold, sine[:amp=..], arc[:v=..]")
    p.add_argument("--duration", type=float, help="seconds to serve (default: until SIGTERM / Ctrl-C)")
    p.add_argument("--check", action="store_true", help="check the config and exit (0: good, 2: refused)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from robopolicy.deploy.daemon import load_deploy_config, serve

    overrides = list(args.overrides or [])
    if args.robot:
        overrides.insert(0, f"robot={args.robot}")
    if args.checkpoint and args.policy:
        raise ConfigError("give --checkpoint DIR or a scripted --policy, not both")
    if args.checkpoint or args.policy:
        overrides.append(f"policy={args.checkpoint or args.policy}")
    cfg = load_deploy_config(args.config, overrides)
    if args.check:
        print(f"serve: config good ({cfg.robot.name}, policy {cfg.policy})")
        return 0
    return serve(cfg, args.duration)
