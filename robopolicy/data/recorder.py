"""Record episodes into a LeRobotDataset v3.0, one atomic commit per episode.

lerobot 0.4.4's writer appends every episode to shared parquet / mp4 files, keeps a parquet
writer open (no footer until ``finalize()``) and rewrites ``meta/info.json`` in place: a crash
in the middle of a recording can leave the whole dataset unreadable. So we never let lerobot
write into the dataset itself.

Layout: ``meta/`` and ``data/`` are symlinks through ``.gen`` (``meta -> .gen/meta``,
``data -> .gen/data``), and ``.gen`` is a symlink to the committed *generation*, a directory
``.gen-NNNNNN/`` holding that dataset's ``meta/`` and ``data/``. lerobot's ``LeRobotDataset``
follows the links: it reads ``meta/`` for its length, episodes, tasks and stats, and every file of
``data/*/*.parquet`` for its frames (``load_nested_dataset`` globs them, committed or not), so the
two must change together. Videos stay in ``videos/`` at the root: lerobot opens a video only by
the path an episode row names. A commit:

1. **Stage.** Each episode is written by lerobot's own classes (``LeRobotDataset.create``,
   ``add_frame``, ``save_episode``, ``finalize``) into a fresh one-episode dataset under
   ``<root>/.staging/``. A crash here leaves only a staging directory behind.
2. **Build.** The committer renumbers the staged episode (``index``, ``episode_index``,
   ``task_index``, file indices) and builds the next generation beside the committed one:
   hard links to every committed ``meta/`` and ``data/`` file, plus the new episode row
   (``meta/episodes/…/file-NNN.parquet``), ``tasks.parquet``, ``stats.json`` and ``info.json``
   written fresh and fsynced. Files are never rewritten in place, so a hard link shared by two
   generations cannot change under either.
3. **Publish the episode's files** under *new* names: ``videos/<cam>/…/file-NNN.mp4`` at the
   root (no committed episode row points at it, so no reader opens it), then
   ``data/…/file-NNN.parquet`` inside the new generation only. A reader still sees exactly the
   committed generation: no frame, episode, count, task or statistic of the new episode.
4. **Commit point.** One rename (a new ``.gen`` symlink ``os.replace``-d over the old one) shows
   the frames, the episode row, tasks, stats and totals together, never one without the others.
   The previous generation is then deleted (its files live on as the new one's hard links).
5. **Recover.** Opening a dataset to resume (:func:`recover`) deletes generations other than the
   committed one, video files that no committed episode references, staging leftovers and
   ``.tmp`` files, and rebuilds ``stats.json`` from the committed episodes.

Datasets of the older layout (plain ``meta/`` and ``data/`` directories: written before
generations, or by lerobot's own tools such as ``delete_episodes``) are converted once, under
the dataset lock, by the first commit or :func:`recover`: a first generation of hard links, then
each directory swapped for its symlink with ``renameat2(RENAME_EXCHANGE)``. The generation holds
the same files as the directories, so a reader sees the same dataset at every step, and an
interrupted conversion is finished by the next call. (Where the filesystem cannot exchange, the
directory is renamed aside first and a reader may briefly find it missing.) The same recovery
also removes what the older, file-by-file protocols left (``.meta.next``, rows past
``total_episodes``, unreferenced data files).

A ``kill -9`` therefore loses at most the episode being recorded or committed; everything
before it stays loadable by lerobot's ``LeRobotDataset`` and ``--resume`` continues after it.
``tests/test_recorder.py`` kills a recording process mid-episode and after every step of a
commit, and loads the dataset with lerobot each time, to check this.

Timing: see :mod:`robopolicy.data.features` — ``timestamp`` is the frame's slot
(``frame_index / fps``, what lerobot needs to find the frame in the MP4); the real wall-clock
time, the lateness and a late flag are stored beside it, and each episode gets a
:class:`CadenceReport`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # datasets live on local disk; never ask the hub

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from robopolicy.data import features as F
from robopolicy.data.errors import DatasetError
from robopolicy.utils.files import atomic_file, fsync_path

STAGING_DIR = ".staging"
LOCK_FILE = ".robopolicy.lock"
EPISODE_JSON = "robopolicy_episode.json"
REPO_ID = "robopolicy/local"  # lerobot wants a repo id; with a local root it is only a label
INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
INDEX_KEYS = (F.INDEX, F.EPISODE_INDEX, F.TASK_INDEX)


# --------------------------------------------------------------------------------------------
# Durable file writes
# --------------------------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fsync_path(path)


def _is_temp(name: str) -> bool:
    """A temporary file of an atomic write (:func:`robopolicy.utils.files.atomic_file`'s
    ``.<stem>.tmp-…`` names, or the ``.<name>.<hex>.tmp`` ones written before)."""
    return name.startswith(".") and (name.endswith(".tmp") or ".tmp-" in name)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a hidden temporary path beside ``path``; on success fsync and rename it over ``path``
    (:func:`robopolicy.utils.files.atomic_file` with ``durable=True``).

    On any error (a full disk included) the temporary file is removed, ``path`` is untouched,
    and an ``OSError`` is re-raised as :class:`DatasetError` naming ``path``.
    """
    path = Path(path)
    try:
        with atomic_file(path, durable=True) as tmp:
            yield tmp
    except OSError as exc:
        why = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
        raise DatasetError(f"{path}: could not write ({why}); the dataset on disk is unchanged") from exc


