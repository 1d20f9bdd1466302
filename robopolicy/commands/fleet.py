"""``robopolicy fleet``: fleet post-training on Ray (robots run the policy, an operator intervenes,
one learner retrains and publishes weights the robots hot-swap between episodes).

    robopolicy fleet --config configs/scale/fleet_point.yaml
    robopolicy fleet --config configs/scale/fleet_point.yaml --checkpoint outputs/hg/base/final actors=4 ray.address=auto
    robopolicy fleet --config configs/scale/fleet_point.yaml --versions     # each published version on the same seeds

Writes ``<out>/weights/v<NNNNNN>/`` (one checkpoint per version) and ``latest.json``, the LeRobot
dataset (``<out>/dataset`` unless ``dataset`` is set), ``episodes.csv``, ``versions.csv``,
``success.png`` (success against wall clock) and ``summary.json``; prints progress and a one-line
summary. See docs/scale.md.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fleet", help="fleet post-training on Ray: robots stream episodes to one learner (HG-DAgger)")
    p.add_argument("--config", help="YAML FleetConfig, e.g. configs/scale/fleet_point.yaml")
    p.add_argument("--checkpoint", help="the policy the fleet starts from (sets base=)")
    p.add_argument("--out", help="output directory")
    p.add_argument("--versions", action="store_true",
                   help="run no robots: evaluate the published versions of the run in out on the same seeds "
                        "(version_episodes, default 100) and redraw its success.png")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_fleet)


def cmd_fleet(args: argparse.Namespace) -> int:
    from robopolicy.config import load_config
    from robopolicy.scale.fleet import FleetConfig, evaluate_versions, run_fleet

    flags = [f"{key}={getattr(args, name)}" for name, key in (("checkpoint", "base"), ("out", "out"))
             if getattr(args, name, None)]
    cfg = load_config(FleetConfig, args.config, flags + list(args.overrides))
    if args.versions:
        evaluate_versions(cfg)
        return 0
    cfg.hg_dagger()  # the training settings are checked before Ray starts
    run_fleet(cfg)
    return 0
