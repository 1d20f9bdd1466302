"""Writing files and directories so that a reader never sees one half-written.

One pattern, one place: write under a hidden temporary name beside the destination, then rename
it over the destination (a rename within a directory is atomic). On an error the temporary is
removed and the destination is left as it was.

    with atomic_file("out/video.mp4") as tmp:      # a stream writer (PyAV, numpy memmap, zarr)
        write_everything_to(tmp)
    atomic_write_text("out/summary.json", text)
    atomic_write_bytes("out/weights.bin", data)
    with atomic_directory("out/ckpt") as tmp:      # a whole directory
        (tmp / "config.yaml").write_text(...)
"""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Literal


def _temp_beside(path: Path, kind: str) -> Path:
    """A hidden name in ``path``'s directory, unique to this process and call; the suffix is kept
    (writers that pick a format from the extension still see it)."""
    return path.with_name(f".{path.stem}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:6]}{path.suffix}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's: its entries') contents to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | Path, durable: bool = False) -> Iterator[Path]:
    """Yield a temp file path beside ``path`` (not created); on success it replaces ``path``.

    For writers that stream into a file of their own (a video container, a memmapped array,
    a zarr store: a temp *directory* works too, as long as ``path`` does not exist yet).
    ``durable``: fsync the file before the rename and the directory after it, so the new file
    survives a power cut once the call returns (datasets being recorded)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_beside(path, "tmp")
    try:
        yield tmp
        if durable and tmp.is_file():
            fsync_path(tmp)
        os.replace(tmp, path)
        if durable:
            fsync_path(path.parent)
    finally:
        if tmp.exists():
            _remove(tmp)


def atomic_write_bytes(path: str | Path, data: bytes, durable: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically: a reader sees the old file or the whole new one."""
    with atomic_file(path, durable) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | Path, text: str, durable: bool = False) -> Path:
    """Write ``text`` to ``path`` atomically: a reader sees the old file or the whole new one."""
    with atomic_file(path, durable) as tmp:
        tmp.write_text(text)
    return Path(path)


@contextmanager
def atomic_directory(directory: str | Path, create: bool = True,
                     if_exists: Literal["replace", "keep"] = "replace") -> Iterator[Path]:
    """Yield a temp directory beside ``directory``; on success it becomes ``directory`` whole.

    ``create=False`` yields the path without making it (for writers that insist on creating
    their output directory themselves). If ``directory`` exists when the write completes,
    ``if_exists="replace"`` swaps it out; ``"keep"`` keeps it and drops the new one (another
    process finished the same work first). On an exception the temp directory is removed and
    ``directory`` is left as it was.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_beside(directory, "tmp")
    if create:
        tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if directory.exists() and if_exists == "keep":
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = _temp_beside(directory, "old")
    if directory.exists():
        os.rename(directory, old)
    try:
        os.rename(tmp, directory)
    except OSError:
        if not directory.exists() and old.exists():
            os.rename(old, directory)  # put the previous one back
        shutil.rmtree(tmp, ignore_errors=True)
        if if_exists == "keep" and directory.exists():
            return  # another process renamed its copy in between
        raise
    shutil.rmtree(old, ignore_errors=True)
