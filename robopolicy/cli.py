"""The ``robopolicy`` command: one entry point, a subcommand per job.

Every subcommand takes ``--config FILE`` plus ``key=value`` overrides (see robopolicy.config).
"""

from __future__ import annotations

import argparse
import os
import sys

from robopolicy.config import ConfigError

# Headless rendering unless the user chose a backend.
os.environ.setdefault("MUJOCO_GL", "egl")


def build_parser() -> argparse.ArgumentParser:
    from robopolicy.commands import collect, dataset, quickstart, refine, run, sim, train
    from robopolicy.commands import eval as eval_cmd

    parser = argparse.ArgumentParser(
        prog="robopolicy",
        description="Robot learning stack: MuJoCo tasks, imitation, refinement, real-time control.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    sim.add_parser(sub)
    collect.add_parser(sub)
    dataset.add_parser(sub)
    train.add_parser(sub)
    eval_cmd.add_parser(sub)
    quickstart.add_parser(sub)
    refine.add_parser(sub)
    run.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # argparse cannot take positional key=value overrides after options
    # (`collect --env X seed=3 --episodes 2`); gather the stray ones here instead.
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides or []) + extra
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"robopolicy: config error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("robopolicy: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
