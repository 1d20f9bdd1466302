"""The README and docs/ stay true to the code: their links, config paths and commands exist."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from robopolicy.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
# Pages that describe the code as it is (dated notes under docs/experiments/ are written once).
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "results").glob("*.md"))]


def _subcommands(parser: argparse.ArgumentParser, prefix: str = "robopolicy", with_help: bool = False):
    """(command path, its parser[, its one-line help]) for every subcommand, nested ones included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in action._choices_actions}
            for name, sub in action.choices.items():
                yield (f"{prefix} {name}", sub, helps.get(name)) if with_help else (f"{prefix} {name}", sub)
                yield from _subcommands(sub, f"{prefix} {name}", with_help)


def test_readme_is_a_short_guide():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for needed in ("make quickstart", "make test", "robopolicy train", "robopolicy eval", "robopolicy refine",
                   "robopolicy run", "docs/cli.md", "docs/hardware.md", "<!-- results:table headline -->"):
        assert needed in text, needed


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_config_paths_exist(page):
    text = page.read_text()
    for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in link:
            continue
        assert (page.parent / link).exists(), f"{page.name}: broken link {link}"
    for path in set(re.findall(r"(?<![\w/.])((?:configs|experiments/configs)/[\w/.-]+\.yaml)", text)):
        assert (ROOT / path).is_file(), f"{page.name}: {path} does not exist"


def test_commands_named_in_the_readme_exist():
    known = {path.split()[1] for path, _ in _subcommands(build_parser())}
    text = (ROOT / "README.md").read_text()
    for name in set(re.findall(r"`robopolicy ([a-z]+)", text)):
        assert name in known, f"README names `robopolicy {name}`, which is not a command"


CLI_BEGIN, CLI_END = "<!-- cli:reference -->", "<!-- /cli:reference -->"


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) or a.help == argparse.SUPPRESS:
            continue
        if a.option_strings:
            value = "" if a.nargs == 0 else f" {a.metavar or a.dest.upper()}"
            name = ", ".join(f"`{o}`{value}" for o in a.option_strings)
        else:
            name = f"`{a.metavar or a.dest}`" + (" …" if a.nargs in ("*", "+") else "")
        text = " ".join((a.help or "").split()).replace("|", "\\|")
        if not a.option_strings and a.dest == "overrides" and not text:
            text = "config overrides, `key=value` or `--key=value` (dotted keys: `env.kwargs.split=dt`)"
        if a.choices:
            text += (" " if text else "") + "(one of " + ", ".join(f"`{c}`" for c in a.choices) + ")"
        if a.required and a.option_strings:
            text += " Required."
        if a.option_strings and a.nargs != 0 and a.default not in (None, argparse.SUPPRESS):
            text += f" Default `{a.default}`."
        rows.append(f"| {name} | {text.strip()} |")
    return rows


def cli_reference() -> str:
    """The reference part of docs/cli.md: every command, its help and its options, from the parsers."""
    out = []
    for path, sub, help_text in _subcommands(build_parser(), with_help=True):
        out.append(f"{'#' * (path.count(' ') + 1)} `{path}`\n")
        if help_text:
            out.append(help_text[0].upper() + help_text[1:].rstrip(".") + ".\n")
        out.append("```\n" + " ".join(sub.format_usage().replace("usage: ", "").split()) + "\n```\n")
        rows = _option_rows(sub)
        if rows:
            out += ["| option | meaning |", "|---|---|", *rows, ""]
    return "\n".join(out).rstrip() + "\n"


def _cli_page(text: str, reference: str) -> str:
    head, _, rest = text.partition(CLI_BEGIN + "\n")
    _, _, tail = rest.partition(CLI_END)
    return f"{head}{CLI_BEGIN}\n{reference}{CLI_END}{tail}"


def test_cli_page_is_the_parsers_reference():
    page = ROOT / "docs" / "cli.md"
    text = page.read_text()
    assert CLI_BEGIN in text and CLI_END in text
    assert _cli_page(text, cli_reference()) == text, (
        "docs/cli.md differs from the command's parsers: regenerate it with `python tests/test_docs.py`")


if __name__ == "__main__":  # regenerate the reference part of docs/cli.md
    page = ROOT / "docs" / "cli.md"
    page.write_text(_cli_page(page.read_text(), cli_reference()))
    print(f"wrote {page}")
