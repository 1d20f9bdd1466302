"""Getting datasets in and out: LeRobot v3.0 validation/import, diffusion_policy zarr replay buffers.

- :func:`validate_dataset` checks any LeRobot dataset directory file by file (info.json, tasks,
  episode metadata, every data parquet and MP4 it references) and raises :class:`DatasetError`
  naming the first bad file; a v2.x dataset gets the lerobot conversion command.
- :func:`import_lerobot` validates a v3.0 directory and copies it (atomically) to ``dst``.
- :func:`import_zarr` reads a replay buffer (``data/<key>`` arrays of N frames,
  ``meta/episode_ends``) and records it through :class:`EpisodeRecorder`; :func:`export_zarr`
  writes one back. Key mapping: ``action`` <-> ``action``; ``state``/``agent_pos`` <->
  ``observation.state``; an (N, H, W, 3) uint8 array ``k`` <-> ``observation.images.k``; any
  other ``k`` <-> ``observation.k``. Videos are lossy, so images come back close, not equal.
- :func:`read_episode` gives one episode's columns and decoded camera frames as numpy arrays.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from robopolicy.data import features as F
from robopolicy.data.recorder import (
    DatasetError,
    EpisodeRecorder,
    read_episodes,
    read_info,
    read_parquet,
)
from robopolicy.utils.files import atomic_directory

CONVERT_CMD = ("python -m lerobot.datasets.v30.convert_dataset_v21_to_v30 --repo-id={repo_id} "
               "--root={root} --push-to-hub=false")


@dataclass
class DatasetReport:
    """A validated dataset's shape."""

    root: str
    fps: int
    episodes: int
    frames: int
    tasks: list[str]
    features: dict[str, Any]
    files_checked: list[str] = field(default_factory=list)


def check_version(root: Path, info: dict) -> None:
    """v3.0 only; v2.x gets the conversion command lerobot ships."""
    version = str(info.get("codebase_version", "?"))
    if version.startswith("v2"):
        cmd = CONVERT_CMD.format(repo_id=f"local/{Path(root).name}", root=root)
        raise DatasetError(f"{Path(root) / 'meta/info.json'}: LeRobot dataset {version}; robopolicy reads v3.0. "
                           f"Convert it with lerobot's script (in place):\n    {cmd}")
    if version != "v3.0":
        raise DatasetError(f"{Path(root) / 'meta/info.json'}: unsupported codebase_version {version!r} (need v3.0)")


def _video_frames(path: Path) -> tuple[int, tuple[int, int]]:
    import av

    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            n = sum(1 for _ in container.decode(stream))
            return n, (stream.codec_context.height, stream.codec_context.width)
    except (av.error.FFmpegError, IndexError, OSError) as exc:
        raise DatasetError(f"{path}: unreadable MP4 ({exc})") from None


