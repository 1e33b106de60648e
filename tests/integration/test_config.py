"""The config owns validation: typed choices and every check before any rank starts, one line each."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest


def test_importing_clipdist_has_no_side_effects():
    code = (
        "import logging, open_clip, clipdist.model.factory, clipdist.train.trainer, clipdist.cli;"
        "assert not logging.getLogger().filters, logging.getLogger().filters;"
        "assert 'clipdist-tiny' not in open_clip.list_models();"
        "from clipdist.model.factory import model_names; assert 'clipdist-tiny' in model_names()"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["gradcheck", "--loss", "os:getcwd"], "--loss 'os:getcwd' cannot be called as loss(image_features"),
        (["gradcheck", "--loss", "os:nope"], "--loss 'os:nope': cannot import it"),
        (["plan", "--global-batch", "0"], "--global-batch 0: must be at least 1"),
        (["plan", "--world", "3", "--global-batch", "64"], "--global-batch 64 does not divide over 3 ranks"),
    ],
)
def test_subcommand_errors_are_one_line_naming_the_argument(argv, message, capsys):
    """In this process (the command's own main, as `python -m clipdist` calls it; the process itself below)."""
    from clipdist.cli import main

    started = time.monotonic()
    assert main(argv) == 2
    stderr = capsys.readouterr().err
    assert stderr.strip().splitlines() == [f"clipdist {argv[0]}: error: {stderr.split('error: ', 1)[1].strip()}"]
    assert message in stderr
    assert time.monotonic() - started < 30  # refused before anything is measured or spawned


def test_a_subcommand_error_is_one_line_and_exit_2_from_the_command_line():
    result = subprocess.run(
        [sys.executable, "-m", "clipdist", "plan", "--global-batch", "0"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["clipdist plan: error: --global-batch 0: must be at least 1"]
