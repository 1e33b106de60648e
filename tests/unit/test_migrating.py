"""docs/migrating.md lists every flag of the installed open_clip_train (its overrides are composed and checked in
tests/integration/test_migrating.py: ~10 s of Hydra composition)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

TABLE = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"
ROW = re.compile(r"^\| `(--[a-z0-9-]+)` \| (.*?) \| (same|better|N/A|not yet) \| (.*)\|$")


def open_clip_train_flags() -> set[str]:
    """Every option string of open_clip_train's own parser (its parse_args, captured as it parses nothing)."""
    from open_clip_train import params

    captured = {}
    parse = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        captured["parser"] = self
        return parse(self, args, namespace)

    argparse.ArgumentParser.parse_args = capture
    try:
        params.parse_args([])
    finally:
        argparse.ArgumentParser.parse_args = parse
    return {
        option
        for action in captured["parser"]._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }


def rows() -> dict[str, tuple[list[str], str, str]]:
    found = {}
    for line in TABLE.read_text().splitlines():
        match = ROW.match(line)
        if match:
            flag, cell, status, note = match.groups()
            overrides = shlex.split(cell.strip("` ")) if cell.strip() != "—" else []
            assert flag not in found, f"{flag} twice"
            found[flag] = (overrides, status, note.strip())
    return found


def test_the_migration_table_covers_every_open_clip_train_flag():
    flags, table = open_clip_train_flags(), rows()
    assert len(flags) == 90
    assert set(table) == flags, (sorted(flags - set(table)), sorted(set(table) - flags))
    for flag, (overrides, status, note) in table.items():
        assert overrides or status in ("N/A", "not yet"), f"{flag}: no override and no reason"
        if status in ("N/A", "not yet"):
            assert note, f"{flag}: {status} without a reason"
