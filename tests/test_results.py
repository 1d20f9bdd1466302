"""The published tables agree with the run records under results/ (robopolicy results --check)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from robopolicy.cli import main
from robopolicy.commands.results import ResultsError, build_tables, check, load_records, write
from robopolicy.utils.records import KINDS

ROOT = Path(__file__).resolve().parents[1]


def _copy(tmp_path: Path) -> Path:
    """The files the tables live in and the records they come from, under a scratch root."""
    import yaml

    root = tmp_path / "repo"
    shutil.copytree(ROOT / "results", root / "results")
    specs = yaml.safe_load((ROOT / "results" / "tables.yaml").read_text())["tables"]
    for file in {s["file"] for s in specs}:
        (root / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / file, root / file)
    return root


def test_the_repository_tables_agree_with_their_records(capsys):
    assert check(ROOT) == []
    assert main(["results", "--check", "--root", str(ROOT)]) == 0
    assert "agree" in capsys.readouterr().out


def test_every_record_has_the_run_record_fields_and_a_source():
    records = load_records(ROOT)
    assert len(records) >= 50
    for name, rec in records.items():
        assert rec["kind"] in KINDS, name  # the kinds a run record may have (robopolicy.utils.records)
        assert isinstance(rec["metrics"], dict) and rec["metrics"], name
        # a record is either a run's own summary (commit and machine known) or says where it came from
        assert rec.get("source") or (rec["commit"] and rec["machine"]), name


def test_the_headline_table_is_short_and_in_the_readme():
    headline = [t for t in build_tables(ROOT) if t.id == "headline"]
    assert len(headline) == 1 and headline[0].file == "README.md"
    assert len(headline[0].text.splitlines()) - 2 <= 12
    assert headline[0].text in (ROOT / "README.md").read_text()


def test_a_changed_record_is_caught_and_regenerated(tmp_path, capsys):
    root = _copy(tmp_path)
    path = root / "results" / "refinement" / "reach_residual_td3.json"
    rec = json.loads(path.read_text())
    assert rec["metrics"]["success_pct"] == 99.8
    rec["metrics"]["success_pct"] = 42.0
    path.write_text(json.dumps(rec))
    diffs = check(root)
    assert len(diffs) == 2  # the refinement table and the README's headline
    assert any("42.0" in d and "99.8" in d for d in diffs)
    assert main(["results", "--check", "--root", str(root)]) == 1
    assert "disagree" in capsys.readouterr().err
    assert write(root) == ["docs/results/refinement.md", "README.md"]
    assert check(root) == []
    assert "60.0 → 42.0%" in (root / "README.md").read_text()


def test_a_hand_edited_table_is_caught_and_the_text_around_it_kept(tmp_path):
    root = _copy(tmp_path)
    doc = root / "docs" / "results" / "tracking.md"
    text = doc.read_text()
    assert "| dt | 100.0 | 99.7 | 0.0 |" in text
    doc.write_text(text.replace("| dt | 100.0 | 99.7 | 0.0 |", "| dt | 100.0 | 99.9 | 0.0 |")
                   + "\nA note written by hand.\n")
    assert check(root)
    write(root)
    assert check(root) == []
    fixed = doc.read_text()
    assert "| dt | 100.0 | 99.7 | 0.0 |" in fixed and fixed.endswith("A note written by hand.\n")


def test_a_missing_record_or_marker_is_named(tmp_path, capsys):
    root = _copy(tmp_path)
    (root / "results" / "arm" / "reach_cam.json").unlink()
    with pytest.raises(ResultsError, match="results/arm/reach_cam.json"):
        check(root)
    assert main(["results", "--check", "--root", str(root)]) == 2
    assert "reach_cam" in capsys.readouterr().err

    root = _copy(tmp_path / "again")
    readme = root / "README.md"
    readme.write_text(readme.read_text().replace("<!-- results:table headline -->", ""))
    with pytest.raises(ResultsError, match="README.md: 0 markers"):
        check(root)


def test_a_missing_value_prints_as_a_dash(tmp_path):
    from robopolicy.commands.results import render_table

    records = {"a/x": {"metrics": {"v": 1.25, "none": None}, "seeds": [3, 1]}}
    spec = {"id": "t", "columns": ["v", "none", "absent", "seeds"],
            "rows": [{"records": ["a/x"], "cells": ["{m[v]:.1f}", "{m[none]:.1f}", "{m[nope]}", "{seeds}"]}]}
    assert render_table(spec, records).splitlines()[-1] == "| 1.2 | — | — | 1, 3 |"
