"""Code shape: no function over 80 lines in the learning packages, and residual PPO readable top
to bottom in one file of at most 250 lines."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
MAX_RESIDUAL_PPO_LINES = 250
PACKAGES = ("robopolicy/refine", "robopolicy/rl", "robopolicy/train", "robopolicy/models", "robopolicy/eval")


def long_functions(package: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (n lines)`` of every function or method in ``package`` longer than ``limit``
    lines (from its ``def`` line, decorators aside, to its last line)."""
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_is_longer_than_80_lines(package):
    assert long_functions(package) == []


def test_residual_ppo_reads_in_one_short_file():
    lines = (ROOT / "robopolicy/refine/residual_ppo.py").read_text().splitlines()
    assert len(lines) <= MAX_RESIDUAL_PPO_LINES, f"residual_ppo.py has {len(lines)} lines"


def test_the_checker_finds_a_long_function(tmp_path, monkeypatch):
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert long_functions("pkg") == ["pkg/m.py:5 long (82 lines)"]
