"""Encoders at equal training time on PersonFollow ``dt``: random trainable, pretrained single, pretrained pair.

Each arm trains the single-stage waypoint recipe (``experiments/configs/train/track_single_stage.yaml``)
on the same oracle dataset, for the same wall-clock budget of training steps, then is evaluated
on the same unseen seeds. Only the encoder differs:

- ``random``: ResNet-18 to layer2, random init, trained end to end on 64 px frames (the anchor);
- ``single``: EfficientNet-Lite0 (packaged ImageNet weights), frozen, stage 3 (stride 16) at the
  frames' own resolution, cached;
- ``pair``: that Lite0 beside Lite2's last stage (stride 32), both frozen and cached, fused.

Every arm sees the context (t, t-4) of the recipe, so only the encoder differs.

The budget covers training steps only: a short probe run per arm measures its step rate on this
machine, and the arm then runs ``budget x rate`` steps. The frozen arms' one-off feature encoding
(per dataset and encoder, reused by every later run; the pair reuses the single arm's Lite0 file)
is measured and recorded beside it. Success rates carry Wilson 95% intervals; each arm's
record goes to ``<results>/ablation_<arm>.json``.

    robopolicy collect --env robopolicy/PersonFollow-v0 --split dt --episodes 60 --image-size 64 \\
        --out outputs/datasets/person_follow_dt64 max_steps=150
    python bench/encoder_ablation.py --dataset outputs/datasets/person_follow_dt64 --image-size 64 \\
        --max-steps 150 --budget-s 240 --episodes 100 --results results/vision
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_lerobot import steady_rate  # noqa: E402  (bench/, beside this file)

RECIPE = "experiments/configs/train/track_single_stage.yaml"
LITE0 = "{name: efficientnet_lite0, weights: imagenet, frozen: true, image_size: %d, stage: 3}"
LITE2 = "{name: efficientnet_lite2, weights: imagenet, frozen: true, image_size: %d, stage: 4}"


def arms(size: int) -> dict[str, list[str]]:
    """Each arm's encoder override; ``size``: the frames' own resolution (the frozen members see it whole)."""
    return {"random": ["model.encoders=[{name: resnet18, frozen: false, image_size: 64, stage: 2, weights: null}]"],
            "single": [f"model.encoders=[{LITE0 % size}]"],
            "pair": [f"model.encoders=[{LITE0 % size}, {LITE2 % size}]"]}


TITLES = {
    "random": "random trainable (ResNet-18 to layer2, 64 px, end to end)",
    "single": "pretrained single (Lite0 stage 3, frozen, cached)",
    "pair": "pretrained pair (Lite0 stage 3 + Lite2 stage 4, frozen, cached, a norm per member)",
}


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score 95% interval of a success rate."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def _train(arm: str, args, steps: int, out: Path, log, log_every: int = 100):
    from robopolicy.config import load_config
    from robopolicy.train import TrainConfig, train

    cfg = load_config(TrainConfig, RECIPE, [
        f"data.dataset={args.dataset}", f"out={out}", f"steps={steps}", "save_every=0", "progress=false",
        f"threads={args.threads}", "seed=0", "model.context_strides=[0, 4]", f"log_every={log_every}",
        "optim.warmup_steps=" + str(min(100, max(1, steps // 10))), *arms(args.image_size)[arm]])
    cfg.overwrite = True
    return train(cfg, log=log)


def run_arm(arm: str, args, log=print) -> dict:
    """Probe the step rate, train for the budget, evaluate; the arm's metrics."""
    from robopolicy.commands.eval import load_policy
    from robopolicy.eval.config import EvalConfig
    from robopolicy.eval.rollout import evaluate
    from robopolicy.config import load_config

    work = Path(args.work) / arm
    load_start = os.getloadavg()
    done = work / "train" / "train_summary.json"
    if args.reuse and done.is_file() and (work / "probe" / "train_summary.json").is_file():
        # an arm trained by an earlier call whose evaluation did not finish: evaluate it as it is
        probe = argparse.Namespace(**json.loads((work / "probe" / "train_summary.json").read_text()))
        probe.out = work / "probe"
        result = argparse.Namespace(**json.loads(done.read_text()))
        steps_per_s = steady_rate(probe.out / "metrics.csv", probe.samples_per_s) / 32.0
        log(f"[ablation] {arm}: reusing {result.final} ({result.steps} steps in {result.seconds:.0f} s)")
    else:
        probe = _train(arm, args, args.probe_steps, work / "probe", log, log_every=10)  # builds the feature cache
        # steady rate: the first interval carries one-off costs (the sentence model loading, workers starting)
        steps_per_s = steady_rate(probe.out / "metrics.csv", probe.samples_per_s) / 32.0  # the recipe's batch
        steps = max(args.probe_steps, int(args.budget_s * steps_per_s))
        if arm in args.steps_for:  # a rate measured over a whole earlier run of this arm
            steps = args.steps_for[arm]
        log(f"[ablation] {arm}: {steps_per_s:.2f} steps/s in the probe -> {steps} steps for {args.budget_s:.0f} s")
        result = _train(arm, args, steps, work / "train", log)
    ecfg = load_config(EvalConfig, None, [
        f"checkpoint={result.final}", "env.id=robopolicy/PersonFollow-v0", "splits=[dt]",
        f"episodes={args.episodes}", f"seed={args.seed}", f"env.kwargs.max_steps={args.max_steps}",
        f"workers={args.workers}", "videos=0", "threads=1",
        f"out={work / 'eval'}", "progress=false"])
    t_eval = time.perf_counter()
    report = evaluate(load_policy(result.final, "cpu"), ecfg, log=log)
    (split,) = report.splits
    m = dict(split.summary)
    n = int(m["episodes"])
    wins = int(round(m["success_rate"] * n))
    lo, hi = wilson(wins, n)
    return {"dt": {**m, "success_ci95": [lo, hi]},
            "train_s": result.seconds, "steps": result.steps, "steps_per_s_probe": steps_per_s,
            "feature_encoding_s": probe.feature_seconds, "used_feature_cache": result.used_feature_cache,
            "first_loss": result.first_losses.get("total"), "last_loss": result.last_losses.get("total"),
            "eval_s": time.perf_counter() - t_eval, "load_average_start": list(load_start),
            "load_average_end": list(os.getloadavg())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", required=True, help="oracle dataset of the dt split (robopolicy collect --split dt)")
    p.add_argument("--arms", default="random,single,pair")
    p.add_argument("--budget-s", type=float, default=360.0, help="training seconds per arm (steps only)")
    p.add_argument("--probe-steps", type=int, default=40)
    p.add_argument("--episodes", type=int, default=100)
    p.add_argument("--seed", type=int, default=100_000, help="first eval seed (unseen: collection used 0..N-1)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--image-size", type=int, default=96, help="the dataset's frame size (the frozen encoders' input)")
    p.add_argument("--max-steps", type=int, default=300, help="eval episode cap (as the dataset's collection)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default="outputs/bench/encoder_ablation")
    p.add_argument("--results", default="results/vision")
    p.add_argument("--reuse", action="store_true", help="evaluate an arm already trained under --work as it is")
    p.add_argument("--steps-for", nargs="*", default=[], metavar="ARM=STEPS",
                   help="fix an arm's steps instead of the probe's estimate (the probe's rate misleads when the "
                        "load changes between the probe and the run)")
    args = p.parse_args()
    args.steps_for = {k: int(v) for k, v in (item.split("=", 1) for item in args.steps_for)}

    from robopolicy.utils.files import atomic_write_text
    from robopolicy.utils.records import build_summary

    rows = {}
    for arm in args.arms.split(","):
        started = time.time()
        metrics = run_arm(arm, args)
        rows[arm] = metrics
        record = build_summary(kind="bench", seeds=[args.seed], episodes=args.episodes, metrics=metrics,
                               started_at=started, extra={
                                   "title": TITLES[arm], "task": "robopolicy/PersonFollow-v0", "recipe": RECIPE,
                                   "eval_seed": args.seed, "dataset": str(args.dataset),
                                   "budget_s": args.budget_s, "image_size": args.image_size,
                                   "max_steps": args.max_steps,
                                   "notes": "measured on the shared 2-core machine under load (see "
                                            "load_average_start / _end); the budget counts training steps only"})
        Path(args.results).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(args.results) / f"ablation_{arm}.json", json.dumps(record, indent=2) + "\n")
        dt = metrics["dt"]
        print(f"[ablation] {arm}: SR {dt['success_rate']:.1%} [{dt['success_ci95'][0]:.1%}, "
              f"{dt['success_ci95'][1]:.1%}] TR {dt.get('tracking_rate', float('nan')):.1%} "
              f"CR {dt.get('collision_rate', float('nan')):.1%}, {metrics['steps']} steps in {metrics['train_s']:.0f} s",
              flush=True)
    if "random" in rows:
        base = rows["random"]["dt"]["success_rate"]
        for arm, m in rows.items():
            print(f"{arm:>7}: SR {m['dt']['success_rate']:.1%} ({100 * (m['dt']['success_rate'] - base):+.1f} pts vs random)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
