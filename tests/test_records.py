"""Run records (robopolicy.utils.records): the summary.json every run writes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from pathlib import Path

import pytest

from robopolicy.utils.records import (RECORD_KEYS, build_summary, config_digest, git_commit,
                                      machine_info, read_summary, write_summary)


@dataclasses.dataclass
class _Inner:
    lr: float = 1e-3
    path: Path = Path("a/b")


@dataclasses.dataclass
class _Cfg:
    seed: int = 0
    inner: _Inner = dataclasses.field(default_factory=_Inner)


def test_summary_holds_every_field(tmp_path):
    started = time.time() - 2.0
    path = write_summary(tmp_path / "run", kind="eval", config=_Cfg(), seeds=[0, 1], episodes=40,
                         metrics={"success_rate": 0.925}, started_at=started,
                         command=["robopolicy", "eval", "--checkpoint", "x"])
    assert path == tmp_path / "run" / "summary.json"
    rec = json.loads(path.read_text())
    assert list(rec)[: len(RECORD_KEYS)] == list(RECORD_KEYS)
    assert rec["kind"] == "eval" and rec["seeds"] == [0, 1] and rec["episodes"] == 40
    assert rec["metrics"] == {"success_rate": 0.925}
    assert rec["command"] == ["robopolicy", "eval", "--checkpoint", "x"]
    assert 1.5 < rec["wall_time_s"] < 60
    assert rec["started_at"].endswith("+00:00")
    assert rec["config_digest"].startswith("sha256:") and len(rec["config_digest"]) == 7 + 64
    assert read_summary(tmp_path / "run") == rec
    assert not list((tmp_path / "run").glob(".*tmp*")), "the temp file of the atomic write stays"


def test_config_digest_is_canonical_and_sensitive():
    a = config_digest({"b": 1, "a": {"y": 2, "x": [1, 2]}})
    b = config_digest({"a": {"x": [1, 2], "y": 2}, "b": 1})
    assert a == b
    assert config_digest({"b": 2, "a": {"y": 2, "x": [1, 2]}}) != a
    assert config_digest(_Cfg()) == config_digest(dataclasses.asdict(_Cfg()))
    assert config_digest(_Cfg()) != config_digest(_Cfg(seed=1))
    assert config_digest(None) is None


def test_commit_of_a_checkout_and_of_no_checkout(tmp_path):
    assert git_commit(tmp_path) is None  # not a git checkout
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "f.txt").write_text("1")
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    assert git_commit(repo) == {"sha": head, "dirty": False}
    (repo / "f.txt").write_text("2")
    assert git_commit(repo) == {"sha": head, "dirty": True}


def test_machine_names_cpu_and_cores():
    m = machine_info()
    assert m["cpu"] and isinstance(m["cpu"], str)
    assert m["logical_cores"] >= 1
    import torch  # noqa: F401 - once torch is loaded, its threads are recorded

    assert machine_info()["torch_threads"] >= 1


def test_values_are_made_json_safe(tmp_path):
    np = pytest.importorskip("numpy")
    rec = build_summary(kind="bench", metrics={"x": np.float32(0.5), "bad": float("nan"),
                                                "p": Path("a"), "t": (1, 2)},
                        commit=None, machine=None)
    assert rec["metrics"] == {"x": 0.5, "bad": None, "p": "a", "t": [1, 2]}
    write_summary(tmp_path, kind="bench", metrics={"bad": float("inf")})
    assert read_summary(tmp_path)["metrics"] == {"bad": None}


def test_bad_kind_extra_and_foreign_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="kind"):
        build_summary(kind="")
    with pytest.raises(ValueError, match="metrics"):
        build_summary(kind="eval", extra={"metrics": {}})
    assert build_summary(kind="eval", extra={"source": "log"}, commit=None)["source"] == "log"
    (tmp_path / "summary.json").write_text(json.dumps({"kind": "eval"}))
    with pytest.raises(ValueError, match="missing"):
        read_summary(tmp_path)


def test_the_recorded_command_names_no_absolute_path(tmp_path, monkeypatch):
    """A record is checked in: its command says what a user types, not where this checkout lives."""
    import json
    import sys

    from robopolicy.utils.records import write_summary

    monkeypatch.setattr(sys, "argv", [str(tmp_path / "src" / "robopolicy" / "__main__.py"), "eval", "--checkpoint", "d"])
    write_summary(tmp_path, kind="eval", metrics={})
    assert json.loads((tmp_path / "summary.json").read_text())["command"] == ["robopolicy", "eval", "--checkpoint", "d"]
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "elsewhere" / "bench.py"), "--out", "x"])
    write_summary(tmp_path, kind="bench", metrics={})
    assert json.loads((tmp_path / "summary.json").read_text())["command"] == ["bench.py", "--out", "x"]


def test_checked_in_records_name_no_absolute_path():
    """The records under results/ are published: none may carry a path of the machine that ran them."""
    root = Path(__file__).resolve().parents[1] / "results"
    for path in sorted(root.glob("*/*.json")):
        record = json.loads(path.read_text())
        for part in record.get("command") or []:
            assert not str(part).startswith("/"), f"{path.name}: command names an absolute path {part!r}"
