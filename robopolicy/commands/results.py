"""``robopolicy results``: the published tables, generated from the run records under ``results/``.

    robopolicy results            # rewrite the tables in docs/results/*.md and README.md
    robopolicy results --check    # exit 1 (and show the difference) when a table and its records disagree

The records are ``results/<area>/<name>.json``, in the schema of the ``summary.json`` every run
writes (``robopolicy.utils.records``). ``results/tables.yaml`` says which tables exist, in which
file, and how each row is made from records::

    tables:
      - id: arm/state-demos                    # the table's marker in its file
        file: docs/results/arm.md
        columns: [demos, "success %"]
        rows:
          - records: [arm/state_chunk_200]     # one or more records, by path under results/
            cells: ["{r[title]}", "{m[success_pct]:.1f}"]

A cell is a ``str.format`` template over the row's first record ``r``, its metrics ``m``, every
record of the row ``rs`` and ``seeds`` (the seeds of all of them, joined); a missing or null value
prints as ``—``, the conversion ``!m`` shows seconds in minutes and ``!j`` joins a list with commas. A cell ``{each: TEMPLATE, join: ", "}`` formats every record of the row and joins
them. In the file, the generated table sits between ``<!-- results:table ID -->`` and
``<!-- /results:table -->``; everything outside the markers is left as written.
"""

from __future__ import annotations

import argparse
import difflib
import re
import string
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MISSING = "—"
TABLES_FILE = "results/tables.yaml"
_BEGIN = "<!-- results:table {id} -->"
_END = "<!-- /results:table -->"


class ResultsError(ValueError):
    """The tables file, a record or a marker is malformed; the message names which."""


class _Lenient(string.Formatter):
    """``str.format`` where a missing key or a null value makes the whole cell ``—``."""

    class Missing(Exception):
        pass

    def get_field(self, field_name, args, kwargs):
        try:
            obj, used = super().get_field(field_name, args, kwargs)
        except (KeyError, IndexError, AttributeError, TypeError):
            raise self.Missing(field_name) from None
        if obj is None:
            raise self.Missing(field_name)
        return obj, used

    def convert_field(self, value, conversion):
        if conversion == "m":  # seconds shown in minutes: "{r[wall_time_s]!m:.1f} min"
            return value / 60.0
        if conversion == "j":  # a list joined: "{m[curve]!j}" -> "66, 71, 80"
            return ", ".join(str(v) for v in value)
        return super().convert_field(value, conversion)

    def cell(self, template: str, **context: Any) -> str:
        try:
            return self.vformat(template, (), context)
        except self.Missing:
            return MISSING


_FORMAT = _Lenient()


@dataclass
class Table:
    id: str
    file: str
    text: str
    """The generated markdown table."""


def load_records(root: Path) -> dict[str, dict[str, Any]]:
    """Every record under ``root/results`` by its name (``<area>/<name>``, no ``.json``)."""
    from robopolicy.utils.records import read_summary

    records = {}
    for path in sorted((root / "results").glob("*/*.json")):
        try:
            records[f"{path.parent.name}/{path.stem}"] = read_summary(path)
        except ValueError as exc:  # JSON errors are ValueErrors too
            raise ResultsError(f"{path.relative_to(root)}: {exc}") from None
    return records


def _row_cells(spec: dict[str, Any], records: dict[str, dict[str, Any]], where: str) -> list[str]:
    names = spec.get("records") or []
    if isinstance(names, str):
        names = [names]
    missing = [n for n in names if n not in records]
    if missing:
        raise ResultsError(f"{where}: no record results/{missing[0]}.json")
    rs = [records[n] for n in names]
    first = rs[0] if rs else {}
    seeds = sorted({s for r in rs for s in (r.get("seeds") or [])})
    context = {"r": first, "m": first.get("metrics", {}), "rs": rs,
               "seeds": ", ".join(str(s) for s in seeds) if seeds else None}
    cells = []
    for cell in spec["cells"]:
        if isinstance(cell, dict):
            parts = [_FORMAT.cell(cell["each"], **{**context, "r": r, "m": r.get("metrics", {})})
                     for r in rs]
            cells.append(cell.get("join", ", ").join(parts))
        else:
            cells.append(_FORMAT.cell(str(cell), **context))
    return cells


