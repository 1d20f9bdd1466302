"""Training frames/s of a frozen-encoder recipe with and without the feature cache, through the trainer.

    .venv/bin/python bench/feature_cache_speed.py --config configs/train/track/pair_waypoints.yaml \\
        --dataset outputs/quickstart/dataset [--steps 40] [--log-every 10] [key=value ...]

Runs ``robopolicy.train`` twice on the same dataset, seed and batches, changing only
``data.feature_cache``: off (the anchor: every step runs the frozen encoders on each sample's
context frames) and on (each frozen member's single-frame features are read from the cache).
A frame here is one context frame of one camera of one sample: frames/s = samples/s x context
frames x cameras. Prints the steady rate (median over the trainer's log intervals after the
first) and the ratio; the one-off encoding of the cache is timed and printed apart, with how many
training steps of the uncached run it costs.
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/train/track/pair_waypoints.yaml")
    parser.add_argument("--dataset", default=None, help="default: the config's")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="outputs/bench/feature_cache_speed")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="train config overrides")
    args = parser.parse_args()
    if args.steps < 2 * args.log_every:
        raise SystemExit("--steps must cover at least two --log-every intervals (the first is warm-up)")
    started, load_start = time.time(), os.getloadavg()
    overrides = [f"steps={args.steps}", f"batch_size={args.batch_size}", f"log_every={args.log_every}",
                 "save_every=0", f"threads={args.threads}", "progress=false", "device=cpu"]
    if args.dataset:
        overrides.append(f"data.dataset={args.dataset}")
    overrides += list(args.overrides)
    cfg = load_config(TrainConfig, args.config, overrides)
    if not all(e.frozen for e in cfg.model.encoders):
        raise SystemExit(f"{args.config}: a trainable encoder; only frozen encoders can be cached")
    frames_per_sample = len(cfg.model.context_strides) * max(1, len(cfg.data.features.cameras or [None]))
    rates, encode_s = {}, 0.0
    for name, cached in (("no cache", False), ("cache", True)):
        run = load_config(TrainConfig, args.config, overrides + [f"data.feature_cache={str(cached).lower()}",
                                                                 f"out={Path(args.out) / name.replace(' ', '_')}"])
        run.overwrite = True
        result = train(run, log=lambda m: None)
        assert result.used_feature_cache == cached
        rates[name] = steady_rate(result.out / "metrics.csv", result.samples_per_s) * frames_per_sample
        encode_s = max(encode_s, result.feature_seconds if cached else 0.0)
        print(f"[bench] {name}: {rates[name]:.0f} frames/s", flush=True)
    ratio = rates["cache"] / rates["no cache"]
    encodings = [e.name + ("" if e.stage is None else f" stage {e.stage}") for e in cfg.model.encoders]
    print(f"\n{args.config} ({' + '.join(encodings)}), batch {args.batch_size}, {frames_per_sample} frames per sample, "
          f"{args.threads} thread(s), load average {load_start[0]:.1f}\n")
    print("| feature cache | training frames/s | vs no cache |\n|---|---:|---:|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.0f} | {rate / rates['no cache']:.1f}x |")
    print(f"\ncache build: {encode_s:.0f} s (0 when the files already existed)")
    write_summary(args.out, kind="bench", config={"bench": vars(args), "train": cfg}, seeds=[cfg.seed],
                  started_at=started, metrics={"frames_per_s_no_cache": rates["no cache"],
                                               "frames_per_s_cache": rates["cache"], "ratio": ratio,
                                               "cache_build_s": encode_s, "frames_per_sample": frames_per_sample,
                                               "load_average_start": list(load_start),
                                               "load_average_end": list(os.getloadavg())},
                  extra={"bench": "feature_cache_speed"})
    print(f"record: {Path(args.out) / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
