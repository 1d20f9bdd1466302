"""``robopolicy world``: train a latent world model from a dataset, and measure its predictions.

    robopolicy world train --config configs/world/point.yaml dataset=outputs/datasets/point
    robopolicy world eval --checkpoint outputs/world/point/final --env robopolicy/PointReach-v0
    robopolicy world plan --world outputs/world/point/final --checkpoint BASE --out outputs/plan/point mppi.samples=64
    robopolicy eval --checkpoint outputs/plan/point --env robopolicy/PointReach-v0   # MPPI at inference

``train`` writes ``<out>/final`` (``config.yaml`` + ``model.safetensors``, normalisation inside),
``curve.csv`` and ``summary.json``; ``eval`` writes the open-loop error per step k, the success
AUC, ``prediction.png`` and ``summary.json``. A dataset or env that does not fit the model, or a
diverged run, ends with an error that says so (exit status 1). ``plan`` writes a policy checkpoint of type
``planned`` (a base, or none, whose chunks MPPI refines in the world model) that ``robopolicy eval`` and
the policy worker load like any other checkpoint.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("world", help="world models: train from a dataset, evaluate open-loop predictions")
    jobs = p.add_subparsers(dest="world_command", metavar="JOB")
    jobs.required = True
    t = jobs.add_parser("train", help="train a world model from a LeRobot dataset (state, action, reward, success)")
    t.add_argument("--config", help="YAML config (WorldTrainConfig), e.g. configs/world/point.yaml")
    t.add_argument("--dataset", help="dataset directory (sets dataset=)")
    t.add_argument("--out", help="output directory")
    t.add_argument("overrides", nargs="*", metavar="key=value")
    t.set_defaults(func=cmd_train)
    e = jobs.add_parser("eval", help="open-loop prediction error against the simulator, success AUC, plot")
    e.add_argument("--checkpoint", help="world-model checkpoint directory")
    e.add_argument("--env", help="env id, e.g. robopolicy/PointReach-v0")
    e.add_argument("--config", help="YAML config (WorldEvalConfig)")
    e.add_argument("--out", help="output directory")
    e.add_argument("overrides", nargs="*", metavar="key=value")
    e.set_defaults(func=cmd_eval)
    pl = jobs.add_parser("plan", help="write a policy checkpoint that plans with MPPI in a world model around a base")
    pl.add_argument("--world", required=True, help="world-model checkpoint directory")
    pl.add_argument("--checkpoint", help="base policy checkpoint (none: the world model's policy prior is the nominal)")
    pl.add_argument("--out", required=True, help="directory of the planned-policy checkpoint")
    pl.add_argument("overrides", nargs="*", metavar="mppi.key=value")
    pl.set_defaults(func=cmd_plan)


def _flags(args: argparse.Namespace, names: dict[str, str]) -> list[str]:
    return [f"{key}={getattr(args, flag)}" for flag, key in names.items() if getattr(args, flag, None)]


def cmd_train(args: argparse.Namespace) -> int:
    from robopolicy.config import load_config
    from robopolicy.world.model import WorldModelError
    from robopolicy.world.train import WorldTrainConfig, train

    cfg = load_config(WorldTrainConfig, args.config, _flags(args, {"dataset": "dataset", "out": "out"}) + list(args.overrides))
    try:
        s = train(cfg)
    except WorldModelError as exc:
        print(f"robopolicy world train: {exc}")
        return 1
    held = s["held_out"] or s["train"]
    print(f"checkpoint {s['checkpoint']}; held-out losses: " + ", ".join(f"{k} {v:.4g}" for k, v in held.items())
          + f"; {s['seconds']:.0f} s")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from robopolicy.config import load_config
    from robopolicy.world.eval import WorldEvalConfig, evaluate
    from robopolicy.world.model import WorldModelError

    flags = _flags(args, {"checkpoint": "checkpoint", "env": "env.id", "out": "out"})
    cfg = load_config(WorldEvalConfig, args.config, flags + list(args.overrides))
    try:
        evaluate(cfg)
    except WorldModelError as exc:
        print(f"robopolicy world eval: {exc}")
        return 1
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from robopolicy.world.model import WorldModelError
    from robopolicy.world.plan import PlannedPolicy, mppi_config

    cfg = mppi_config(args.overrides)
    out = PlannedPolicy.write(args.out, args.world, args.checkpoint, cfg)
    try:
        PlannedPolicy.load(out)  # sizes of the base and the world model are checked now, not at the first step
    except WorldModelError as exc:
        for name in ("config.yaml", "train_config.yaml"):  # no half checkpoint left behind
            (out / name).unlink(missing_ok=True)
        print(f"robopolicy world plan: {exc}")
        return 1
    print(f"planned policy {out}: evaluate with robopolicy eval --checkpoint {out} --env ENV")
    return 0
