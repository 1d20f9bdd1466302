"""``robopolicy quickstart``: the main job, offline, on the built-in default task.

    robopolicy quickstart                                  # configs/quickstart.yaml
    robopolicy quickstart --config configs/quickstart.yaml train.steps=100 eval.episodes=4

Three stages, each with a progress line: collect a small oracle dataset (``robopolicy collect``)
→ train a small policy (``robopolicy train``) → evaluate it (``robopolicy eval``); then print the
table, write the plots (loss curves, per-split metrics) and the videos, and end with a one-line
summary. Everything lands under ``out``::

    <out>/dataset/          LeRobot v3.0 dataset of oracle episodes (reused when complete)
    <out>/train/            checkpoints, final/ (the policy), losses.png, metrics.csv
    <out>/eval/             eval.json, eval.md, videos/*.mp4
    <out>/metrics.png       per-split success / tracking / collision
    <out>/quickstart.json   the numbers of the run, stage timings included
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from robopolicy.data.collect import CollectConfig
from robopolicy.eval.config import EvalConfig


DEFAULT_CONFIG = "configs/quickstart.yaml"


def _train_config():
    from robopolicy.train import TrainConfig

    return TrainConfig()


@dataclass
class QuickstartConfig:
    """collect → train → eval; sub-paths left at their defaults are placed under ``out``."""

    out: str = "outputs/quickstart"
    collect: CollectConfig = field(default_factory=CollectConfig)
    train: Any = field(default_factory=_train_config)
    """A ``robopolicy.train.TrainConfig`` (``data.dataset`` defaults to the collected dataset)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """``env`` defaults to the collection env; ``checkpoint`` to the trained policy."""
    fresh: bool = False
    """Collect again even when ``<out>/dataset`` already holds the episodes."""


def load_quickstart_config(path: str | None, overrides: list[str]) -> QuickstartConfig:
    """Load the config with ``train`` typed as ``TrainConfig`` (imported lazily: it pulls in torch)."""
    from robopolicy.config import ConfigError, build, deep_merge, load_yaml, parse_overrides
    from robopolicy.train import TrainConfig

    data: dict[str, Any] = load_yaml(path) if path else {}
    source = str(path) if path else "<defaults>"
    if overrides:
        data = deep_merge(data, parse_overrides(overrides))
        source += " + overrides"
    train_data = data.pop("train", {}) or {}
    if not isinstance(train_data, dict):
        raise ConfigError(f"{source}: key 'train' must be a mapping, got {train_data!r}")
    cfg = build(QuickstartConfig, data, source)
    cfg.train = build(TrainConfig, train_data, source, prefix="train.")
    return cfg


def resolve_paths(cfg: QuickstartConfig) -> QuickstartConfig:
    """Place the dataset, the run and the evaluation under ``out`` unless the config set them."""
    from robopolicy.train import TrainConfig

    out = Path(cfg.out)
    if cfg.collect.out == CollectConfig().out:
        cfg.collect.out = str(out / "dataset")
    if cfg.train.out == TrainConfig().out:
        cfg.train.out = str(out / "train")
    if not cfg.train.data.dataset:
        cfg.train.data.dataset = cfg.collect.out
    if cfg.eval.out == EvalConfig().out:
        cfg.eval.out = str(out / "eval")
    if cfg.eval.env.id == EvalConfig().env.id and not cfg.eval.env.kwargs:
        cfg.eval.env = cfg.collect.env
    if cfg.eval.image_size is None:
        cfg.eval.image_size = cfg.collect.image_size
    return cfg


def _stage(index: int, name: str, log: Callable[[str], None]) -> float:
    log(f"\n==> [{index}/3] {name}")
    return time.perf_counter()


