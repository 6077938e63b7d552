"""The README and the docs show commands that the command line takes.

Every ``vlcontrast ...`` line of a ``bash`` block in README.md and docs/*.md (continuation lines
joined, comments dropped; synopses with ``[optional]`` parts or ``...`` left out) parses with the
real parser, and the ``key=value`` overrides of its ``train`` and ``config`` lines name config keys.
The README stays short enough to read: detail belongs in docs/.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from vlcontrast.cli import build_parser
from vlcontrast.config import load_config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"^(?:\$ )?(?:python -m vlcontrast(?:\.cli)?|vlcontrast)\s+(.*)$")
README_LIMIT = 9 * 1024


def documented_commands() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", page.read_text(), flags=re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                match = COMMAND.match(line.strip())
                if not match:
                    continue
                command = match.group(1).split(" #")[0].strip()
                if not any(mark in command for mark in ("[", "...", "…", "|")):
                    found.append((page.name, command))
    return found


COMMANDS = documented_commands()


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 40 and {page for page, _ in COMMANDS} >= {"README.md", "usage.md"}


@pytest.mark.parametrize("page, command", COMMANDS, ids=[f"{p}:{c[:40]}" for p, c in COMMANDS])
def test_a_documented_command_parses(page, command):
    try:
        args = build_parser().parse_args(shlex.split(command))
    except SystemExit as stop:
        pytest.fail(f"{page}: `vlcontrast {command}` does not parse (exit {stop.code})")
    if args.command in ("train", "config") and getattr(args, "overrides", None):
        load_config(None, list(args.overrides), check=False)  # unknown keys raise, naming them


def test_the_readme_stays_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; move detail to docs/"
