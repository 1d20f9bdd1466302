"""Where a training step's time goes, for one train config, in three numeric layouts side by side.

    .venv/bin/python bench/train_step.py --config configs/train/arm_reach_cam.yaml [--steps 40] [--batch-size 32]

The config's dataset is read as ``robopolicy train`` reads it (frames decoded into its cache once,
random shifts when the config asks), its policy built the same way, and the same batches go through
three variants, each timed over ``--steps`` steps after ``--warmup`` untimed ones:

- ``nchw fp32``: the encoders in PyTorch's default layout (``channels_last: false``), float32 (the
  anchor: what the stack did before);
- ``nhwc fp32``: channels-last encoders (the default now);
- ``nhwc bf16``: the same under bf16 autocast (``amp=bf16``).

Per variant: data, forward, backward (incl. clipping), optimizer and EMA time per step in ms, and
samples/s with its ratio to the anchor. Each variant starts from the same initial weights. Needs a
config with a trainable encoder to say anything (frozen encoders train on cached features).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from robopolicy.config import load_config  # noqa: E402
from robopolicy.models.policy import Policy  # noqa: E402
from robopolicy.train.data import frame_batches  # noqa: E402
from robopolicy.train.trainer import (Ema, TrainConfig, build_dataset, model_config_for, param_groups,  # noqa: E402
                                      policy_stats, shifted)

PARTS = ("data", "forward", "backward", "optimizer", "ema")


def time_variant(cfg: TrainConfig, ds, state: dict, channels_last: bool, bf16: bool, steps: int, warmup: int) -> dict:
    encoders = [dataclasses.replace(e, channels_last=channels_last) for e in cfg.model.encoders]
    model_cfg = model_config_for(dataclasses.replace(cfg.model, encoders=encoders), ds)
    policy = Policy(model_cfg, policy_stats(model_cfg, ds))
    policy.load_state_dict(state)
    policy.train()
    opt = torch.optim.AdamW(param_groups(policy, cfg.optim), lr=cfg.optim.lr)
    ema = Ema(policy, cfg.ema.decay) if cfg.ema.enabled else None
    weights = {k: v for k, v in dataclasses.asdict(cfg.loss).items() if v}
    batches = frame_batches(ds, cfg.batch_size, cfg.data.num_workers, seed=cfg.seed)
    if cfg.augment.shift > 0:
        batches = shifted(batches, cfg.augment.shift, cfg.seed)
    totals = dict.fromkeys(PARTS, 0.0)
    for i in range(warmup + steps):
        t = [time.perf_counter()]
        batch = next(batches)
        t.append(time.perf_counter())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = policy.losses(batch, weights)["total"]
        t.append(time.perf_counter())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.optim.grad_clip)
        t.append(time.perf_counter())
        opt.step()
        t.append(time.perf_counter())
        if ema is not None:
            ema.update(policy)
        t.append(time.perf_counter())
        if not torch.isfinite(loss):
            raise SystemExit(f"step {i}: loss is {loss.item()}")
        if i >= warmup:
            for k, a, b in zip(PARTS, t, t[1:]):
                totals[k] += b - a
    ms = {k: 1000 * v / steps for k, v in totals.items()}
    return {"ms": ms, "samples_per_s": cfg.batch_size * steps / sum(totals.values()), "loss": float(loss)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/train/arm_reach_cam.yaml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=None, help="default: the config's")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(TrainConfig, args.config, [])
    if args.batch_size:
        cfg = dataclasses.replace(cfg, batch_size=args.batch_size)
    if not cfg.model.encoders or all(e.frozen for e in cfg.model.encoders):
        raise SystemExit(f"{args.config}: no trainable encoder; its steps read cached features, not frames")
    ds = build_dataset(cfg, progress=True)
    torch.manual_seed(cfg.seed)
    model_cfg = model_config_for(cfg.model, ds)
    state = copy.deepcopy(Policy(model_cfg, policy_stats(model_cfg, ds)).state_dict())
    rows = {}
    for name, cl, bf16 in (("nchw fp32", False, False), ("nhwc fp32", True, False), ("nhwc bf16", True, True)):
        rows[name] = r = time_variant(cfg, ds, state, cl, bf16, args.steps, args.warmup)
        print(f"[bench] {name}: {r['samples_per_s']:.1f} samples/s", flush=True)
    anchor = rows["nchw fp32"]["samples_per_s"]
    print(f"\n{args.config}, batch {cfg.batch_size}, {args.threads} threads, {args.steps} timed steps "
          f"(ms per step)\n")
    print("| variant | " + " | ".join(PARTS) + " | samples/s | vs nchw fp32 |")
    print("|---|" + "---:|" * (len(PARTS) + 2))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r['ms'][k]:.1f}" for k in PARTS)
              + f" | {r['samples_per_s']:.1f} | {r['samples_per_s'] / anchor:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