def validate_dataset(root: str | Path, decode_videos: bool = True) -> DatasetReport:
    """Check a LeRobot v3.0 dataset on disk; raises :class:`DatasetError` naming the bad file."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"{root}: no such dataset directory")
    info = read_info(root)
    check_version(root, info)
    checked = [str(root / "meta/info.json")]
    tasks_path = root / "meta/tasks.parquet"
    tasks = read_parquet(tasks_path, "task table").to_pandas()
    checked.append(str(tasks_path))
    episodes = read_episodes(root, committed_only=False)
    if episodes is None:
        raise DatasetError(f"{root / 'meta/episodes'}: no episode metadata files")
    n = int(info["total_episodes"])
    got = sorted(int(i) for i in episodes[F.EPISODE_INDEX].to_pylist())
    if got[:n] != list(range(n)):
        raise DatasetError(f"{root / 'meta/episodes'}: episode indices {got[:10]}... do not cover 0..{n - 1} "
                           f"(info.json total_episodes={n})")
    episodes = episodes.filter(pc.less(episodes[F.EPISODE_INDEX], n))
    hf_features = {k: ft for k, ft in info["features"].items() if ft["dtype"] not in ("video",)}
    rows = episodes.to_pylist()
    data_files: dict[Path, list[dict]] = {}
    for row in rows:
        path = root / info["data_path"].format(chunk_index=row["data/chunk_index"], file_index=row["data/file_index"])
        data_files.setdefault(path, []).append(row)
    for path, eps in data_files.items():
        table = read_parquet(path, "frames")
        checked.append(str(path))
        for key, ft in hf_features.items():
            if key not in table.column_names:
                raise DatasetError(f"{path}: column {key!r} (a declared feature) is missing")
            if ft["dtype"] == "image":
                continue
            sample = np.asarray(table[key][0].as_py())
            want = tuple(ft["shape"])
            if sample.shape != want and not (want == (1,) and sample.shape == ()):
                raise DatasetError(f"{path}: feature {key!r} has shape {sample.shape} per frame, "
                                   f"info.json declares {want}")
        idx = np.asarray(table[F.EPISODE_INDEX].to_numpy())
        for row in eps:
            count = int((idx == row[F.EPISODE_INDEX]).sum())
            if count != row["length"]:
                raise DatasetError(f"{path}: episode {row[F.EPISODE_INDEX]} has {count} frames, "
                                   f"its metadata says {row['length']}")
    total = sum(r["length"] for r in rows)
    if total != info["total_frames"]:
        raise DatasetError(f"{root / 'meta/info.json'}: total_frames={info['total_frames']} but the episodes "
                           f"hold {total}")
    fps = int(info["fps"])
    for key in [k for k, ft in info["features"].items() if ft["dtype"] == "video"]:
        files: dict[Path, float] = {}
        for row in rows:
            path = root / info["video_path"].format(video_key=key, chunk_index=row[f"videos/{key}/chunk_index"],
                                                    file_index=row[f"videos/{key}/file_index"])
            files[path] = max(files.get(path, 0.0), float(row[f"videos/{key}/to_timestamp"]))
        for path, end in files.items():
            if not path.is_file():
                raise DatasetError(f"{path}: missing video ({key})")
            if decode_videos:
                frames, hw = _video_frames(path)
                if frames < round(end * fps) - 1:
                    raise DatasetError(f"{path}: {frames} frames, but episodes reference up to {end:.2f} s "
                                       f"({round(end * fps)} frames); truncated?")
                want = tuple(info["features"][key]["shape"][:2])
                if hw != want:
                    raise DatasetError(f"{path}: video is {hw[0]}x{hw[1]}, feature {key!r} declares {want}")
            checked.append(str(path))
    return DatasetReport(str(root), fps, n, int(info["total_frames"]), list(tasks.index), info["features"], checked)


def load_lerobot_dataset(root: str | Path, validate: bool = True, **kwargs: Any):
    """lerobot's ``LeRobotDataset`` for a local directory (validated first; never touches the hub)."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    if validate:
        validate_dataset(root, decode_videos=False)
    kwargs.setdefault("video_backend", "pyav")
    return LeRobotDataset(f"local/{Path(root).name}", root=root, **kwargs)


def import_lerobot(src: str | Path, dst: str | Path | None = None) -> DatasetReport:
    """Validate a LeRobot v3.0 dataset and, with ``dst``, copy it there atomically."""
    report = validate_dataset(src)
    if dst is None:
        return report
    dst = Path(dst)
    if dst.exists():
        raise DatasetError(f"{dst}: already exists")
    try:
        with atomic_directory(dst, create=False) as tmp:
            shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(".staging", ".*.tmp", ".robopolicy.lock", ".gen*"))
    except OSError as exc:
        raise DatasetError(f"{dst}: could not copy ({exc.strerror or exc}); nothing written") from exc
    return validate_dataset(dst, decode_videos=False)


# --------------------------------------------------------------------------------------------
# Reading episodes back
# --------------------------------------------------------------------------------------------


