"""The registry's tables (clipdist.registry): plug-ins read from entry points at the first lookup, each held to its
group's spec type and a name of its own; one that fails is left out with one line saying why. And the keys that
moved into a component's own section say where they went."""

from __future__ import annotations

import sys

import pytest

from clipdist.registry import Registry, left_out
from clipdist.registry.losses import BACKENDS, LossSpec


def _installed(tmp_path, monkeypatch, entries: str) -> None:
    """A package installed into a folder on sys.path: its dist-info with these entry points, and its module."""
    info = tmp_path / "clipdist_test_lab-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: clipdist-test-lab\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entries)
    (tmp_path / "clipdist_test_lab.py").write_text(
        "from clipdist.registry.losses import LossSpec\n"
        "GOOD = LossSpec('good', 'clipdist.losses.naive:NaiveLoss', 'naive again')\n"
        "TAKEN = LossSpec('disco', 'clipdist.losses.naive:NaiveLoss', 'a built-in name')\n"
        "MISNAMED = LossSpec('other', 'clipdist.losses.naive:NaiveLoss', 'named unlike its entry point')\n"
        "NOT_A_SPEC = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "clipdist_test_lab", raising=False)


def test_plugins_join_the_builtins_and_the_wrong_ones_are_left_out_in_one_line(tmp_path, monkeypatch, capsys):
    _installed(
        tmp_path,
        monkeypatch,
        "[clipdist.test]\ngood = clipdist_test_lab:GOOD\ndisco = clipdist_test_lab:TAKEN\n"
        "misnamed = clipdist_test_lab:MISNAMED\nnumber = clipdist_test_lab:NOT_A_SPEC\n"
        "gone = clipdist_nowhere:SPEC\n",
    )
    table = Registry("clipdist.test", LossSpec, BACKENDS.values())
    assert list(table) == [*BACKENDS, "good"]  # built-ins first, then plug-ins by name
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 4, said
    assert "plug-in disco = clipdist_test_lab:TAKEN (clipdist.test): 'disco' is built in" in said[0]
    assert "gone = clipdist_nowhere:SPEC (clipdist.test): it did not load (ModuleNotFoundError" in said[1]
    assert "misnamed = clipdist_test_lab:MISNAMED (clipdist.test): its spec is named 'other'" in said[2]
    assert "number = clipdist_test_lab:NOT_A_SPEC (clipdist.test): it is a int, not a LossSpec" in said[3]
    assert "it did not load" in left_out("clipdist.test", "gone") and left_out("clipdist.test", "good") == ""


def test_a_table_reads_its_plugins_once_and_only_when_looked_up(tmp_path, monkeypatch, capsys):
    _installed(tmp_path, monkeypatch, "[clipdist.test_lazy]\ngood = clipdist_test_lab:GOOD\n")
    table = Registry("clipdist.test_lazy", LossSpec, ())
    assert "clipdist_test_lab" not in sys.modules  # a plug-in's module may import any registry module
    assert table["good"].summary == "naive again" and len(table) == 1
    (tmp_path / "clipdist_test_lab.py").unlink()
    assert list(table) == ["good"]  # read once


@pytest.mark.parametrize(
    "old, new",
    [
        ("data.csv_separator=tab", "data.table.separator"),
        ("data.csv_rows_per_part=5", "data.table.rows_per_part"),
        ("optim.cooldown_steps=5", "optim.const_cooldown.steps"),
        ("optim.cooldown_power=2", "optim.const_cooldown.power"),
    ],
)
def test_a_key_that_moved_into_its_components_section_names_the_new_one(old, new):
    from clipdist.config import unknown_override

    said = unknown_override([old])
    assert said is not None and f"did you mean {new}?" in said, said
