"""Training cache: a LeRobot v3.0 dataset decoded once into a zarr store for random access.

    entry = ensure_cache("datasets/pf_dt")         # builds on first use, then reuses
    cache = TrainingCache(entry)
    frames = cache.read_frames("observation.images.front", [10, 9, 6])   # uint8 (3, C, H, W)

Layout of a cache entry (``<cache_dir>/<dataset name>-<content key>/``)::

    cache.zarr/                  zarr v3 group; attrs: fps, features, tasks, episodes, key, ...
      images/<camera key>        uint8 (N, C, H, W); shards of ``shard_frames`` frames holding
                                 one blosc-lz4 chunk per frame (few files, one frame per read)
      lowdim/<feature key>       every numeric column (state, action, labels, index, ...);
                                 shape (N, *feature shape), (N,) for shape-(1,) features
    stats.json                   normalization statistics (see ``robopolicy.data.stats``)

The entry name carries a key hashed from the dataset's content: the bytes of meta/info.json,
meta/tasks.parquet, meta/episodes/*.parquet and data/*.parquet, and each video's path, size and
mtime (``full_digest=True`` hashes the videos' bytes too). A dataset that changes gets a new key,
so a stale cache is never read. Entries are built in a temporary directory and renamed into
place once complete, under a file lock: a crash leaves no half-built entry, and concurrent
trainers (DataLoader workers, DDP ranks) build it once.

Video frames are matched to rows as LeRobot does: row ``i`` of episode ``e`` is the video frame
nearest to ``from_timestamp(e) + timestamp(i)``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from robopolicy.data.stats import ImageStats, StreamingStats, load_stats, save_stats
from robopolicy.data.errors import DatasetError
from robopolicy.utils.files import atomic_directory

CACHE_FORMAT = 1
CAMERA_DTYPES = ("video", "image")
NUMERIC_DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                  "uint32", "uint64", "bool")
CONVERT_V21 = (
    "python -m lerobot.datasets.v30.convert_dataset_v21_to_v30 --repo-id=<repo_id> --root=<dir> --push-to-hub=false"
)
_MAX_UINT64 = 2**64 - 1
BOOKKEEPING_KEYS = ("timestamp", "frame_index", "episode_index", "index", "task_index")  # no stats


# --------------------------------------------------------------------------- source dataset


@dataclass
class SourceDataset:
    """A LeRobot v3.0 dataset directory, checked for the files the cache needs."""

    root: Path
    info: dict
    tasks: list[str]  # task_index -> text
    episodes: list[dict]  # meta/episodes rows (without the per-episode stats columns)
    data_files: list[Path]
    video_files: list[Path]

    @property
    def fps(self) -> int:
        return int(self.info["fps"])

    @property
    def features(self) -> dict[str, dict]:
        return self.info["features"]

    @property
    def camera_keys(self) -> list[str]:
        return [k for k, ft in self.features.items() if ft["dtype"] in CAMERA_DTYPES]

    @property
    def numeric_keys(self) -> list[str]:
        return [k for k, ft in self.features.items() if ft["dtype"] in NUMERIC_DTYPES]

    @property
    def num_frames(self) -> int:
        return int(self.info["total_frames"])

    def video_path(self, episode: dict, key: str) -> Path:
        rel = self.info["video_path"].format(
            video_key=key,
            chunk_index=int(episode[f"videos/{key}/chunk_index"]),
            file_index=int(episode[f"videos/{key}/file_index"]),
        )
        return self.root / rel


def _read_parquet(path: Path, columns: list[str] | None = None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path, columns=columns)
    except FileNotFoundError:
        raise DatasetError(f"{path}: file is missing") from None
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: not a readable parquet file ({exc})") from None


def read_dataset(root: str | Path) -> SourceDataset:
    """Open and check a LeRobot v3.0 dataset directory; every problem names its file."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"{root}: dataset directory does not exist")
    info_path = root / "meta" / "info.json"
    if not info_path.is_file():
        raise DatasetError(f"{info_path}: file is missing (not a LeRobot dataset directory?)")
    try:
        info = json.loads(info_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{info_path}: not valid JSON ({exc})") from None
    version = str(info.get("codebase_version", ""))
    if version.startswith("v2") or version.startswith("v1"):
        raise DatasetError(f"{info_path}: dataset is LeRobot {version}; this loader reads v3.0. "
                           f"Convert it with: {CONVERT_V21}")
    if not version.startswith("v3"):
        raise DatasetError(f"{info_path}: codebase_version {version!r} is not v3.x")
    for field in ("fps", "features", "total_frames", "total_episodes", "data_path"):
        if field not in info:
            raise DatasetError(f"{info_path}: field {field!r} is missing")
    for key, ft in info["features"].items():
        if not isinstance(ft, dict) or "dtype" not in ft or "shape" not in ft:
            raise DatasetError(f"{info_path}: feature {key!r} lacks dtype/shape")
        ft["shape"] = tuple(ft["shape"])

    tasks_path = root / "meta" / "tasks.parquet"
    table = _read_parquet(tasks_path).to_pandas()
    if "task_index" not in table.columns:
        raise DatasetError(f"{tasks_path}: column 'task_index' is missing")
    tasks = [""] * len(table)
    for text, idx in zip(table.index, table["task_index"]):
        if not 0 <= int(idx) < len(tasks):
            raise DatasetError(f"{tasks_path}: task_index {idx} out of range")
        tasks[int(idx)] = str(text)

    ep_files = sorted((root / "meta" / "episodes").glob("*/*.parquet"))
    if not ep_files:
        raise DatasetError(f"{root / 'meta' / 'episodes'}: no episode metadata parquet files")
    episodes: list[dict] = []
    for path in ep_files:
        t = _read_parquet(path)
        cols = [c for c in t.column_names if not c.startswith("stats/")]
        episodes.extend(t.select(cols).to_pylist())
    # meta/info.json is the commit point (robopolicy's recorder writes it last): rows and episodes
    # past its totals belong to an interrupted commit and are ignored, as lerobot does.
    episodes = [e for e in episodes if int(e["episode_index"]) < int(info["total_episodes"])]
    episodes.sort(key=lambda e: int(e["episode_index"]))
    if len(episodes) != int(info["total_episodes"]):
        raise DatasetError(f"{root / 'meta' / 'episodes'}: holds {len(episodes)} episodes, "
                           f"meta/info.json says {info['total_episodes']}")

    data_files = sorted((root / "data").glob("*/*.parquet"))
    if not data_files and int(info["total_frames"]) > 0:
        raise DatasetError(f"{root / 'data'}: no data parquet files")
    needed = {
        root / info["data_path"].format(chunk_index=int(e["data/chunk_index"]), file_index=int(e["data/file_index"]))
        for e in episodes
    }
    for path in sorted(needed):
        if not path.is_file():
            raise DatasetError(f"{path}: data file is missing (referenced by meta/episodes)")

    src = SourceDataset(root, info, tasks, episodes, data_files, [])
    videos = set()
    for key, ft in info["features"].items():
        if ft["dtype"] != "video":
            continue
        for e in episodes:
            path = src.video_path(e, key)
            if not path.is_file():
                raise DatasetError(f"{path}: video file is missing (camera {key!r}, episode {e['episode_index']})")
            videos.add(path)
    src.video_files = sorted(videos)
    return src


def content_key(src: SourceDataset, full_digest: bool = False) -> str:
    """Hex digest that changes whenever the dataset's content does (see the module docstring)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"robopolicy-training-cache/{CACHE_FORMAT}".encode())
    meta_files = [src.root / "meta" / "info.json", src.root / "meta" / "tasks.parquet"]
    meta_files += sorted((src.root / "meta" / "episodes").glob("*/*.parquet"))
    for path in meta_files + src.data_files:
        h.update(str(path.relative_to(src.root)).encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    for path in src.video_files:
        st = path.stat()
        h.update(f"{path.relative_to(src.root)}:{st.st_size}:{st.st_mtime_ns}".encode())
        if full_digest:
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
    return h.hexdigest()


def default_cache_dir() -> Path:
    """``$ROBOPOLICY_CACHE_DIR`` or ``~/.cache/robopolicy/training``."""
    env = os.environ.get("ROBOPOLICY_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "robopolicy" / "training"


# --------------------------------------------------------------------------- building


def _column_to_numpy(table, key: str, shape: tuple[int, ...], dtype: str, path: Path) -> np.ndarray:
    """A parquet column of ``table`` as an array ``(n, *shape)`` (``(n,)`` for shape (1,))."""
    import pyarrow as pa

    if key not in table.column_names:
        raise DatasetError(f"{path}: column {key!r} (declared in meta/info.json) is missing")
    arr = table.column(key).combine_chunks()
    if isinstance(arr, pa.ExtensionArray):
        arr = arr.storage
    n = len(arr)
    if arr.null_count:
        raise DatasetError(f"{path}: column {key!r} has {arr.null_count} null values")
    while pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type):
        arr = arr.flatten()
    values = arr.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    size = int(np.prod(shape, dtype=np.int64))
    if values.size != n * size:
        raise DatasetError(f"{path}: column {key!r} holds {values.size // max(n, 1)} values per row, "
                           f"meta/info.json declares shape {tuple(shape)}")
    return values.reshape((n,) if tuple(shape) == (1,) else (n, *shape))


class _ShardWriter:
    """Collects frames of one image array shard by shard, so each shard is written once.

    A complete shard is encoded here (blosc per frame + the zarr v3 shard index and its crc32c):
    zarr-python's sharding pipeline costs ~0.8 ms per frame, ~20x the compression itself. Shards
    that arrive in pieces go through zarr. Either way the result is a plain zarr v3 array.
    """

    def __init__(self, array, shard: int, array_dir: Path | None = None):
        self.array = array
        self.shard = shard
        self.n = array.shape[0]
        self.dir = array_dir
        self.block: np.ndarray | None = None
        self.filled = np.zeros(shard, dtype=bool)
        self.current = -1

    def _write_shard(self, index: int, frames: np.ndarray) -> None:
        import google_crc32c
        import numcodecs.blosc

        parts, table, offset = [], np.full((self.shard, 2), _MAX_UINT64, dtype="<u8"), 0
        for j, frame in enumerate(frames):
            data = numcodecs.blosc.compress(np.ascontiguousarray(frame), b"lz4", 5, numcodecs.blosc.BITSHUFFLE)
            parts.append(data)
            table[j] = (offset, len(data))
            offset += len(data)
        index_bytes = table.tobytes()
        crc = np.array([google_crc32c.value(index_bytes)], dtype="<u4").tobytes()
        path = self.dir / "c" / str(index) / "0" / "0" / "0"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"".join(parts) + index_bytes + crc)

    def put(self, row: int, frame: np.ndarray) -> None:
        s = row // self.shard
        if s != self.current:
            self.flush()
            self.current = s
            self.block = np.zeros((self.shard, *self.array.shape[1:]), dtype=np.uint8)
            self.filled[:] = False
        self.block[row - s * self.shard] = frame
        self.filled[row - s * self.shard] = True

    def flush(self) -> None:
        if self.current < 0:
            return
        lo = self.current * self.shard
        hi = min(lo + self.shard, self.n)
        filled = self.filled[: hi - lo]
        if filled.all() and self.dir is not None:
            self._write_shard(self.current, self.block[: hi - lo])
        elif filled.all():
            self.array[lo:hi] = self.block[: hi - lo]
        else:  # rows arrived out of order: write the runs we have (zarr merges into the shard)
            edges = np.flatnonzero(np.diff(np.concatenate([[0], filled.astype(np.int8), [0]])))
            for a, b in zip(edges[0::2], edges[1::2]):
                self.array[lo + a: lo + b] = self.block[a:b]
        self.current = -1


def _decode_video(path: Path, targets: np.ndarray, rows: np.ndarray, shape_hw: tuple[int, int],
                  tolerance_s: float, sink) -> None:
    """Decode ``path`` once, front to back; ``sink(row, frame_chw)`` gets, for each target time,
    the frame nearest to it. ``targets`` must be sorted."""
    import av

    j = 0
    prev_t, prev_img = None, None

    def emit(t: float, img: np.ndarray) -> None:
        if abs(t - targets[j]) > tolerance_s:
            raise DatasetError(f"{path}: no frame near t={targets[j]:.4f}s (nearest at {t:.4f}s); "
                               f"video and data parquet disagree")
        sink(int(rows[j]), img)

    def convert(frame) -> np.ndarray:
        img = frame.to_ndarray(format="rgb24")
        if img.shape[:2] != shape_hw:
            raise DatasetError(f"{path}: frames are {img.shape[:2]}, meta/info.json declares {shape_hw}")
        return img.transpose(2, 0, 1)

    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for frame in container.decode(stream):
                if j >= len(targets):
                    break
                t = float(frame.pts * stream.time_base) if frame.pts is not None else float(frame.time)
                img = convert(frame)
                while j < len(targets) and targets[j] <= t:
                    if prev_t is not None and targets[j] - prev_t < t - targets[j]:
                        emit(prev_t, prev_img)
                    else:
                        emit(t, img)
                    j += 1
                prev_t, prev_img = t, img
    except DatasetError:
        raise
    except (av.error.FFmpegError, ValueError, IndexError) as exc:
        raise DatasetError(f"{path}: cannot decode video ({exc})") from None
    while j < len(targets):  # targets past the last decoded frame
        if prev_t is None:
            raise DatasetError(f"{path}: video ends before t={targets[j]:.4f}s (truncated?)")
        emit(prev_t, prev_img)
        j += 1


def _decode_png(value, key: str, path: Path) -> np.ndarray:
    import io

    from PIL import Image

    data = value.get("bytes") if isinstance(value, dict) else None
    if data is None:
        raise DatasetError(f"{path}: image column {key!r} has a row without embedded bytes")
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).transpose(2, 0, 1)


def build_cache(src: SourceDataset, dest: Path, *, shard_frames: int = 256, progress: bool = True,
                tolerance_s: float | None = None) -> dict:
    """Decode ``src`` into a new cache entry at ``dest`` (must not exist); returns its manifest.

    Written to ``dest``'s sibling temp dir and renamed into place at the end.
    """
    import zarr
    from tqdm.auto import tqdm
    from zarr.codecs import BloscCodec

    n = src.num_frames
    fps = src.fps
    tolerance_s = 0.4 / fps if tolerance_s is None else tolerance_s
    t0 = time.perf_counter()
    # two processes may build the same entry: the first to finish wins, the other's copy is dropped
    with atomic_directory(dest, if_exists="keep") as tmp:
        group = zarr.open_group(tmp / "cache.zarr", mode="w", zarr_format=3)
        lowdim_group = group.create_group("lowdim")
        image_group = group.create_group("images")
        stats: dict[str, dict] = {}

        # Low-dimensional columns: read every data file, place rows by their global index.
        keys = src.numeric_keys
        columns = {k: np.zeros((n,) if tuple(src.features[k]["shape"]) == (1,) else (n, *src.features[k]["shape"]),
                               dtype=src.features[k]["dtype"]) for k in keys}
        seen = np.zeros(n, dtype=bool)
        image_keys = [k for k in src.camera_keys if src.features[k]["dtype"] == "image"]
        png_rows: dict[str, list[tuple[int, dict, Path]]] = {k: [] for k in image_keys}
        for path in src.data_files:
            table = _read_parquet(path)
            if "index" not in table.column_names:
                raise DatasetError(f"{path}: column 'index' is missing")
            index = _column_to_numpy(table, "index", (1,), "int64", path)
            if len(index) and index.min() < 0:
                raise DatasetError(f"{path}: negative row index {int(index.min())}")
            committed = index < n
            if not committed.all():  # rows of an interrupted commit (see read_dataset)
                table = table.filter(committed)
                index = index[committed]
            if seen[index].any():
                raise DatasetError(f"{path}: row index {int(index[seen[index]][0])} appears twice")
            seen[index] = True
            for k in keys:
                columns[k][index] = _column_to_numpy(table, k, tuple(src.features[k]["shape"]),
                                                     src.features[k]["dtype"], path)
            for k in image_keys:
                if k not in table.column_names:
                    raise DatasetError(f"{path}: image column {k!r} is missing")
                for row, value in zip(index, table.column(k).to_pylist()):
                    png_rows[k].append((int(row), value, path))
            del table
        if not seen.all():
            raise DatasetError(f"{src.root / 'data'}: rows {np.flatnonzero(~seen)[:5].tolist()}... are missing "
                               f"(meta/info.json total_frames={n})")
        for k, values in columns.items():
            chunk_rows = max(1, min(n, (1 << 20) // max(1, values[0].nbytes if n else 1)))
            lowdim_group.create_array(k, data=values, chunks=(chunk_rows, *values.shape[1:]))
            if k in BOOKKEEPING_KEYS:
                continue
            acc = StreamingStats(tuple(src.features[k]["shape"]))
            try:
                for start in range(0, n, 65536):
                    acc.update(values[start:start + 65536].reshape(-1, *src.features[k]["shape"]))
            except ValueError as exc:
                raise DatasetError(f"{src.root / 'data'}: feature {k!r}: {exc}") from None
            if n:
                stats[k] = acc.result()

        # Camera frames: one sequential decode per video file.
        if "timestamp" not in columns and any(src.features[k]["dtype"] == "video" for k in src.camera_keys):
            raise DatasetError(f"{src.root / 'meta' / 'info.json'}: feature 'timestamp' is missing "
                               f"(needed to find video frames)")
        bar = tqdm(total=n * len(src.camera_keys), desc=f"training cache {src.root.name}", unit="frame",
                   disable=not progress, mininterval=0.5)
        for key in src.camera_keys:
            h, w, c = src.features[key]["shape"]
            if c != 3:
                raise DatasetError(f"{src.root / 'meta' / 'info.json'}: camera {key!r} has {c} channels, expected 3")
            array = image_group.create_array(
                key, shape=(n, 3, h, w), dtype="uint8", shards=(min(shard_frames, max(n, 1)), 3, h, w),
                chunks=(1, 3, h, w), compressors=BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle"),
                fill_value=0,
            )
            writer = _ShardWriter(array, array.shards[0], tmp / "cache.zarr" / "images" / key)
            image_stats = ImageStats(3)

            def sink(row: int, img: np.ndarray) -> None:
                writer.put(row, img)
                image_stats.update(img)
                bar.update(1)

            if src.features[key]["dtype"] == "image":
                for row, value, path in sorted(png_rows[key], key=lambda r: r[0]):
                    img = _decode_png(value, key, path)
                    if img.shape != (3, h, w):
                        raise DatasetError(f"{path}: image {key!r} row {row} is {img.shape}, expected {(3, h, w)}")
                    sink(row, img)
            else:
                by_file: dict[Path, list[dict]] = {}
                for e in src.episodes:
                    by_file.setdefault(src.video_path(e, key), []).append(e)
                for path, eps in by_file.items():
                    rows = np.concatenate([np.arange(int(e["dataset_from_index"]), int(e["dataset_to_index"]))
                                           for e in eps])
                    offsets = np.concatenate([
                        np.full(int(e["dataset_to_index"]) - int(e["dataset_from_index"]),
                                float(e[f"videos/{key}/from_timestamp"]))
                        for e in eps])
                    targets = offsets + columns["timestamp"][rows].astype(np.float64)
                    order = np.argsort(targets, kind="stable")
                    _decode_video(path, targets[order], rows[order], (h, w), tolerance_s, sink)
            writer.flush()
            if n:
                stats[key] = image_stats.result()
        bar.close()

        manifest = {
            "format": CACHE_FORMAT,
            "source": str(src.root.resolve()),
            "fps": fps,
            "num_frames": n,
            "features": {k: {**ft, "shape": list(ft["shape"])} for k, ft in src.features.items()
                         if k in columns or k in src.camera_keys},
            "cameras": src.camera_keys,
            "lowdim": list(columns),
            "tasks": src.tasks,
            "episodes": [{"episode_index": int(e["episode_index"]), "from": int(e["dataset_from_index"]),
                          "to": int(e["dataset_to_index"])} for e in src.episodes],
            "build_seconds": round(time.perf_counter() - t0, 3),
        }
        group.attrs.update(manifest)
        save_stats(stats, tmp / "stats.json")
    return manifest


def ensure_cache(root: str | Path, cache_dir: str | Path | None = None, *, full_digest: bool = False,
                 progress: bool = True, shard_frames: int = 256) -> Path:
    """The cache entry for the dataset at ``root``, built first if there is none for its content."""
    src = read_dataset(root)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    dest = cache_dir / f"{src.root.resolve().name}-{content_key(src, full_digest)}"
    if (dest / "cache.zarr").exists():
        return dest
    with open(cache_dir / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / "cache.zarr").exists():
            build_cache(src, dest, shard_frames=shard_frames, progress=progress)
    return dest


# --------------------------------------------------------------------------- reading


class _ShardedFrames:
    """Reads single frames of a sharded image array straight from its shard files.

    zarr-python's per-call overhead (~1 ms) would dominate a training step, so for the layout
    this module writes (sharding_indexed → bytes + blosc per (1, C, H, W) chunk, index at the
    end) we read the shard index and the chunk bytes with ``pread`` and decompress with blosc.
    Any other layout falls back to zarr's own reads.
    """

    def __init__(self, array_dir: Path, array, max_open: int = 64):
        self.dir = array_dir
        self.array = array
        self.shape = tuple(array.shape)
        self.frame_shape = self.shape[1:]
        self.max_open = max_open
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._index: dict[int, np.ndarray] = {}
        self.direct = self._check_layout()

    def _check_layout(self) -> bool:
        try:
            meta = json.loads((self.dir / "zarr.json").read_text())
            (codec,) = meta["codecs"]
            cfg = codec["configuration"]
            inner = [c["name"] for c in cfg["codecs"]]
            index = [c["name"] for c in cfg["index_codecs"]]
            enc = meta["chunk_key_encoding"]
            self.shard = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
            ok = (codec["name"] == "sharding_indexed" and list(cfg["chunk_shape"]) == [1, *self.frame_shape]
                  and inner == ["bytes", "blosc"] and index == ["bytes", "crc32c"]
                  and cfg.get("index_location", "end") == "end" and enc["name"] == "default"
                  and enc.get("configuration", {}).get("separator", "/") == "/" and meta["data_type"] == "uint8"
                  and meta["chunk_grid"]["configuration"]["chunk_shape"][1:] == list(self.frame_shape))
        except (OSError, KeyError, ValueError, TypeError):
            return False
        if ok:
            import numcodecs.blosc

            self._decompress = numcodecs.blosc.decompress
        return ok

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fds"], state["_index"] = OrderedDict(), {}
        state.pop("_decompress", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.direct:
            import numcodecs.blosc

            self._decompress = numcodecs.blosc.decompress

    def _fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is not None:
            self._fds.move_to_end(shard)
            return fd
        path = self.dir / "c" / str(shard) / "0" / "0" / "0"
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return -1  # shard never written: all fill value
        self._fds[shard] = fd
        if len(self._fds) > self.max_open:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def _shard_index(self, shard: int, fd: int) -> np.ndarray:
        index = self._index.get(shard)
        if index is None:
            n_inner = self.shard
            size = os.fstat(fd).st_size
            raw = os.pread(fd, 16 * n_inner, size - 16 * n_inner - 4)
            if len(raw) != 16 * n_inner:
                raise DatasetError(f"{self.dir / 'c' / str(shard)}: truncated shard (delete the cache entry)")
            index = np.frombuffer(raw, dtype="<u8").reshape(n_inner, 2)
            self._index[shard] = index
        return index

    def read(self, rows: Sequence[int]) -> np.ndarray:
        """Frames at ``rows`` as uint8 ``(len(rows), C, H, W)``."""
        if not self.direct:
            return np.asarray(self.array.oindex[np.asarray(rows, dtype=np.int64)])
        out = np.empty((len(rows), *self.frame_shape), dtype=np.uint8)
        for i, row in enumerate(rows):
            shard, inner = divmod(int(row), self.shard)
            fd = self._fd(shard)
            if fd < 0:
                out[i] = 0
                continue
            offset, nbytes = self._shard_index(shard, fd)[inner]
            if offset == _MAX_UINT64:
                out[i] = 0
                continue
            raw = os.pread(fd, int(nbytes), int(offset))
            out[i] = np.frombuffer(self._decompress(raw), dtype=np.uint8).reshape(self.frame_shape)
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class TrainingCache:
    """Read side of a cache entry: low-dimensional columns in memory, frames read on demand.

    Frame readers open lazily (per process), so an instance can be handed to DataLoader workers.
    """

    def __init__(self, entry: str | Path):
        import zarr

        self.entry = Path(entry)
        zpath = self.entry / "cache.zarr"
        if not (zpath / "zarr.json").is_file():
            raise DatasetError(f"{zpath}: not a training cache (zarr.json missing)")
        group = zarr.open_group(zpath, mode="r")
        attrs = dict(group.attrs)
        if attrs.get("format") != CACHE_FORMAT:
            raise DatasetError(f"{zpath}: cache format {attrs.get('format')} is not {CACHE_FORMAT}; delete it")
        self.fps: int = attrs["fps"]
        self.num_frames: int = attrs["num_frames"]
        self.features: dict[str, dict] = attrs["features"]
        self.cameras: list[str] = attrs["cameras"]
        self.tasks: list[str] = attrs["tasks"]
        self.episodes: list[dict] = attrs["episodes"]
        self.source: str = attrs["source"]
        self.build_seconds: float = attrs["build_seconds"]
        self.lowdim: dict[str, np.ndarray] = {k: np.asarray(group["lowdim"][k][...]) for k in attrs["lowdim"]}
        self._frames: dict[str, _ShardedFrames] | None = None

    @property
    def stats(self) -> dict[str, dict[str, np.ndarray]]:
        """Normalization statistics of every feature (see ``robopolicy.data.stats``)."""
        return load_stats(self.entry / "stats.json")

    def image_shape(self, camera: str) -> tuple[int, int, int]:
        """``(C, H, W)`` of a camera's frames."""
        h, w, c = self.features[camera]["shape"]
        return (c, h, w)

    def _open_frames(self) -> dict[str, _ShardedFrames]:
        import zarr

        group = zarr.open_group(self.entry / "cache.zarr", mode="r")
        return {k: _ShardedFrames(self.entry / "cache.zarr" / "images" / k, group["images"][k]) for k in self.cameras}

    def read_frames(self, camera: str, rows: Iterable[int]) -> np.ndarray:
        """uint8 frames ``(len(rows), C, H, W)`` of ``camera`` at global row indices ``rows``."""
        if self._frames is None:
            self._frames = self._open_frames()
        try:
            reader = self._frames[camera]
        except KeyError:
            raise DatasetError(f"camera {camera!r} not in the dataset; cameras: {self.cameras}") from None
        return reader.read(list(rows))

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_frames"] = None  # each worker opens its own files
        return state

    def close(self) -> None:
        if self._frames:
            for reader in self._frames.values():
                reader.close()
        self._frames = None