def decode_video_segment(path: Path, start_s: float, end_s: float, fps: int) -> np.ndarray:
    """Frames of an MP4 with ``start_s <= pts < end_s`` as (T, H, W, 3) uint8."""
    import av

    half = 0.5 / fps
    out = []
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            for frame in container.decode(stream):
                t = float(frame.pts * stream.time_base)
                if t < start_s - half:
                    continue
                if t >= end_s - half:
                    break
                out.append(frame.to_ndarray(format="rgb24"))
    except av.error.FFmpegError as exc:
        raise DatasetError(f"{path}: unreadable MP4 ({exc})") from None
    return np.stack(out) if out else np.zeros((0, 0, 0, 3), np.uint8)


def read_episode(root: str | Path, episode: int, videos: bool = True) -> dict[str, Any]:
    """Episode ``episode``'s features as numpy arrays (T, ...), camera frames decoded, plus ``task``."""
    root = Path(root)
    info = read_info(root)
    n = int(info["total_episodes"])
    if not 0 <= episode < n:
        raise DatasetError(f"episode {episode} out of range: {root} has {n} episodes (0..{n - 1})")
    episodes = read_episodes(root)
    row = episodes.filter(pc.equal(episodes[F.EPISODE_INDEX], episode)).to_pylist()[0]
    path = root / info["data_path"].format(chunk_index=row["data/chunk_index"], file_index=row["data/file_index"])
    table = read_parquet(path, "frames")
    table = table.filter(pc.equal(table[F.EPISODE_INDEX], episode))
    out: dict[str, Any] = {}
    for key, ft in info["features"].items():
        if ft["dtype"] in ("video", "image"):
            continue
        values = table[key].to_pylist()
        out[key] = np.asarray(values, dtype=ft["dtype"]).reshape((len(values), *ft["shape"]))
    tasks = read_parquet(root / "meta/tasks.parquet", "task table").to_pandas()
    out["task"] = [tasks.index[int(i)] for i in out[F.TASK_INDEX].reshape(-1)]
    if videos:
        fps = int(info["fps"])
        for key in [k for k, ft in info["features"].items() if ft["dtype"] == "video"]:
            vpath = root / info["video_path"].format(video_key=key, chunk_index=row[f"videos/{key}/chunk_index"],
                                                     file_index=row[f"videos/{key}/file_index"])
            if not vpath.is_file():
                raise DatasetError(f"{vpath}: missing video ({key}, episode {episode})")
            frames = decode_video_segment(vpath, row[f"videos/{key}/from_timestamp"],
                                          row[f"videos/{key}/to_timestamp"], fps)
            if len(frames) != row["length"]:
                raise DatasetError(f"{vpath}: episode {episode} has {len(frames)} video frames, "
                                   f"expected {row['length']}")
            out[key] = frames
    out["_meta"] = row
    return out


# --------------------------------------------------------------------------------------------
# diffusion_policy zarr replay buffers
# --------------------------------------------------------------------------------------------


def _zarr_key_to_feature(key: str, arr: Any) -> str:
    if key == "action":
        return F.ACTION
    if key in ("state", "agent_pos"):
        return F.STATE
    if arr.ndim == 4 and arr.shape[-1] == 3 and arr.dtype == np.uint8:
        return F.IMAGE_PREFIX + key
    return f"observation.{key}"


def _feature_to_zarr_key(key: str) -> str | None:
    if key == F.ACTION:
        return "action"
    if key == F.STATE:
        return "state"
    if key.startswith(F.IMAGE_PREFIX):
        return key[len(F.IMAGE_PREFIX):]
    if key.startswith("observation."):
        return key[len("observation."):]
    return None


