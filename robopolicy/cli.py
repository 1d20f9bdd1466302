"""The ``robopolicy`` command: one entry point, a subcommand per job.

Every subcommand takes ``--config FILE`` plus ``key=value`` (or ``--key=value``) overrides (see
robopolicy.config). Process-wide settings (headless rendering, an offline Hugging Face hub: datasets
and models are local files) are made here, at the entry, never on import of a library module.
"""

from __future__ import annotations

import argparse
import os
import sys

from robopolicy.config import ConfigError

PROCESS_ENV = {
    "MUJOCO_GL": "egl",  # headless rendering unless the user chose a backend
    "HF_HUB_OFFLINE": "1",  # datasets live on local disk and models in packages: never ask the hub
    "TRANSFORMERS_OFFLINE": "1",
}
"""Environment variables the command sets unless the user set them (inherited by worker processes)."""


def configure_process() -> None:
    """Process-wide settings of the ``robopolicy`` command; a user's own value wins."""
    for key, value in PROCESS_ENV.items():
        os.environ.setdefault(key, value)


def split_overrides(extra: list[str], accepts_overrides: bool) -> tuple[list[str], list[str]]:
    """Arguments argparse did not take → ``(key=value overrides, unrecognized)``; ``--key=value``
    is the same override as ``key=value``."""
    overrides, stray = [], []
    for arg in extra:
        if arg.startswith("--") and "=" in arg and not arg.startswith("--="):
            arg = arg[2:]
        if accepts_overrides and not arg.startswith("-") and "=" in arg:
            overrides.append(arg)
        else:
            stray.append(arg)
    return overrides, stray


def build_parser() -> argparse.ArgumentParser:
    from robopolicy.commands import collect, dataset, diagnose, quickstart, refine, results, run, serve, sim, teleop, train
    from robopolicy.commands import eval as eval_cmd
    from robopolicy.commands import fleet, world

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
    diagnose.add_parser(sub)
    results.add_parser(sub)
    serve.add_parser(sub)
    world.add_parser(sub)
    teleop.add_parser(sub)
    fleet.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    configure_process()
    parser = build_parser()
    # argparse cannot take positional key=value overrides after options
    # (`collect --env X seed=3 --episodes 2`), nor --key=value ones; gather them here instead.
    args, extra = parser.parse_known_args(argv)
    overrides, stray = split_overrides(extra, hasattr(args, "overrides"))
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if overrides:
        args.overrides = list(args.overrides or []) + overrides
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
