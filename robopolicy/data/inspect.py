"""Look into datasets: a summary, an episode rendered with its curves, split and filter.

Split and filter select episodes and copy them with lerobot's own ``delete_episodes`` into a
hidden temporary directory, which is renamed to the destination only when complete (so a
crash or a full disk never leaves a half-written dataset under the destination's name).
robopolicy's per-episode columns (success, seed, lateness) are carried over.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from robopolicy.data import features as F
from robopolicy.data.interchange import check_version, read_episode, validate_dataset
from robopolicy.data.recorder import DatasetError, atomic_write_table, episodes_files, read_episodes, read_info
from robopolicy.utils.files import atomic_directory


def episode_success(root: str | Path) -> list[bool] | None:
    """Per-episode oracle success: the ``robopolicy/success`` column, else the last ``next.success``."""
    root = Path(root)
    episodes = read_episodes(root)
    if episodes is None:
        return []
    if F.EPISODE_SUCCESS in episodes.column_names:
        values = episodes[F.EPISODE_SUCCESS].to_pylist()
        if all(v is not None for v in values):
            return [bool(v) for v in values]
    info = read_info(root)
    if F.SUCCESS not in info["features"]:
        return None
    out = []
    for row in episodes.select([F.EPISODE_INDEX, "data/chunk_index", "data/file_index", "dataset_to_index"]).to_pylist():
        path = root / info["data_path"].format(chunk_index=row["data/chunk_index"], file_index=row["data/file_index"])
        table = pq.read_table(path, columns=[F.INDEX, F.SUCCESS])
        idx = np.asarray(table[F.INDEX].to_numpy())
        last = np.flatnonzero(idx == row["dataset_to_index"] - 1)
        out.append(bool(np.asarray(table[F.SUCCESS][int(last[0])].as_py()).any()) if len(last) else False)
    return out


def dataset_info(root: str | Path) -> dict[str, Any]:
    """Features, episodes, frames, fps, tasks (with episode counts) and success share."""
    root = Path(root)
    info = read_info(root)
    check_version(root, info)
    episodes = read_episodes(root)
    task_counts: Counter[str] = Counter()
    late = None
    if episodes is not None:
        for tasks in episodes["tasks"].to_pylist():
            task_counts.update(tasks)
        if F.EPISODE_LATE_FRAMES in episodes.column_names:
            late = int(sum(v or 0 for v in episodes[F.EPISODE_LATE_FRAMES].to_pylist()))
    success = episode_success(root)
    return {
        "root": str(root),
        "codebase_version": info["codebase_version"],
        "robot_type": info.get("robot_type"),
        "fps": info["fps"],
        "episodes": info["total_episodes"],
        "frames": info["total_frames"],
        "duration_s": info["total_frames"] / info["fps"],
        "features": {k: {"dtype": ft["dtype"], "shape": list(ft["shape"])} for k, ft in info["features"].items()},
        "tasks": dict(task_counts),
        "success_share": (sum(success) / len(success)) if success else None,
        "successes": sum(success) if success else None,
        "late_frames": late,
    }


def format_info(d: dict[str, Any]) -> str:
    """Human-readable :func:`dataset_info`."""
    lines = [f"dataset {d['root']} (LeRobot {d['codebase_version']}, robot {d['robot_type']})",
             f"  episodes {d['episodes']}, frames {d['frames']}, fps {d['fps']} ({d['duration_s']:.1f} s)"]
    if d["success_share"] is not None:
        lines.append(f"  success {d['successes']}/{d['episodes']} ({d['success_share']:.0%})")
    if d["late_frames"] is not None:
        lines.append(f"  late frames {d['late_frames']}")
    lines.append("  features:")
    for key, ft in d["features"].items():
        lines.append(f"    {key:<28} {ft['dtype']:<8} {tuple(ft['shape'])}")
    lines.append(f"  tasks ({len(d['tasks'])}):")
    for task, count in sorted(d["tasks"].items(), key=lambda kv: -kv[1]):
        lines.append(f"    {count:>5} ep  {task}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# viz
# --------------------------------------------------------------------------------------------

_COLORS = [(230, 25, 75), (60, 180, 75), (0, 130, 200), (245, 130, 48), (145, 30, 180), (70, 240, 240),
           (240, 50, 230), (128, 128, 0)]


def _curve_panels(series: dict[str, np.ndarray], width: int, height: int) -> tuple[np.ndarray, list[tuple]]:
    """A static plot of each (T, D) series stacked vertically; returns the image and panel boxes."""
    import cv2

    img = np.full((height, width, 3), 255, np.uint8)
    n = max(1, len(series))
    ph = height // n
    boxes = []
    for p, (name, values) in enumerate(series.items()):
        values = values.reshape(len(values), -1).astype(np.float64)
        y0, x0, x1 = p * ph + 16, 8, width - 8
        y1 = (p + 1) * ph - 6
        cv2.putText(img, name, (x0, y0 - 4), cv2.FONT_HERSHEY_SIMPLEX, 0.38, (0, 0, 0), 1, cv2.LINE_AA)
        cv2.rectangle(img, (x0, y0), (x1, y1), (200, 200, 200), 1)
        lo, hi = np.nanmin(values), np.nanmax(values)
        span = (hi - lo) or 1.0
        t = len(values)
        xs = x0 + (np.arange(t) / max(t - 1, 1)) * (x1 - x0)
        for d in range(values.shape[1]):
            ys = y1 - (values[:, d] - lo) / span * (y1 - y0)
            pts = np.stack([xs, ys], 1).astype(np.int32).reshape(-1, 1, 2)
            cv2.polylines(img, [pts], False, _COLORS[d % len(_COLORS)], 1, cv2.LINE_AA)
        boxes.append((x0, y0, x1, y1))
    return img, boxes


def render_episode(root: str | Path, episode: int, out: str | Path, scale: int = 3) -> Path:
    """Camera frames (target box drawn if labelled) beside action and label curves, as an MP4."""
    import cv2

    from robopolicy.utils.video import write_mp4

    root = Path(root)
    info = read_info(root)
    ep = read_episode(root, episode)
    cams = [k for k, ft in info["features"].items() if ft["dtype"] in ("video",)]
    t = len(ep[F.ACTION])
    series = {k: ep[k] for k in (F.ACTION, F.ORACLE_ACTION, F.STATE, F.TARGET_BOX, F.TARGET_VISIBLE, F.REWARD,
                                 F.LATENESS) if k in ep}
    frames_h = max(ep[c].shape[1] for c in cams) * scale if cams else 256
    panel, boxes = _curve_panels(series, 360, max(frames_h, 60 * len(series)))
    height = panel.shape[0]

    def compose(i: int) -> np.ndarray:
        tiles = []
        for cam in cams:
            img = np.ascontiguousarray(ep[cam][i])
            img = cv2.resize(img, (img.shape[1] * scale, img.shape[0] * scale), interpolation=cv2.INTER_NEAREST)
            if cam.endswith("front") and F.TARGET_BOX in ep and (F.TARGET_VISIBLE not in ep or ep[F.TARGET_VISIBLE][i].any()):
                x0, y0, x1, y1 = (ep[F.TARGET_BOX][i] * scale).astype(int)
                cv2.rectangle(img, (x0, y0), (x1, y1), (255, 255, 0), 1)
            tile = np.zeros((height, img.shape[1], 3), np.uint8)
            tile[: img.shape[0]] = img
            cv2.putText(tile, cam.split(".")[-1], (4, min(height - 4, img.shape[0] + 14)),
                        cv2.FONT_HERSHEY_SIMPLEX, 0.4, (255, 255, 255), 1, cv2.LINE_AA)
            tiles.append(tile)
        plot = panel.copy()
        for x0, y0, x1, y1 in boxes:
            x = int(x0 + i / max(t - 1, 1) * (x1 - x0))
            cv2.line(plot, (x, y0), (x, y1), (0, 0, 0), 1)
        cv2.putText(plot, f"ep {episode} t={i}/{t - 1}", (8, height - 6), cv2.FONT_HERSHEY_SIMPLEX, 0.4,
                    (0, 0, 0), 1, cv2.LINE_AA)
        return np.concatenate(tiles + [plot], axis=1)

    return write_mp4(out, (compose(i) for i in range(t)), info["fps"])


# --------------------------------------------------------------------------------------------
# split / filter
# --------------------------------------------------------------------------------------------


def select_episodes(root: str | Path, success: bool | None = None, task: str | None = None) -> list[int]:
    """Episode indices matching the oracle outcome and/or containing the task text."""
    root = Path(root)
    episodes = read_episodes(root)
    if episodes is None:
        return []
    keep = list(range(episodes.num_rows))
    if success is not None:
        outcome = episode_success(root)
        if outcome is None:
            raise DatasetError(f"{root}: no success information (no next.success feature)")
        keep = [i for i in keep if outcome[i] == success]
    if task is not None:
        tasks = episodes["tasks"].to_pylist()
        keep = [i for i in keep if any(task == t or task in t for t in tasks[i])]
    return keep


def copy_episodes(src: str | Path, dst: str | Path, keep: list[int]) -> Path:
    """A new dataset at ``dst`` with the episodes ``keep`` of ``src`` (renumbered 0..), atomically."""
    from lerobot.datasets.dataset_tools import delete_episodes

    from robopolicy.data.interchange import load_lerobot_dataset

    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise DatasetError(f"{dst}: already exists")
    info = read_info(src)
    check_version(src, info)
    n = int(info["total_episodes"])
    bad = [i for i in keep if not 0 <= i < n]
    if bad:
        raise DatasetError(f"episode {bad[0]} out of range: {src} has {n} episodes (0..{n - 1})")
    if not keep:
        raise DatasetError(f"{src}: no episode matches; nothing written to {dst}")
    try:
        with atomic_directory(dst, create=False) as tmp:
            drop = [i for i in range(n) if i not in set(keep)]
            if drop:
                delete_episodes(load_lerobot_dataset(src), sorted(drop), output_dir=tmp, repo_id=f"local/{dst.name}")
                _carry_episode_columns(src, tmp, sorted(keep))
            else:
                shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(".staging", ".*.tmp", ".robopolicy.lock",
                                                                        ".gen*"))
            validate_dataset(tmp, decode_videos=False)
    except BaseException as exc:
        if isinstance(exc, OSError):
            raise DatasetError(f"{dst}: could not write ({exc.strerror or exc}); nothing written") from exc
        raise
    return dst


def _carry_episode_columns(src: Path, dst: Path, kept: list[int]) -> None:
    """Copy robopolicy's per-episode columns (dropped by lerobot's tools) into the new dataset."""
    source = read_episodes(src)
    cols = [c for c in source.column_names if c.startswith("robopolicy/")]
    if not cols:
        return
    values = {c: source[c].to_pylist() for c in cols}
    for path in episodes_files(dst):
        table = pq.read_table(path)
        new_idx = table[F.EPISODE_INDEX].to_pylist()
        for c in cols:
            if c not in table.column_names:
                table = table.append_column(c, pa.array([values[c][kept[i]] for i in new_idx],
                                                        source.schema.field(c).type))
        atomic_write_table(path, table)


def filter_dataset(src: str | Path, dst: str | Path, success: bool | None = None, task: str | None = None) -> Path:
    """Copy the episodes that match ``success`` and/or ``task`` into ``dst``."""
    return copy_episodes(src, dst, select_episodes(src, success=success, task=task))


def split_dataset(src: str | Path, out_dir: str | Path, by: str = "success") -> dict[str, Path]:
    """One dataset per value of ``by`` ("success": success/ and failure/; "task": task-<i>/)."""
    src, out_dir = Path(src), Path(out_dir)
    groups: dict[str, list[int]] = {}
    if by == "success":
        for name, value in (("success", True), ("failure", False)):
            groups[name] = select_episodes(src, success=value)
    elif by == "task":
        episodes = read_episodes(src)
        tasks = sorted({t for ts in episodes["tasks"].to_pylist() for t in ts})
        for i, task in enumerate(tasks):
            groups[f"task-{i:03d}"] = [j for j, ts in enumerate(episodes["tasks"].to_pylist()) if task in ts]
    else:
        raise ValueError(f"split by must be 'success' or 'task', got {by!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    return {name: copy_episodes(src, out_dir / name, keep) for name, keep in groups.items() if keep}