def import_zarr(src: str | Path, dst: str | Path, fps: int = 10, task: str = "", robot_type: str | None = None,
                vcodec: str = "libsvtav1") -> DatasetReport:
    """A diffusion_policy replay buffer (``data/<key>``, ``meta/episode_ends``) as a LeRobot dataset."""
    import gymnasium as gym
    import zarr

    src = Path(src)
    try:
        group = zarr.open_group(str(src), mode="r")
        ends = np.asarray(group["meta/episode_ends"][:], dtype=np.int64)
        data = {k: group["data"][k] for k in group["data"].array_keys()}
    except (KeyError, FileNotFoundError, ValueError) as exc:
        raise DatasetError(f"{src}: not a replay buffer (need data/<key> arrays and meta/episode_ends): "
                           f"{exc!r}") from None
    if "action" not in data:
        raise DatasetError(f"{src}: replay buffer has no data/action (keys: {sorted(data)})")
    n = int(ends[-1]) if len(ends) else 0
    if len(ends) == 0 or np.any(np.diff(np.concatenate([[0], ends])) <= 0):
        raise DatasetError(f"{src}/meta/episode_ends: must be increasing and non-empty, got {ends[:10]}")
    for key, arr in data.items():
        if arr.shape[0] < n:
            raise DatasetError(f"{src}/data/{key}: {arr.shape[0]} rows but episode_ends reaches {n}")
    mapping = {k: _zarr_key_to_feature(k, arr) for k, arr in data.items()}
    obs_spaces = {}
    for key, arr in data.items():
        name = mapping[key]
        if name == F.ACTION:
            continue
        dtype = np.uint8 if name.startswith(F.IMAGE_PREFIX) else np.float32
        obs_spaces[name] = gym.spaces.Box(-np.inf if dtype == np.float32 else 0,
                                          np.inf if dtype == np.float32 else 255, arr.shape[1:], dtype)
    act = data["action"]
    features = F.dataset_features(obs_spaces, gym.spaces.Box(-np.inf, np.inf, act.shape[1:], np.float32))
    rec = EpisodeRecorder(dst, features, fps=fps, robot_type=robot_type, vcodec=vcodec)
    start = 0
    try:
        for end in ends:
            chunk = {mapping[k]: np.asarray(arr[start:end]) for k, arr in data.items()}
            rec.start_episode()
            for i in range(end - start):
                frame = {k: v[i] for k, v in chunk.items()}
                frame[F.ORACLE_ACTION] = chunk[F.ACTION][i]
                rec.add_frame(frame, task=task, wall_time=i / fps)
            rec.save_episode(success=True)
            start = int(end)
    finally:
        rec.close()
    return validate_dataset(dst, decode_videos=False)


def export_zarr(src: str | Path, dst: str | Path, extra: bool = False) -> list[str]:
    """Write a LeRobot dataset as a diffusion_policy replay buffer (zarr v2 format); returns its keys.

    ``extra=True`` also writes the non-observation features (``next.reward``, labels, timing)
    under their dataset names.
    """
    import zarr

    src, dst = Path(src), Path(dst)
    info = read_info(src)
    check_version(src, info)
    if dst.exists():
        raise DatasetError(f"{dst}: already exists")
    n = int(info["total_episodes"])
    chunks: dict[str, list[np.ndarray]] = {}
    ends = []
    total = 0
    for ep in range(n):
        episode = read_episode(src, ep)
        for key in info["features"]:
            name = _feature_to_zarr_key(key)
            if name is None:
                if not extra or key in (F.INDEX, F.EPISODE_INDEX, F.TASK_INDEX, F.FRAME_INDEX, F.TIMESTAMP):
                    continue
                name = key
            chunks.setdefault(name, []).append(episode[key])
        total += len(episode[F.ACTION])
        ends.append(total)
    try:
        with atomic_directory(dst, create=False) as tmp:
            group = zarr.open_group(str(tmp), mode="w", zarr_format=2)
            for name, parts in chunks.items():
                arr = np.concatenate(parts)
                chunk_rows = max(1, min(len(arr), 100 if arr.ndim == 4 else 10000))
                group.create_array(f"data/{name}", data=arr, chunks=(chunk_rows, *arr.shape[1:]))
            group.create_array("meta/episode_ends", data=np.asarray(ends, np.int64))
    except OSError as exc:
        raise DatasetError(f"{dst}: could not write ({exc.strerror or exc}); nothing written") from exc
    return sorted(chunks)
