"""Training speed of one train config in three numeric layouts, side by side, through the trainer itself.

    .venv/bin/python bench/train_step.py --config configs/train/arm/reach_cam.yaml [--steps 60] [--batch-size 32]

Runs ``robopolicy.train`` on the config's dataset for ``--steps`` steps three times, the same
seed and so the same initial weights and batches each time, changing only:

- ``nchw fp32``: the encoders in PyTorch's default layout (``channels_last: false``), float32 (the
  anchor: what the stack did before);
- ``nhwc fp32``: channels-last encoders (the default now);
- ``nhwc bf16``: the same with ``amp=bf16``.

Prints, per variant, the steady samples/s (median over the trainer's log intervals after the
first, as ``bench/vs_lerobot.py`` reads it) and its ratio to the anchor. Needs a config with a
trainable encoder to say anything (frozen encoders train on cached features, not frames).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from robopolicy.config import load_config  # noqa: E402
from robopolicy.train import TrainConfig, train  # noqa: E402
from robopolicy.utils.records import write_summary  # noqa: E402
from vs_lerobot import steady_rate  # noqa: E402  (bench/, beside this file)

VARIANTS = (("nchw fp32", False, "none"), ("nhwc fp32", True, "none"), ("nhwc bf16", True, "bf16"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/train/arm/reach_cam.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=None, help="default: the config's")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="outputs/bench/train_step")
    args = parser.parse_args()
    started = time.time()
    cfg = load_config(TrainConfig, args.config, [])
    if not cfg.model.encoders or all(e.frozen for e in cfg.model.encoders):
        raise SystemExit(f"{args.config}: no trainable encoder; its steps read cached features, not frames")
    if args.steps < 2 * args.log_every:
        raise SystemExit("--steps must cover at least two --log-every intervals (the first is warm-up)")
    rates = {}
    for name, channels_last, amp in VARIANTS:
        encoders = [dataclasses.replace(e, channels_last=channels_last) for e in cfg.model.encoders]
        run = dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, encoders=encoders), amp=amp, steps=args.steps,
            batch_size=args.batch_size or cfg.batch_size, log_every=args.log_every, save_every=0,
            threads=args.threads, progress=False, overwrite=True, resume=False, device="cpu",
            out=str(Path(args.out) / name.replace(" ", "_")))
        result = train(run, log=lambda m: None)
        rates[name] = steady_rate(result.out / "metrics.csv", result.samples_per_s)
        print(f"[bench] {name}: {rates[name]:.1f} samples/s", flush=True)
    anchor = rates["nchw fp32"]
    print(f"\n{args.config}, batch {args.batch_size or cfg.batch_size}, {args.threads} threads, {args.steps} steps each\n")
    print("| variant | samples/s | vs nchw fp32 |\n|---|---:|---:|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} | {rate / anchor:.2f}x |")
    write_summary(args.out, kind="bench", config={"bench": vars(args), "train": cfg}, seeds=[cfg.seed], started_at=started,
                  metrics={name: {"samples_per_s": rate, "ratio": rate / anchor} for name, rate in rates.items()},
                  extra={"bench": "train_step"})
    print(f"record: {Path(args.out) / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
