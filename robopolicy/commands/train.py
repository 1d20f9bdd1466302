"""``robopolicy train``: imitation training of a policy from a recipe config.

    robopolicy train --config configs/train/arm/chunk_l1.yaml data.dataset=data/arm_pp steps=2000
    robopolicy train --config configs/train/track/stage2_ground.yaml --resume
    robopolicy train --config configs/train/point/chunk.yaml --nproc 2             # DDP, 2 processes (torchrun)
    robopolicy train --config configs/train/arm/state_chunk.yaml --print-config   # every setting, resolved
    robopolicy train --help                                                        # the settings, one line each
"""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a policy by imitation (one recipe / stage per config)",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML recipe (TrainConfig), e.g. configs/train/arm/chunk_l1.yaml")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the run's out dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--nproc", type=int, default=1,
                   help="data-parallel processes on this machine (torch DDP through torchrun: NCCL on GPUs, "
                        "gloo on the CPU); batch_size stays the global batch, split across them")
    p.add_argument("--print-config", action="store_true",
                   help="print every setting with its value (defaults < --config < overrides) and exit")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="settings to change, key=value or --key=value (see below)")
    p.set_defaults(func=cmd_train)
    plain_help = p.format_help
    p.format_help = lambda: plain_help() + "\n" + settings_help()  # built on demand: it imports torch


def settings_help() -> str:
    """The top-level settings of a recipe and the dataset feature mapping, one line each."""
    import textwrap

    from robopolicy.config import describe
    from robopolicy.data.loader import FeatureMap
    from robopolicy.train.trainer import TrainConfig

    def block(lines: list[str]) -> str:
        return "\n".join(textwrap.shorten(line, 150, placeholder=" ...") for line in lines)

    return ("settings (the sections of a recipe; `robopolicy train --print-config [--config FILE]` prints\n"
            "every key with its resolved value):\n" + textwrap.indent(block(describe(TrainConfig, depth=0)), "  ")
            + "\n\ndataset features (which dataset keys play which role; any LeRobot v3.0 dataset):\n"
            + textwrap.indent(block(describe(FeatureMap, "data.features.")), "  ") + "\n")


def cmd_train(args: argparse.Namespace) -> int:
    from robopolicy.config import load_config
    from robopolicy.data.cache import DatasetError
    from robopolicy.models.encoders import EncoderError
    from robopolicy.models.language import LanguageError
    from robopolicy.models.policy import PolicyError
    from robopolicy.train.trainer import TrainConfig, TrainError, train

    overrides = list(args.overrides)
    if args.nproc > 1 and not args.print_config:
        from robopolicy.scale.ddp import launch

        argv = ["train"] + (["--config", args.config] if args.config else [])
        argv += ["--resume"] * args.resume + ["--no-progress"] * args.no_progress + overrides
        return launch(argv, args.nproc)
    if args.resume:
        overrides.append("resume=true")
    if args.no_progress:
        overrides.append("progress=false")
    cfg = load_config(TrainConfig, args.config, overrides)
    if args.print_config:
        import yaml

        from robopolicy.config import to_dict

        print(yaml.safe_dump(json.loads(json.dumps(to_dict(cfg))), sort_keys=False), end="")
        return 0
    try:
        result = train(cfg)
    except (DatasetError, PolicyError, TrainError, EncoderError, LanguageError) as exc:
        print(f"robopolicy train: {exc}")
        return 1
    from robopolicy.scale.ddp import Dist

    if not Dist.from_env().is_main:  # under torchrun, rank 0 reports the run
        return 0

    def loss(values: dict) -> str:  # none when a resumed run had no step left to take
        return f"{values['total']:.4f}" if "total" in values else "—"

    first, last = loss(result.first_losses), loss(result.last_losses)
    print(f"\n| run | steps | loss first → last | samples/s | feature cache |")
    print("|-----|-------|-------------------|-----------|---------------|")
    print(f"| {cfg.name} | {result.steps} | {first} → {last} | {result.samples_per_s:.0f} | "
          f"{'yes' if result.used_feature_cache else 'no'} ({result.feature_seconds:.1f} s) |")
    print(f"\ncheckpoint: {result.final}\nloss curves: {result.out / 'losses.png'}")
    return 0
