"""``robopolicy dataset``: inspect, render, split, filter, import and export LeRobot datasets.

    robopolicy dataset info DIR
    robopolicy dataset viz DIR --episode 3 --out ep3.mp4
    robopolicy dataset filter DIR --success --out DIR_ok
    robopolicy dataset split DIR --by task --out DIR_split
    robopolicy dataset import replay.zarr --out DIR --fps 10 --task "push the T"
    robopolicy dataset import OTHER_LEROBOT_DIR [--out DIR]   # validate (and copy)
    robopolicy dataset export DIR --out replay.zarr
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from robopolicy.config import load_config


@dataclass
class DatasetCommandConfig:
    """Options shared by the ``dataset`` subcommands (set by flags, a YAML file or key=value)."""

    episode: int = 0
    out: str | None = None
    by: str = "success"  # split: success or task
    success: bool | None = None  # filter: keep successful (true) or failed (false) episodes
    task: str | None = None  # filter: keep episodes whose task contains this text
    fps: int = 10  # zarr import
    instruction: str = ""  # zarr import: task text of every episode
    extra: bool = False  # zarr export: also labels, rewards, timing
    json: bool = False  # info: print JSON


def add_parser(sub: argparse._SubParsersAction) -> None:
    ds = sub.add_parser("dataset", help="LeRobot datasets: info, viz, split, filter, import, export")
    dsub = ds.add_subparsers(dest="dataset_command", metavar="DATASET_COMMAND")
    dsub.required = True

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("path", help="dataset directory (or zarr store for import)")
        p.add_argument("--config", help="YAML config (DatasetCommandConfig)")
        p.add_argument("overrides", nargs="*", metavar="key=value")

    p = dsub.add_parser("info", help="features, episodes, frames, fps, tasks, success share")
    common(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)
    p = dsub.add_parser("viz", help="render an episode: cameras beside action and label curves (mp4)")
    common(p)
    p.add_argument("--episode", type=int)
    p.add_argument("--out", help="output mp4 (default: ep<K>.mp4)")
    p.set_defaults(func=cmd_viz)
    p = dsub.add_parser("filter", help="copy the episodes matching --success/--failure and/or --task")
    common(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--success", action="store_true", help="keep successful episodes")
    g.add_argument("--failure", action="store_true", help="keep failed episodes")
    p.add_argument("--task", help="keep episodes whose task contains this text")
    p.add_argument("--out", help="new dataset directory")
    p.set_defaults(func=cmd_filter)
    p = dsub.add_parser("split", help="one dataset per outcome (success/failure) or per task")
    common(p)
    p.add_argument("--by", choices=["success", "task"])
    p.add_argument("--out", help="directory for the split datasets")
    p.set_defaults(func=cmd_split)
    p = dsub.add_parser("import", help="a zarr replay buffer, or validate (and copy) a LeRobot v3 dataset")
    common(p)
    p.add_argument("--out", help="destination dataset directory")
    p.add_argument("--fps", type=int)
    p.add_argument("--task", dest="instruction", help="task text for a zarr import")
    p.set_defaults(func=cmd_import)
    p = dsub.add_parser("export", help="a dataset as a diffusion_policy zarr replay buffer")
    common(p)
    p.add_argument("--out", help="output zarr directory")
    p.add_argument("--extra", action="store_true", help="also export labels, rewards and timing")
    p.set_defaults(func=cmd_export)


def _cfg(args: argparse.Namespace) -> DatasetCommandConfig:
    over = []
    for key in ("episode", "out", "by", "task", "fps", "instruction"):
        value = getattr(args, key, None)
        if value is not None:
            over.append(f"{key}={json.dumps(value)}")
    if getattr(args, "success", False):
        over.append("success=true")
    if getattr(args, "failure", False):
        over.append("success=false")
    for flag in ("extra", "json"):
        if getattr(args, flag, False):
            over.append(f"{flag}=true")
    return load_config(DatasetCommandConfig, args.config, over + list(args.overrides))


def _run(fn) -> int:
    from robopolicy.data.recorder import DatasetError

    try:
        return fn() or 0
    except DatasetError as exc:
        print(f"robopolicy dataset: {exc}")
        return 1


def cmd_info(args: argparse.Namespace) -> int:
    from robopolicy.data.inspect import dataset_info, format_info

    cfg = _cfg(args)

    def go() -> None:
        d = dataset_info(args.path)
        print(json.dumps(d, indent=2) if cfg.json else format_info(d))

    return _run(go)


def cmd_viz(args: argparse.Namespace) -> int:
    from robopolicy.data.inspect import render_episode

    cfg = _cfg(args)
    return _run(lambda: print(f"wrote {render_episode(args.path, cfg.episode, cfg.out or f'ep{cfg.episode}.mp4')}"))


def _need_out(cfg: DatasetCommandConfig, what: str) -> str:
    if not cfg.out:
        from robopolicy.config import ConfigError

        raise ConfigError(f"dataset {what}: --out is required")
    return cfg.out


def cmd_filter(args: argparse.Namespace) -> int:
    from robopolicy.data.inspect import filter_dataset, select_episodes

    cfg = _cfg(args)
    out = _need_out(cfg, "filter")

    def go() -> None:
        kept = select_episodes(args.path, success=cfg.success, task=cfg.task)
        filter_dataset(args.path, out, success=cfg.success, task=cfg.task)
        print(f"kept {len(kept)} episode(s) -> {out}")

    return _run(go)


def cmd_split(args: argparse.Namespace) -> int:
    from robopolicy.data.inspect import split_dataset

    cfg = _cfg(args)
    out = _need_out(cfg, "split")
    return _run(lambda: [print(f"{name}: {path}") for name, path in split_dataset(args.path, out, cfg.by).items()]
                and None)


def cmd_import(args: argparse.Namespace) -> int:
    from robopolicy.data.interchange import import_lerobot, import_zarr

    cfg = _cfg(args)

    def go() -> None:
        path = Path(args.path)
        if (path / "meta" / "info.json").exists() or not ((path / ".zgroup").exists() or (path / "zarr.json").exists()):
            report = import_lerobot(path, cfg.out)
            print(f"valid LeRobot {report.episodes} episodes / {report.frames} frames at {report.fps} fps"
                  + (f"; copied to {cfg.out}" if cfg.out else ""))
        else:
            report = import_zarr(path, _need_out(cfg, "import"), fps=cfg.fps, task=cfg.instruction)
            print(f"imported {report.episodes} episodes / {report.frames} frames -> {cfg.out}")

    return _run(go)


def cmd_export(args: argparse.Namespace) -> int:
    from robopolicy.data.interchange import export_zarr

    cfg = _cfg(args)
    out = _need_out(cfg, "export")
    return _run(lambda: print(f"exported {', '.join(export_zarr(args.path, out, extra=cfg.extra))} -> {out}"))