def atomic_write_json(path: str | Path, data: Any) -> None:
    """Write JSON through :func:`atomic_path`."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as fh:
            json.dump(data, fh, indent=4, ensure_ascii=False)


def atomic_write_table(path: str | Path, table: pa.Table) -> None:
    """Write a parquet table through :func:`atomic_path`."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="snappy")


def atomic_move(src: Path, dst: Path) -> None:
    """Move a finished file into place (same filesystem: a rename), durably."""
    with atomic_path(dst) as tmp:
        shutil.move(str(src), str(tmp))


@contextlib.contextmanager
def dataset_lock(root: Path) -> Iterator[None]:
    """One committer at a time per dataset (an advisory flock, released if the process dies)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK_FILE, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------------
# Reading metadata with clear errors
# --------------------------------------------------------------------------------------------


def read_info(root: Path) -> dict[str, Any]:
    """``meta/info.json`` as a dict; a missing or corrupt file is a :class:`DatasetError`."""
    path = Path(root) / INFO_PATH
    if not path.is_file():
        raise DatasetError(f"{path}: missing; {root} is not a LeRobot dataset (no meta/info.json)")
    try:
        info = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: corrupt JSON ({exc})") from None
    for key in ("codebase_version", "fps", "features", "total_episodes", "total_frames"):
        if key not in info:
            raise DatasetError(f"{path}: missing required key {key!r}")
    for key, ft in info["features"].items():
        if not isinstance(ft, dict) or "dtype" not in ft or "shape" not in ft:
            raise DatasetError(f"{path}: feature {key!r} lacks dtype/shape")
        ft["shape"] = tuple(ft["shape"])
    return info


def read_parquet(path: Path, what: str) -> pa.Table:
    """Read a parquet file; a missing or corrupt one is a :class:`DatasetError` naming it."""
    if not path.is_file():
        raise DatasetError(f"{path}: missing ({what})")
    try:
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(f"{path}: corrupt parquet ({what}): {exc}") from None


def episodes_files(root: Path) -> list[Path]:
    """The ``meta/episodes`` parquet files in lerobot's read order."""
    return sorted((Path(root) / "meta" / "episodes").glob("*/*.parquet"))


def read_episodes(root: Path, committed_only: bool = True) -> pa.Table | None:
    """All episode metadata rows (stats columns included), ordered by episode index."""
    root = Path(root)
    tables = [read_parquet(p, "episode metadata") for p in episodes_files(root)]
    if not tables:
        return None
    table = pa.concat_tables(tables, promote_options="default")
    table = table.sort_by(F.EPISODE_INDEX)
    if committed_only:
        n = read_info(root)["total_episodes"]
        mask = pc.less(table[F.EPISODE_INDEX], pa.scalar(n, pa.int64()))
        table = table.filter(mask)
    return table


def last_committed_episodes(root: Path, total_episodes: int) -> pa.Table | None:
    """The committed rows of the last episode-metadata file that has any (``None``: no episode).

    Episodes are appended in order, so the last committed episode's files are the dataset's
    last ones: a commit reads one or two metadata files, not every episode's."""
    for path in reversed(episodes_files(Path(root))):
        table = read_parquet(path, "episode metadata")
        table = table.filter(pc.less(table[F.EPISODE_INDEX], pa.scalar(total_episodes, pa.int64())))
        if table.num_rows:
            return table
    return None