def plot_metrics(report: Any, path: Path) -> Path | None:
    """Bar chart of the per-split rates (tracking) or success (other tasks); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    keys = [("success_rate", "success"), ("tracking_rate", "tracking"), ("collision_rate", "collision")]
    keys = [(k, n) for k, n in keys if any(k in s.summary for s in report.splits)]
    labels = [s.split or s.label for s in report.splits]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 + 0.9 * len(labels) * len(keys)), 3.2))
    width = 0.8 / max(len(keys), 1)
    for i, (key, name) in enumerate(keys):
        values = [100.0 * float(s.summary.get(key, 0.0)) for s in report.splits]
        xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylim(0, 105)
    ax.set_ylabel("%")
    ax.set_title(f"{report.env_id.split('/')[-1]} ({report.splits[0].summary.get('episodes', 0)} episodes per split)",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _headline(report: Any) -> str:
    parts = []
    for s in report.splits:
        m = s.summary
        if "tracking_rate" in m:
            parts.append(f"{s.label} SR {100 * m['success_rate']:.0f}% TR {100 * m['tracking_rate']:.0f}% "
                         f"CR {100 * m['collision_rate']:.0f}%")
        else:
            parts.append(f"{s.label} success {100 * m['success_rate']:.0f}%")
    return "; ".join(parts)


def run_quickstart(cfg: QuickstartConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Collect → train → eval; returns the numbers written to ``quickstart.json``."""
    from robopolicy.commands.eval import load_policy
    from robopolicy.data.collect import collect
    from robopolicy.data.recorder import read_info
    from robopolicy.eval.rollout import evaluate
    from robopolicy.train import train

    cfg = resolve_paths(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    timings: dict[str, float] = {}

    # 1. collect
    t = _stage(1, f"collect {cfg.collect.episodes} oracle episodes of {cfg.collect.env.label()} -> {cfg.collect.out}", log)
    dataset = Path(cfg.collect.out)
    have = 0
    if dataset.exists() and not cfg.fresh:
        try:
            have = int(read_info(dataset).get("total_episodes", 0))
        except Exception:  # noqa: BLE001 - a broken or foreign directory: collect again
            have = 0
        cfg.collect.resume = have > 0
    elif dataset.exists():
        import shutil

        shutil.rmtree(dataset)
    oracle_success = None
    if have >= cfg.collect.episodes:
        log(f"    dataset already holds {have} episodes: reused (fresh=true collects again)")
    else:
        summary = collect(cfg.collect, log=log)
        log(summary.table())
        if summary.errors:
            raise RuntimeError(f"collection failed for {len(summary.errors)} episodes: {summary.errors[0]}")
        oracle_success = summary.successes / summary.episodes if summary.episodes else None
    timings["collect_s"] = time.perf_counter() - t
    log(f"    collect done in {timings['collect_s']:.0f} s")

    # 2. train
    t = _stage(2, f"train {cfg.train.model.head} policy, {cfg.train.steps} steps x {cfg.train.batch_size} "
                  f"-> {cfg.train.out}", log)
    cfg.train.overwrite = True
    result = train(cfg.train, log=log)
    timings["train_s"] = time.perf_counter() - t
    timings["encode_s"] = result.feature_seconds  # part of train_s: the frozen encoders' cached features
    if result.used_feature_cache:
        log(f"    frozen encoder features: {result.feature_seconds:.0f} s (once per dataset and encoder)")
    log(f"    train done in {timings['train_s']:.0f} s ({result.samples_per_s:.0f} samples/s; loss "
        f"{result.first_losses.get('total', float('nan')):.3f} -> {result.last_losses.get('total', float('nan')):.3f})")

    # 3. eval
    cfg.eval.checkpoint = str(result.final)
    splits = cfg.eval.split_list()
    t = _stage(3, f"evaluate {cfg.eval.episodes} episodes x {len(splits)} split(s) of {cfg.eval.env.id} "
                  f"with {cfg.eval.workers} worker(s) -> {cfg.eval.out}", log)
    policy = load_policy(result.final, cfg.eval.device)
    report = evaluate(policy, cfg.eval, log=log)
    timings["eval_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t_all

    plot = plot_metrics(report, out / "metrics.png")
    loss_plot = Path(cfg.train.out) / "losses.png"
    videos = [v for s in report.splits for v in s.videos]
    numbers = {
        "env": cfg.eval.env.id,
        "splits": {s.split or s.label: s.summary for s in report.splits},
        "oracle_success_on_collected": oracle_success,
        "train": {"steps": result.steps, "samples_per_s": result.samples_per_s,
                  "first_loss": result.first_losses.get("total"), "last_loss": result.last_losses.get("total")},
        "timings_s": timings,
        "files": {"eval_table": str(Path(cfg.eval.out) / "eval.md"), "metrics_plot": str(plot) if plot else None,
                  "loss_plot": str(loss_plot) if loss_plot.exists() else None, "videos": videos,
                  "checkpoint": str(result.final)},
    }
    (out / "quickstart.json").write_text(json.dumps(numbers, indent=2, default=str) + "\n")

    log("\n" + report.table())
    log(f"\nplots: {plot or '-'}, {loss_plot if loss_plot.exists() else '-'}")
    log(f"videos: {', '.join(videos) if videos else '-'}")
    oracle = f" (oracle {100 * oracle_success:.0f}% on the collected episodes)" if oracle_success is not None else ""
    log(f"\nquickstart: {_headline(report)}{oracle} | collect {timings['collect_s']:.0f} s, train "
        f"{timings['train_s']:.0f} s, eval {timings['eval_s']:.0f} s, total {timings['total_s'] / 60:.1f} min "
        f"-> {out}/")
    return numbers


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quickstart", help="collect -> train -> evaluate on the built-in default (offline, minutes)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"YAML config (default {DEFAULT_CONFIG})")
    p.add_argument("--out", help="output directory (default outputs/quickstart)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=cmd_quickstart)


def cmd_quickstart(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.out:
        overrides.insert(0, f"out={args.out}")
    config = args.config
    if config == DEFAULT_CONFIG and not Path(config).exists():
        config = None  # run from outside the repository: built-in defaults
    cfg = load_quickstart_config(config, overrides)
    run_quickstart(cfg)
    return 0