def render_table(spec: dict[str, Any], records: dict[str, dict[str, Any]]) -> str:
    """One table spec of ``tables.yaml`` as markdown."""
    columns = spec["columns"]
    align = spec.get("align") or ["---"] * len(columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(align) + "|"]
    for i, row in enumerate(spec["rows"]):
        where = f"{TABLES_FILE}: table {spec['id']}, row {i + 1}"
        cells = _row_cells(row, records, where)
        if len(cells) != len(columns):
            raise ResultsError(f"{where}: {len(cells)} cells for {len(columns)} columns")
        lines.append("| " + " | ".join(c.replace("|", "\\|") if c != MISSING else c for c in cells) + " |")
    return "\n".join(lines)


def build_tables(root: Path) -> list[Table]:
    """Every table of ``results/tables.yaml``, rendered from the records."""
    import yaml

    path = root / TABLES_FILE
    if not path.is_file():
        raise ResultsError(f"{path}: not found")
    specs = (yaml.safe_load(path.read_text()) or {}).get("tables") or []
    records = load_records(root)
    ids = [s.get("id") for s in specs]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise ResultsError(f"{TABLES_FILE}: table id {sorted(dup)[0]} given twice")
    return [Table(s["id"], s["file"], render_table(s, records)) for s in specs]


def _replace(text: str, table: Table, file: str) -> str:
    begin = _BEGIN.format(id=table.id)
    pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(_END), re.S)
    found = pattern.findall(text)
    if len(found) != 1:
        raise ResultsError(f"{file}: {len(found)} markers '{begin}' … '{_END}' (need exactly one)")
    return pattern.sub(lambda _: f"{begin}\n{table.text}\n{_END}", text)


def render_files(root: Path) -> dict[str, tuple[str, str]]:
    """``{file: (text now, text with every table regenerated)}`` for each file that holds tables."""
    out: dict[str, tuple[str, str]] = {}
    for table in build_tables(root):
        if table.file not in out:
            path = root / table.file
            if not path.is_file():
                raise ResultsError(f"{table.file}: not found (table {table.id})")
            text = path.read_text()
            out[table.file] = (text, text)
        now, new = out[table.file]
        out[table.file] = (now, _replace(new, table, table.file))
    return out


def check(root: Path) -> list[str]:
    """Unified diffs of every file whose tables disagree with the records (empty: all agree)."""
    diffs = []
    for file, (now, new) in render_files(root).items():
        if now != new:
            diffs.append("".join(difflib.unified_diff(now.splitlines(True), new.splitlines(True),
                                                      f"{file} (as written)", f"{file} (from records)")))
    return diffs


def write(root: Path) -> list[str]:
    """Regenerate the tables in place; returns the files that changed."""
    from robopolicy.utils.files import atomic_write_text

    changed = []
    for file, (now, new) in render_files(root).items():
        if now != new:
            atomic_write_text(root / file, new)
            changed.append(file)
    return changed


def cmd_results(args: argparse.Namespace) -> int:
    root = Path(args.root)
    try:
        if args.check:
            diffs = check(root)
            for d in diffs:
                print(d)
            n = len(build_tables(root))
            if diffs:
                print(f"robopolicy results: {len(diffs)} file(s) disagree with results/; "
                      "run `robopolicy results` to regenerate", file=sys.stderr)
                return 1
            print(f"robopolicy results: {n} tables agree with their records")
            return 0
        changed = write(root)
        print(f"robopolicy results: {len(build_tables(root))} tables; rewrote "
              f"{', '.join(changed) if changed else 'nothing (already up to date)'}")
        return 0
    except ResultsError as exc:
        print(f"robopolicy results: {exc}", file=sys.stderr)
        return 2


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("results", help="regenerate the results tables (docs/results, README) from results/",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 when a table and its records disagree")
    p.add_argument("--root", default=".", help="the repository root (default: the current directory)")
    p.set_defaults(func=cmd_results)