def feature_signature(features: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Features reduced to what must match between datasets: dtype and shape per key."""
    return {k: (ft["dtype"], tuple(int(s) for s in ft["shape"])) for k, ft in features.items()}


def check_same_features(expected: Mapping, actual: Mapping, where: str) -> None:
    """Raise :class:`DatasetError` describing the first difference between two feature sets."""
    a, b = feature_signature(expected), feature_signature(actual)
    for key in sorted(set(a) | set(b)):
        if key not in b:
            raise DatasetError(f"{where}: feature {key!r} is missing (expected {a[key]})")
        if key not in a:
            raise DatasetError(f"{where}: unexpected feature {key!r} {b[key]}")
        if a[key] != b[key]:
            raise DatasetError(f"{where}: feature {key!r} has dtype/shape {b[key]}, expected {a[key]}")


# --------------------------------------------------------------------------------------------
# Creating, committing into and recovering a dataset
# --------------------------------------------------------------------------------------------


def create_dataset(root: str | Path, features: Mapping[str, Any], fps: int, robot_type: str | None = None,
                   use_videos: bool = True) -> dict[str, Any]:
    """Write an empty dataset's ``meta/info.json`` (atomically); lerobot's own info template."""
    from lerobot.datasets.utils import DEFAULT_FEATURES, create_empty_dataset_info

    root = Path(root)
    if (root / INFO_PATH).exists():
        raise DatasetError(f"{root / INFO_PATH}: a dataset already exists here (resume it, or pick a new directory)")
    full = {**{k: dict(v, shape=tuple(v["shape"])) for k, v in features.items()}, **DEFAULT_FEATURES}
    bad = [k for k in full if "/" in k]
    if bad:
        raise DatasetError(f"feature names must not contain '/': {bad}")
    info = create_empty_dataset_info("v3.0", int(fps), full, use_videos, robot_type)
    root.mkdir(parents=True, exist_ok=True)
    for leftover in _generation_dirs(root):  # of a creation that did not finish
        shutil.rmtree(leftover)
    gen = _new_generation(root)
    text = json.dumps(_jsonable(info), indent=4, ensure_ascii=False)
    try:
        _fill_generation(gen, {}, {INFO_PATH: lambda p: p.write_text(text)})
    except OSError as exc:
        shutil.rmtree(gen, ignore_errors=True)
        raise DatasetError(f"{root}: could not create the dataset ({exc.strerror or exc})") from exc
    _point(root / GEN_LINK, gen.name)
    for name in LAYOUT_DIRS:
        _point(root / name, f"{GEN_LINK}/{name}")
    return info


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _next_file(last: tuple[int, int] | None, chunks_size: int) -> tuple[int, int]:
    from lerobot.datasets.utils import update_chunk_file_indices

    return (0, 0) if last is None else update_chunk_file_indices(last[0], last[1], chunks_size)


def _last_file(episodes: pa.Table | None, prefix: str) -> tuple[int, int] | None:
    if episodes is None or episodes.num_rows == 0 or f"{prefix}/chunk_index" not in episodes.column_names:
        return None
    pairs = zip(episodes[f"{prefix}/chunk_index"].to_pylist(), episodes[f"{prefix}/file_index"].to_pylist())
    return max((int(c), int(f)) for c, f in pairs)


def _stats_of(values: np.ndarray) -> dict[str, np.ndarray]:
    from lerobot.datasets.compute_stats import get_feature_stats

    return get_feature_stats(values.reshape(-1), axis=0, keepdims=True)


def _load_stats_json(path: Path) -> dict[str, dict[str, np.ndarray]] | None:
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: corrupt JSON ({exc})") from None
    return {k: {s: np.asarray(v) for s, v in d.items()} for k, d in raw.items()}


def _stats_from_rows(episodes: pa.Table) -> dict[str, dict[str, np.ndarray]] | None:
    """Dataset stats aggregated from the per-episode ``stats/<key>/<stat>`` columns."""
    from lerobot.datasets.compute_stats import aggregate_stats

    cols = [c for c in episodes.column_names if c.startswith("stats/")]
    if episodes.num_rows == 0 or not cols:
        return None
    per_episode = []
    for row in episodes.select(cols).to_pylist():
        ep: dict[str, dict[str, np.ndarray]] = {}
        for col, value in row.items():
            if value is None:
                continue
            key, stat = col[len("stats/"):].rsplit("/", 1)
            ep.setdefault(key, {})[stat] = np.asarray(value)
        per_episode.append(ep)
    return aggregate_stats(per_episode)


def _conform(row: pa.Table, schema: pa.Schema | None) -> pa.Table:
    """Give a new episode row the schema of the existing episode files (lerobot reads them as one)."""
    if schema is None:
        return row
    missing = [f.name for f in schema if f.name not in row.column_names]
    for name in missing:
        row = row.append_column(schema.field(name), pa.nulls(row.num_rows, schema.field(name).type))
    row = row.select([f.name for f in schema])
    return row.cast(schema)


NEXT_META = ".meta.next"  # the older protocol's metadata build (recover() removes a leftover one)
RENAME_EXCHANGE = 2  # linux renameat2 flag
GEN_LINK = ".gen"  # symlink naming the committed generation; meta/ and data/ point through it
GEN_PREFIX = ".gen-"
LAYOUT_DIRS = ("meta", "data")  # what a generation holds (videos stay at the root: see the docstring)


def _commit_step(name: str) -> None:
    """Called after each step of a commit (tests kill the process here)."""


def _renameat2_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise DatasetError(f"{b}: could not swap in {a} ({os.strerror(err)}); the dataset is unchanged")


def _point(link: Path, target: str) -> None:
    """Make ``link`` a symlink to ``target`` in one rename (a new link, then ``os.replace``)."""
    tmp = link.with_name(f".{link.name.lstrip('.')}.link.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)
    fsync_dir(link.parent)


def current_generation(root: Path) -> Path | None:
    """The committed generation directory (``<root>/.gen-NNNNNN``), or None for the older layout."""
    link = Path(root) / GEN_LINK
    return Path(root) / os.readlink(link) if link.is_symlink() else None


def _generation_dirs(root: Path) -> list[Path]:
    return sorted(p for p in Path(root).glob(f"{GEN_PREFIX}*") if p.is_dir() and not p.is_symlink())


def _new_generation(root: Path) -> Path:
    """A fresh, empty generation directory numbered after every existing one."""
    last = max((int(p.name[len(GEN_PREFIX):]) for p in _generation_dirs(root)
                if p.name[len(GEN_PREFIX):].isdigit()), default=-1)
    gen = root / f"{GEN_PREFIX}{last + 1:06d}"
    gen.mkdir()
    return gen


def _fill_generation(gen: Path, sources: Mapping[str, Path | None], write: Mapping[str, Any]) -> None:
    """Fill ``gen`` with hard links to every file of ``sources`` (``"meta"``/``"data"`` → directory)
    except the ones in ``write`` (``"meta/..."`` path → ``fn(path)``), which are written fresh;
    every new file and directory is fsynced. A shared file is never written in place: every
    writer of a dataset file replaces it (a new inode), so the generations cannot alter each other."""
    for name in LAYOUT_DIRS:
        (gen / name).mkdir(exist_ok=True)
    for name, src_dir in sources.items():
        if src_dir is None or not src_dir.is_dir():
            continue
        for src in sorted(src_dir.rglob("*")):
            rel = Path(name) / src.relative_to(src_dir)
            if src.is_dir() or str(rel) in write or _is_temp(src.name):
                continue
            dst = gen / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
    for rel_str, fn in write.items():
        dst = gen / rel_str
        dst.parent.mkdir(parents=True, exist_ok=True)
        fn(dst)
        with open(dst, "rb") as fh:
            os.fsync(fh.fileno())
    for d in sorted({p.parent for p in gen.rglob("*")} | {gen}, key=lambda p: -len(p.parts)):
        fsync_dir(d)


def _build_generation(root: Path, write: Mapping[str, Any]) -> Path:
    """The next generation, built beside the committed one; nothing a reader opens changes."""
    gen = _new_generation(root)
    current = current_generation(root)
    try:
        _fill_generation(gen, {name: current / name for name in LAYOUT_DIRS}, write)
    except OSError as exc:
        shutil.rmtree(gen, ignore_errors=True)
        why = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
        raise DatasetError(f"{gen}: could not write ({why}); the dataset on disk is unchanged") from exc
    return gen


def _switch_generation(root: Path, gen: Path) -> Path | None:
    """Commit point: point ``<root>/.gen`` at ``gen`` (one rename); returns the previous generation."""
    previous = current_generation(root)
    _point(root / GEN_LINK, gen.name)
    return previous


def _ensure_generations(root: Path) -> None:
    """Convert a dataset of the older layout (``meta/`` and ``data/`` directories) to generations.

    Runs under the dataset lock and is crash-safe at every step: the first generation holds hard
    links to exactly the files of the directories it replaces, so a reader sees the same dataset
    before, during and after; an interrupted conversion is finished by the next call. Each
    directory is swapped for its symlink with ``renameat2(RENAME_EXCHANGE)``; where the filesystem
    cannot exchange, the directory is renamed aside first (a reader may then briefly find it missing)."""
    meta, data = root / "meta", root / "data"
    if meta.is_dir() and not meta.is_symlink():
        for leftover in _generation_dirs(root):  # from an interrupted conversion: rebuild it
            shutil.rmtree(leftover)
        if (root / GEN_LINK).is_dir() and not (root / GEN_LINK).is_symlink():
            shutil.rmtree(root / GEN_LINK)  # a copy that followed the link (copytree without symlinks)
        gen = _new_generation(root)
        _fill_generation(gen, {"meta": meta, "data": data if data.is_dir() and not data.is_symlink() else None}, {})
        _point(root / GEN_LINK, gen.name)
    for name in LAYOUT_DIRS:
        path = root / name
        if path.is_symlink():
            continue
        link = root / f".{name}.link.tmp"
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        os.symlink(f"{GEN_LINK}/{name}", link)
        if path.exists():
            if not _renameat2_exchange(link, path):
                aside = root / f".{name}.old"
                shutil.rmtree(aside, ignore_errors=True)
                os.rename(path, aside)
                os.replace(link, path)
                link = aside
            fsync_dir(root)
            shutil.rmtree(link)
        else:
            os.replace(link, path)
            fsync_dir(root)


def commit_staged(root: str | Path, staged: str | Path) -> int:
    """Publish a finalized one-episode staging dataset into ``root``; returns its episode index.

    See the module docstring for the protocol; ``meta/info.json`` is written last.
    """
    from lerobot.datasets.compute_stats import aggregate_stats

    root, staged = Path(root), Path(staged)
    with dataset_lock(root):
        _ensure_generations(root)
        info = read_info(root)
        s_info = read_info(staged)
        check_same_features({k: v for k, v in info["features"].items()},
                            s_info["features"], f"staged episode {staged}")
        if info["fps"] != s_info["fps"]:
            raise DatasetError(f"staged episode {staged}: fps {s_info['fps']} != dataset fps {info['fps']}")
        extra = json.loads((staged / EPISODE_JSON).read_text()) if (staged / EPISODE_JSON).is_file() else {}

        ep_index = int(info["total_episodes"])
        episodes = last_committed_episodes(root, ep_index)  # where the last files are
        frame_offset = int(info["total_frames"])
        chunks_size = int(info["chunks_size"])
        video_keys = [k for k, ft in info["features"].items() if ft["dtype"] == "video"]

        # Tasks: the staged episode's task strings mapped into the dataset's task table.
        tasks_path = root / TASKS_PATH
        tasks = read_parquet(tasks_path, "tasks").to_pandas() if tasks_path.is_file() else None
        s_tasks = read_parquet(staged / TASKS_PATH, "tasks").to_pandas()
        names = list(tasks.index) if tasks is not None else []
        task_map = {}
        for task, row in s_tasks.iterrows():
            if task not in names:
                names.append(task)
            task_map[int(row["task_index"])] = names.index(task)
        import pandas as pd

        new_tasks = pd.DataFrame({"task_index": range(len(names))}, index=pd.Index(names, name=s_tasks.index.name))

        # Frames: renumber and write under the next data file name.
        data = read_parquet(staged / "data/chunk-000/file-000.parquet", "staged frames")
        n = data.num_rows
        new_index = np.arange(frame_offset, frame_offset + n, dtype=np.int64)
        new_task_index = np.array([task_map[int(t)] for t in data[F.TASK_INDEX].to_pylist()], dtype=np.int64)
        new_cols = {F.INDEX: new_index, F.EPISODE_INDEX: np.full(n, ep_index, np.int64), F.TASK_INDEX: new_task_index}
        for key, values in new_cols.items():
            pos = data.schema.get_field_index(key)
            data = data.set_column(pos, data.schema.field(key), pa.array(values, data.schema.field(key).type))
        data_file = _next_file(_last_file(episodes, "data"), chunks_size)

        # Episode row: renumbered, pointing at the new files, index stats recomputed.
        row = read_parquet(staged / "meta/episodes/chunk-000/file-000.parquet", "staged episode metadata")
        meta_file = _next_file(_last_file(episodes, "meta/episodes"), chunks_size)
        updates: dict[str, Any] = {
            F.EPISODE_INDEX: ep_index,
            "data/chunk_index": data_file[0], "data/file_index": data_file[1],
            "dataset_from_index": frame_offset, "dataset_to_index": frame_offset + n,
            "meta/episodes/chunk_index": meta_file[0], "meta/episodes/file_index": meta_file[1],
        }
        video_files = {}
        for key in video_keys:
            video_files[key] = _next_file(_last_file(episodes, f"videos/{key}"), chunks_size)
            updates[f"videos/{key}/chunk_index"], updates[f"videos/{key}/file_index"] = video_files[key]
        ep_stats = _load_stats_json(staged / STATS_PATH) or {}
        for key, values in new_cols.items():
            ep_stats[key] = _stats_of(values)
            for stat, value in ep_stats[key].items():
                updates[f"stats/{key}/{stat}"] = np.asarray(value).tolist()
        for key, value in extra.get("columns", {}).items():
            updates[key] = value
        for col, value in updates.items():
            if col in row.column_names:
                field_ = row.schema.field(col)
                if not pa.types.is_list(field_.type) and isinstance(value, list):
                    value = np.asarray(value).reshape(-1)[0].item()
                row = row.set_column(row.schema.get_field_index(col), field_, pa.array([value], field_.type))
            else:
                row = row.append_column(col, pa.array([value]))
        schema = pq.read_schema(episodes_files(root)[-1]) if episodes is not None and episodes.num_rows else None
        try:
            row = _conform(row, schema)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise DatasetError(f"staged episode {staged}: episode metadata does not fit {root}'s: {exc}") from None

        new_info = dict(info)
        for key in video_keys:
            if not info["features"][key].get("info") and s_info["features"][key].get("info"):
                new_info["features"] = dict(new_info["features"])
                new_info["features"][key] = dict(info["features"][key], info=s_info["features"][key]["info"])
        new_info["total_episodes"] = ep_index + 1
        new_info["total_frames"] = frame_offset + n
        new_info["total_tasks"] = len(names)
        new_info["splits"] = {"train": f"0:{ep_index + 1}"}
        old_stats = _load_stats_json(root / STATS_PATH) if ep_index > 0 else None
        stats = aggregate_stats([old_stats, ep_stats]) if old_stats else ep_stats
        from lerobot.datasets.utils import DEFAULT_EPISODES_PATH

        episodes_rel = DEFAULT_EPISODES_PATH.format(chunk_index=meta_file[0], file_index=meta_file[1])

        # The next generation, built beside the committed one: every committed file (hard links)
        # and the new metadata; nothing a reader opens has changed yet.
        _commit_step("staged")
        gen = _build_generation(root, {
            episodes_rel: lambda p: pq.write_table(row, p, compression="snappy"),
            TASKS_PATH: lambda p: new_tasks.to_parquet(p),
            STATS_PATH: lambda p: p.write_text(json.dumps(_jsonable(stats), indent=4, ensure_ascii=False)),
            INFO_PATH: lambda p: p.write_text(json.dumps(_jsonable(new_info), indent=4, ensure_ascii=False)),
        })
        _commit_step("meta_built")
        try:
            # Videos: under new names no committed episode row points at, so invisible.
            for key in video_keys:
                src = staged / s_info["video_path"].format(video_key=key, chunk_index=0, file_index=0)
                dst = root / info["video_path"].format(video_key=key, chunk_index=video_files[key][0],
                                                       file_index=video_files[key][1])
                if not src.is_file():
                    raise DatasetError(f"staged episode {staged}: video {src} missing")
                atomic_move(src, dst)
            _commit_step("videos")
            # Frames: into the new generation only (lerobot reads every file under data/).
            atomic_write_table(gen / info["data_path"].format(chunk_index=data_file[0], file_index=data_file[1]), data)
            fsync_dir(gen)
            _commit_step("data")
        except BaseException:
            shutil.rmtree(gen, ignore_errors=True)
            raise

        # Commit point: one rename of the .gen link shows the frames, the episode row, tasks,
        # stats and info.json together.
        previous = _switch_generation(root, gen)
        _commit_step("exchanged")
        if previous is not None and previous != gen:
            shutil.rmtree(previous, ignore_errors=True)
        _commit_step("cleaned")
    shutil.rmtree(staged, ignore_errors=True)
    return ep_index


def _requiet_ffmpeg() -> None:
    """lerobot's video encoder ends with ``av.logging.restore_default_callback()``, which hands
    FFmpeg back its own stderr logger at info level: every later episode would print the
    encoder's banner. Put PyAV's error-only logging back after each episode."""
    import av

    av.logging.set_level(av.logging.ERROR)


@dataclass
class RecoveryReport:
    """What :func:`recover` cleaned up."""

    episodes: int
    frames: int
    removed: list[str] = field(default_factory=list)


def recover(root: str | Path) -> RecoveryReport:
    """Bring a dataset back to exactly its committed episodes (after a crash), ready to append."""
    root = Path(root)
    removed: list[str] = []
    with dataset_lock(root):
        _ensure_generations(root)
        info = read_info(root)
        n = int(info["total_episodes"])
        staging = root / STAGING_DIR
        if staging.exists():
            shutil.rmtree(staging)
            removed.append(str(staging))
        current = current_generation(root)
        for gen in _generation_dirs(root):  # built for a commit that never switched, or the one it replaced
            if gen != current:
                shutil.rmtree(gen)
                removed.append(str(gen))
        # the older protocol's metadata build, and directories an interrupted conversion set aside
        for leftover in (root / NEXT_META, root / ".meta.old", root / ".data.old"):
            if leftover.exists():
                shutil.rmtree(leftover)
                removed.append(str(leftover))
        for link in root.glob(".*.link.tmp"):
            link.unlink()
            removed.append(str(link))
        for tmp in [p for p in root.rglob(".*.tmp*") if p.is_file() and _is_temp(p.name)]:
            tmp.unlink()
            removed.append(str(tmp))
        for path in episodes_files(root):
            table = read_parquet(path, "episode metadata")
            idx = np.asarray(table[F.EPISODE_INDEX].to_pylist())
            if len(idx) and (idx >= n).all():
                path.unlink()
                removed.append(str(path))
            elif (idx >= n).any():
                keep = pc.less(table[F.EPISODE_INDEX], pa.scalar(n, pa.int64()))
                atomic_write_table(path, table.filter(keep))
                removed.append(f"{path} (rows past episode {n - 1})")
        episodes = read_episodes(root, committed_only=True)
        referenced = set()
        if episodes is not None:
            for c, f in zip(episodes["data/chunk_index"].to_pylist(), episodes["data/file_index"].to_pylist()):
                referenced.add(root / info["data_path"].format(chunk_index=c, file_index=f))
            for key in [k for k, ft in info["features"].items() if ft["dtype"] == "video"]:
                for c, f in zip(episodes[f"videos/{key}/chunk_index"].to_pylist(),
                                episodes[f"videos/{key}/file_index"].to_pylist()):
                    referenced.add(root / info["video_path"].format(video_key=key, chunk_index=c, file_index=f))
        for path in list((root / "data").glob("*/*.parquet")) + list((root / "videos").glob("*/*/*.mp4")):
            if path not in referenced:
                path.unlink()
                removed.append(str(path))
        frames = int(sum(episodes["length"].to_pylist())) if episodes is not None else 0
        if frames != info["total_frames"]:
            raise DatasetError(f"{root / INFO_PATH}: total_frames={info['total_frames']} but the committed "
                               f"episodes hold {frames} frames")
        if removed and episodes is not None and episodes.num_rows:
            stats = _stats_from_rows(episodes)
            if stats is not None:
                atomic_write_json(root / STATS_PATH, _jsonable(stats))
    return RecoveryReport(episodes=n, frames=frames, removed=removed)


# --------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------


@dataclass
class CadenceReport:
    """How well an episode's frames kept the recording rate (lateness = arrival - slot, >= 0)."""

    frames: int
    period_s: float
    mean_interval_s: float
    mean_lateness_s: float
    p99_lateness_s: float
    max_lateness_s: float
    late_frames: int
    late_after_s: float

    @classmethod
    def from_lateness(cls, wall: np.ndarray, fps: int, late_after_s: float) -> "CadenceReport":
        period = 1.0 / fps
        late = np.maximum(wall - np.arange(len(wall)) * period, 0.0)
        intervals = np.diff(wall)
        return cls(
            frames=int(len(wall)),
            period_s=period,
            mean_interval_s=float(intervals.mean()) if len(intervals) else 0.0,
            mean_lateness_s=float(late.mean()) if len(late) else 0.0,
            p99_lateness_s=float(np.quantile(late, 0.99)) if len(late) else 0.0,
            max_lateness_s=float(late.max()) if len(late) else 0.0,
            late_frames=int((late > late_after_s).sum()),
            late_after_s=late_after_s,
        )

    def line(self) -> str:
        """One-line summary."""
        return (f"{self.frames} frames, period {self.period_s * 1e3:.1f} ms (mean interval "
                f"{self.mean_interval_s * 1e3:.1f} ms), lateness mean {self.mean_lateness_s * 1e3:.1f} / "
                f"p99 {self.p99_lateness_s * 1e3:.1f} / max {self.max_lateness_s * 1e3:.1f} ms, "
                f"{self.late_frames} late (> {self.late_after_s * 1e3:.1f} ms)")


@dataclass
class EpisodeSummary:
    """A committed (or staged) episode."""

    episode_index: int | None
    frames: int
    success: bool
    task: str
    cadence: CadenceReport
    seed: int | None = None
    staged_path: str | None = None


class StagedEpisode:
    """One episode written by lerobot into its own staging dataset (``<root>/.staging/<name>``).

    Worker processes use this directly and hand the staged path to the process that commits
    (:func:`commit_staged`); :class:`EpisodeRecorder` does both in one process.
    """

    def __init__(self, staging_dir: str | Path, features: Mapping[str, Any], fps: int,
                 robot_type: str | None = None, vcodec: str = "libsvtav1",
                 late_after_s: float | None = None, use_videos: bool = True):
        from lerobot.datasets.lerobot_dataset import LeRobotDataset

        self.path = Path(staging_dir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fps = int(fps)
        self.features = {k: v for k, v in features.items() if k not in (F.TIMESTAMP, F.FRAME_INDEX,
                                                                     F.EPISODE_INDEX, F.INDEX, F.TASK_INDEX)}
        self.late_after_s = 0.5 / self.fps if late_after_s is None else float(late_after_s)
        has_video = any(ft["dtype"] == "video" for ft in self.features.values())
        self._ds = LeRobotDataset.create(
            REPO_ID, fps=self.fps, features=dict(self.features), root=self.path, robot_type=robot_type,
            use_videos=use_videos, vcodec=vcodec, streaming_encoding=has_video, video_backend="pyav",
        )
        self._t0: float | None = None
        self._wall: list[float] = []
        self._task: str | None = None
        self._last_success = False

    @property
    def frames(self) -> int:
        return len(self._wall)

    def add_frame(self, frame: Mapping[str, Any], task: str, wall_time: float | None = None) -> float:
        """Add one frame (feature key -> value); returns its lateness in seconds.

        ``wall_time`` is seconds since the episode's first frame; by default the recorder's own
        monotonic clock. Missing ``intervention`` / ``next.*`` values default to False / 0.
        """
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
        wall = (now - self._t0) if wall_time is None else float(wall_time)
        index = len(self._wall)
        lateness = wall - index / self.fps
        out: dict[str, Any] = {}
        for key, ft in self.features.items():
            if key in frame:
                value = frame[key]
            elif key == F.WALL_TIME:
                value = wall
            elif key == F.LATENESS:
                value = lateness
            elif key == F.LATE:
                value = lateness > self.late_after_s
            elif key in (F.INTERVENTION, F.REWARD, F.DONE, F.SUCCESS):
                value = 0
            else:
                raise ValueError(f"frame {index}: feature {key!r} missing (frame keys: {sorted(frame)})")
            out[key] = F.frame_value(key, value, ft)
        unknown = sorted(set(frame) - set(self.features) - {F.TASK, F.TIMESTAMP})
        if unknown:
            raise ValueError(f"frame {index}: keys {unknown} are not features of this dataset")
        out["task"] = str(task)
        # No "timestamp": lerobot stamps frame_index / fps, the frame's slot in the video (features.py).
        self._ds.add_frame(out)
        self._wall.append(wall)
        self._task = str(task)
        self._last_success = bool(np.asarray(out.get(F.SUCCESS, False)).any())
        return lateness

    def save(self, success: bool | None = None, seed: int | None = None,
             metadata: Mapping[str, Any] | None = None) -> EpisodeSummary:
        """Encode and finalize the staged episode (``next.done`` set on its last frame)."""
        if not self._wall:
            raise ValueError("cannot save an empty episode (add at least one frame)")
        buf = self._ds.episode_buffer
        if F.DONE in buf:
            buf[F.DONE][-1] = np.ones((1,), dtype=bool)
        success = self._last_success if success is None else bool(success)
        cadence = CadenceReport.from_lateness(np.asarray(self._wall), self.fps, self.late_after_s)
        # In-process encoding: lerobot's per-camera process pool forks per episode (costly with a
        # loaded simulator, and the children print the encoders' banners whatever we set here).
        self._ds.save_episode(parallel_encoding=False)
        self._ds.finalize()
        _requiet_ffmpeg()
        columns = {
            F.EPISODE_SUCCESS: success,
            F.EPISODE_SEED: -1 if seed is None else int(seed),
            F.EPISODE_LATE_FRAMES: cadence.late_frames,
            F.EPISODE_MAX_LATENESS: cadence.max_lateness_s,
        }
        columns.update(metadata or {})
        (self.path / EPISODE_JSON).write_text(json.dumps({"columns": columns, "cadence": asdict(cadence)}))
        return EpisodeSummary(None, len(self._wall), success, self._task or "", cadence, seed, str(self.path))

    def discard(self) -> None:
        """Drop the staged episode (nothing was committed)."""
        with contextlib.suppress(Exception):
            self._ds.finalize()
        shutil.rmtree(self.path, ignore_errors=True)


class EpisodeRecorder:
    """Records episodes into a LeRobot v3.0 dataset at ``root``, committing each atomically.

    >>> rec = EpisodeRecorder(root, features=env_features(env), fps=10)   # or resume=True
    >>> rec.start_episode(seed=0)
    >>> rec.add_frame({...feature values...}, task="follow the person in red")
    >>> summary = rec.save_episode()        # commit; summary.cadence is the CadenceReport

    A kill at any point loses at most the episode in progress; ``EpisodeRecorder(root,
    resume=True)`` cleans up after it and continues numbering.
    """

    def __init__(self, root: str | Path, features: Mapping[str, Any] | None = None, fps: int | None = None,
                 robot_type: str | None = None, resume: bool = False, vcodec: str = "libsvtav1",
                 late_after_s: float | None = None):
        self.root = Path(root)
        self.vcodec = vcodec
        self.late_after_s = late_after_s
        if (self.root / INFO_PATH).exists():
            if not resume:
                raise DatasetError(f"{self.root}: a dataset already exists; pass resume=True (--resume) to "
                                   f"continue it or choose a new directory")
            self.recovery = recover(self.root)
            info = read_info(self.root)
            if features is not None:
                user = {k: v for k, v in features.items()}
                stored = {k: v for k, v in info["features"].items() if k in user}
                check_same_features(user, stored, f"resume {self.root}")
            if fps is not None and int(fps) != info["fps"]:
                raise DatasetError(f"{self.root / INFO_PATH}: dataset fps is {info['fps']}, recorder asked for {fps}")
        else:
            if features is None or fps is None:
                raise DatasetError(f"{self.root}: no dataset here; features and fps are needed to create one")
            info = create_dataset(self.root, features, fps, robot_type)
            self.recovery = None
        self.info = info
        self.fps = int(info["fps"])
        self.robot_type = info.get("robot_type")
        self.features = {k: v for k, v in info["features"].items()}
        self._episode: StagedEpisode | None = None
        self._seed: int | None = None

    @property
    def num_episodes(self) -> int:
        return int(read_info(self.root)["total_episodes"])

    def start_episode(self, seed: int | None = None) -> None:
        """Begin a new episode (discarding an unsaved one)."""
        if self._episode is not None:
            self._episode.discard()
        staging = self.root / STAGING_DIR / f"ep-{uuid.uuid4().hex[:12]}"
        self._episode = StagedEpisode(staging, self.features, self.fps, self.robot_type, self.vcodec,
                                      self.late_after_s)
        self._seed = seed

    def add_frame(self, frame: Mapping[str, Any], task: str, wall_time: float | None = None) -> float:
        """Add a frame to the current episode; returns its lateness (s). See StagedEpisode.add_frame."""
        if self._episode is None:
            self.start_episode()
        return self._episode.add_frame(frame, task, wall_time)

    def save_episode(self, success: bool | None = None, metadata: Mapping[str, Any] | None = None) -> EpisodeSummary:
        """Encode, stage and commit the current episode; returns its summary (with cadence)."""
        if self._episode is None:
            raise ValueError("no episode in progress")
        episode, self._episode = self._episode, None
        try:
            summary = episode.save(success=success, seed=self._seed, metadata=metadata)
            summary.episode_index = commit_staged(self.root, episode.path)
        except BaseException:
            shutil.rmtree(episode.path, ignore_errors=True)
            raise
        return summary

    def discard_episode(self) -> None:
        """Drop the episode in progress."""
        if self._episode is not None:
            self._episode.discard()
            self._episode = None

    def close(self) -> None:
        """Discard any unsaved episode and remove the staging area."""
        self.discard_episode()
        shutil.rmtree(self.root / STAGING_DIR, ignore_errors=True)

    def __enter__(self) -> "EpisodeRecorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
