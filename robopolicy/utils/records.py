"""Run records: every train / eval / refine / bench run leaves ``<out>/summary.json``.

A record says what ran (``kind``, ``command``, ``config_digest``, ``commit``), on what
(``machine``), for how long (``started_at``, ``wall_time_s``), over which ``seeds`` and how many
``episodes``, and what it measured (``metrics``). The published tables are generated from
records of this shape checked in under ``results/`` (see ``robopolicy results``).

Usage::

    started = time.time()
    ...  # the run
    write_summary(out, kind="eval", config=cfg, seeds=[0], episodes=100,
                  metrics={"success_rate": 0.93}, started_at=started)
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from robopolicy.utils.files import atomic_write_text

SUMMARY_NAME = "summary.json"
SCHEMA_VERSION = 1
# The keys every record holds, in the order they are written.
RECORD_KEYS = ("schema", "kind", "commit", "config_digest", "seeds", "episodes", "machine",
               "wall_time_s", "started_at", "command", "metrics")
KINDS = ("train", "eval", "refine", "bench", "collect", "diagnose", "world", "fleet")

_SOURCE_ROOT = Path(__file__).resolve().parents[2]


def _plain(value: Any) -> Any:
    """Turn dataclasses, paths, tuples, sets and numpy scalars into JSON-ready values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN / inf; a missing number reads as null
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        return _plain(value.item())  # numpy / torch scalars
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def config_digest(config: Any) -> str | None:
    """sha256 of the resolved config serialised canonically (sorted keys, no spaces).

    ``config`` is a config dataclass or a mapping; two configs that resolve to the same values
    have the same digest whatever their key order. None gives None.
    """
    if config is None:
        return None
    text = json.dumps(_plain(config), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def git_commit(root: str | Path | None = None) -> dict[str, Any] | None:
    """``{"sha": HEAD, "dirty": bool}`` of the git checkout holding ``root`` (default: this
    source tree), or None when it is not a git checkout or git is missing. ``dirty`` means a
    tracked file differs from HEAD."""
    root = Path(root) if root is not None else _SOURCE_ROOT

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                              text=True, timeout=10).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"sha": sha, "dirty": dirty}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info() -> dict[str, Any]:
    """CPU model, logical cores, torch threads and GPU name of this machine.

    torch is asked only when this process has already imported it (a bench of the real-time
    layer has not, and its record says null rather than pay for the import).
    """
    torch = sys.modules.get("torch")
    threads, gpu = None, None
    if torch is not None:
        threads = int(torch.get_num_threads())
        try:
            if torch.cuda.is_available():
                gpu = torch.cuda.get_device_name(torch.cuda.current_device())
        except Exception:  # a broken driver must not lose the run's record
            gpu = None
    return {"cpu": _cpu_model(), "logical_cores": os.cpu_count(), "torch_threads": threads,
            "gpu": gpu, "platform": platform.platform(), "python": platform.python_version()}


def _iso(when: float | str | _dt.datetime | None) -> str | None:
    if when is None or isinstance(when, str):
        return when
    if isinstance(when, (int, float)):
        when = _dt.datetime.fromtimestamp(when, tz=_dt.timezone.utc)
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.timezone.utc)
    return when.astimezone(_dt.timezone.utc).isoformat(timespec="seconds")


def build_summary(*, kind: str, config: Any = None, seeds: Iterable[int] | int | None = None,
                  episodes: int | None = None, metrics: Mapping[str, Any] | None = None,
                  wall_time_s: float | None = None,
                  started_at: float | str | _dt.datetime | None = None,
                  command: list[str] | None = None, commit: Any = "auto",
                  machine: Mapping[str, Any] | None | str = "auto",
                  extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The record as a dict (see the module docstring).

    ``started_at`` is a unix time (``time.time()``), a datetime or an ISO string; given a unix
    time and no ``wall_time_s``, the wall time is measured up to now. ``command`` defaults to
    ``sys.argv``; ``commit`` and ``machine`` default to this checkout and this machine. ``extra``
    adds keys after the standard ones (it may not replace one).
    """
    if not kind or not isinstance(kind, str):
        raise ValueError(f"kind must name the run, one of {KINDS} or another word; got {kind!r}")
    if wall_time_s is None and isinstance(started_at, (int, float)):
        wall_time_s = time.time() - float(started_at)
    if isinstance(seeds, int):
        seeds = [seeds]
    record: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "kind": kind,
        "commit": git_commit() if commit == "auto" else commit,
        "config_digest": config_digest(config),
        "seeds": None if seeds is None else [int(s) for s in seeds],
        "episodes": None if episodes is None else int(episodes),
        "machine": machine_info() if machine == "auto" else machine,
        "wall_time_s": None if wall_time_s is None else round(float(wall_time_s), 3),
        "started_at": _iso(started_at),
        "command": _command_line() if command is None else [str(c) for c in command],
        "metrics": _plain(dict(metrics or {})),
    }
    for key, value in (extra or {}).items():
        if key in record:
            raise ValueError(f"extra key {key!r} would replace the record's own field")
        record[key] = _plain(value)
    return record


def write_summary(out: str | Path, **fields: Any) -> Path:
    """Build the record (keyword arguments of :func:`build_summary`) and write it atomically
    to ``<out>/summary.json``; returns the path."""
    record = build_summary(**fields)
    text = json.dumps(record, indent=2, allow_nan=False) + "\n"
    return atomic_write_text(Path(out) / SUMMARY_NAME, text)


def read_summary(path: str | Path) -> dict[str, Any]:
    """Read a record (a ``summary.json`` or a file under ``results/``) and check its keys."""
    path = Path(path)
    if path.is_dir():
        path = path / SUMMARY_NAME
    record = json.loads(path.read_text())
    missing = [k for k in RECORD_KEYS if k not in record]
    if missing:
        raise ValueError(f"{path}: not a run record, missing {', '.join(missing)}")
    if not isinstance(record["metrics"], dict):
        raise ValueError(f"{path}: metrics must be a mapping, got {type(record['metrics']).__name__}")
    return record


def _command_line() -> list[str]:
    """``sys.argv`` with the program named as a user types it: ``robopolicy`` for the CLI (however it
    was started), a script by its path relative to the working directory, never an absolute path."""
    argv = [str(a) for a in sys.argv]
    if not argv:
        return argv
    prog = Path(argv[0])
    if prog.name in ("robopolicy", "__main__.py") and (prog.name == "robopolicy" or prog.parent.name == "robopolicy"):
        argv[0] = "robopolicy"
    elif prog.is_absolute():
        try:
            argv[0] = str(prog.relative_to(Path.cwd()))
        except ValueError:
            argv[0] = prog.name
    return argv

