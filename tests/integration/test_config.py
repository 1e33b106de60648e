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
        (["plan", "--global-batch", "0"], "argument --global-batch: 0: must be at least 1"),
        (["plan", "--global-batch", "x"], "argument --global-batch: 'x' is not an integer"),
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
    from helpers import REPO, python  # `python -m clipdist plan ...` as a program

    result = python(["-m", "clipdist", "plan", "--global-batch", "0"], cwd=REPO, timeout=120)
    assert result.returncode == 2
    said = result.stderr.strip().splitlines()
    assert said == ["clipdist plan: error: argument --global-batch: 0: must be at least 1"]


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["world=8gpu"], "world=8gpu expects 8 processes"),
        (["optim.max_steps=0"], "optim.max_steps=0: must be at least 1"),
        (["optim.lrr=1"], "did you mean optim.lr?"),
        (["--experimental-rerun", "x.pickle"], "unpickles"),
        (["optim.lr=-1"], "optim.lr=-1.0: must be 0 or more"),
        (["data=webdataset", "data.train_shards=/nope/x.tar"], "1 of 1 shards not found"),
        (["LOCKED"], "is in use by pid"),
    ],
)
def test_a_refusal_comes_before_torch_loads(tmp_path, overrides, said):
    """The refusals a comparison answers — a value, the world, a missing shard, a run in progress holding the run
    directory's lock — are said before torch is imported (open_clip, timm and transformers the ~8 s of 11 s they
    took, torch the next 3-4 s), as `python -X importtime` shows; the run directory is never made."""
    import fcntl

    from helpers import REPO, own_environment

    holder = None
    if overrides == ["LOCKED"]:  # a run in progress: its lock held by another process
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / ".lock").write_text("pid 4242 on elsewhere since today\n")
        holder = open(tmp_path / "run" / ".lock")  # noqa: SIM115 -- held for the test
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        overrides = []
    result = subprocess.run(
        [sys.executable, "-X", "importtime", str(REPO / "train.py"), f"run_dir={tmp_path / 'run'}", *overrides],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=own_environment(),
    )
    if holder is not None:
        holder.close()
    lines = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert result.returncode == 2 and len(lines) == 1 and said in lines[0], lines
    heavy = {"torch", "open_clip", "timm", "transformers"}
    assert not imported & heavy, sorted(imported & heavy)
    assert holder is not None or not (tmp_path / "run").exists()


def test_a_complete_run_says_so_in_seconds(tmp_path, cache_dir):
    """Resubmitting a finished run: one line that it is complete, exit 0, said before the towers' libraries load
    (was: the whole start, ~40 s, to say the same)."""
    from helpers import REPO, own_environment, train

    run_dir = tmp_path / "run"
    assert train(run_dir, cache_dir, "optim.max_steps=2", "eval_every=2", "checkpoint_every=2").returncode == 0
    result = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            str(REPO / "train.py"),
            f"run_dir={run_dir}",
            f"data.cache_dir={cache_dir}",
            "optim.max_steps=2",
            "logging.wandb=disabled",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=own_environment(),
    )
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert result.returncode == 0 and "is already complete at step 2 (optim.max_steps=2)" in result.stdout, result
    assert "open_clip" not in imported
