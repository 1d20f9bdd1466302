"""The one atomic-write helper: a reader sees the old content or the whole new one."""

import pytest

from robopolicy.utils.files import atomic_directory, atomic_file, atomic_write_bytes, atomic_write_text


def test_atomic_write_text_and_bytes_replace_whole_files(tmp_path):
    path = tmp_path / "sub" / "a.json"
    atomic_write_text(path, "old")
    atomic_write_text(path, "new")
    assert path.read_text() == "new"
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.json", "b.bin", "sub"]  # no temp left


def test_atomic_file_keeps_the_old_file_on_error_and_the_suffix_for_writers(tmp_path):
    path = tmp_path / "v.mp4"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(path) as tmp:
            assert tmp.suffix == ".mp4" and tmp.parent == tmp_path and not tmp.exists()
            tmp.write_text("half")
            raise RuntimeError("crash")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["v.mp4"]


def test_atomic_directory_replace_keep_and_create(tmp_path):
    d = tmp_path / "ckpt"
    with atomic_directory(d) as tmp:
        (tmp / "f").write_text("1")
    with atomic_directory(d) as tmp:
        (tmp / "f").write_text("2")
    assert (d / "f").read_text() == "2"
    with atomic_directory(d, if_exists="keep") as tmp:  # another process finished first: keep its copy
        (tmp / "f").write_text("3")
    assert (d / "f").read_text() == "2"
    with pytest.raises(ValueError):
        with atomic_directory(d) as tmp:
            (tmp / "f").write_text("4")
            raise ValueError("crash")
    assert (d / "f").read_text() == "2"
    with atomic_directory(tmp_path / "made_by_writer", create=False) as tmp:
        assert not tmp.exists()
        tmp.mkdir()
        (tmp / "x").write_text("y")
    assert (tmp_path / "made_by_writer" / "x").read_text() == "y"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "made_by_writer"]


def test_durable_write_lands_whole(tmp_path):
    path = atomic_write_text(tmp_path / "d" / "meta.json", "{}", durable=True)
    assert path.read_text() == "{}" and [p.name for p in path.parent.iterdir()] == ["meta.json"]
