"""Real runs on shards with problems: skip counts summed over ranks and loader workers under every
launcher, sources that give nothing stop the run in seconds, a stuck loader still honours SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from fixtures import caption_shards
from helpers import REPO, Run, read_jsonl, train, train_command


def webdataset(shards, *overrides):
    return [
        "data=webdataset",
        f"data.train_shards={shards}",
        "data.shuffle_buffer=0",
        "data.resampled=false",
        *overrides,
    ]


@pytest.mark.parametrize("launch", ["cpu2", "torchrun"])
def test_skips_in_loader_workers_are_summed_over_ranks(tmp_path, launch):
    # 4 shards of 1 bad + 23 good samples; 2 ranks x 1 worker x 4 samples per step, two readers (data.readers=2: a
    # cycle of one global batch, so rank r reads reader r), an epoch of 96 rows = 12 cycles of 8: each rank's reader
    # has two whole shards of it. Step 1 opens one shard per rank, by step 8 each rank is 9 samples into its second
    # shard: all four bad samples read, and no other.
    shards = caption_shards(
        tmp_path / "shards",
        shards=4,
        per_shard=23,
        bad_first=True,
        pixel=lambda shard, i: i * 9 % 256,
        caption=lambda i: b"a grey square",
    )
    overrides = webdataset(
        shards,
        "data.workers=1",
        "data.readers=2",
        "world.batch_per_device=4",
        "optim.max_steps=8",
        "eval_every=100",
        "checkpoint_every=100",
    )
    run_dir = tmp_path / "run"
    if launch == "torchrun":
        command = train_command(run_dir, tmp_path / "cache", *overrides, "world=cpu2", "world.spawn=false")
        agent = f"--log-dir={tmp_path / 'torchelastic'}"  # not torchrun's default folder in /tmp, which stays
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", agent]
        command = [*launcher, *command[1:]]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    else:
        result = train(run_dir, tmp_path / "cache", *overrides, "world=cpu2")
    assert result.returncode == 0, result.stderr[-3000:]
    skipped = [row["skipped_samples"] for row in read_jsonl(run_dir / "train_log.jsonl")]
    assert skipped[0] == 2 and skipped[-1] == 4, skipped
    for rank in (0, 1):  # each rank's loader worker warns of its own skips, and says which rank it is
        assert f"warning: rank {rank}: skipped: " in result.stderr, result.stderr[-3000:]


def test_shards_that_are_not_tar_files_stop_the_run_in_seconds(tmp_path):
    (tmp_path / "shards").mkdir()
    for name in ["0.tar", "1.tar"]:
        (tmp_path / "shards" / name).write_text("<html>403 Forbidden</html>\n" * 30)
    started = time.monotonic()
    result = train(
        tmp_path / "run", tmp_path / "cache", *webdataset(tmp_path / "shards", "data.workers=1"), timeout=120
    )
    assert result.returncode == 1
    assert time.monotonic() - started < 60
    error = result.stderr.strip().splitlines()[-1]
    # sizes unknown (nothing in them to count): whole shards are dealt, one reader each (order.run_layout's bound)
    assert error.startswith("error: rank 0: none of the 1 shard(s) reader 0 reads gave a sample"), result.stderr
    assert "0.tar: cannot be read as a tar file" in error and "Traceback" not in result.stderr
    assert len((result.stdout + result.stderr).encode()) < 20_000  # warnings are rate-limited


def command_line(process: psutil.Process) -> list[str]:
    """A process's command line; none for one that ended (or became a zombie) since it was listed."""
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def test_sigterm_while_the_loader_waits_on_a_stuck_source(tmp_path):
    # A pipe: shard whose command never writes: the loader blocks in read(). SIGTERM to the trainer alone
    # (as `kill PID` sends it) must still end in a checkpoint and a clean exit, and the command is stopped.
    run_dir, sleep = tmp_path / "run", f"sleep {1000 + os.getpid() % 9000}"  # a command line no one else runs
    command = train_command(
        run_dir, tmp_path / "cache", *webdataset(f"'pipe:{sleep}'", "data.workers=0"), "checkpoint_every=100"
    )
    with Run(command, run_dir) as run:
        run.wait_for(
            lambda: any(
                command_line(child) == sleep.split() for child in psutil.Process(run.pid).children(recursive=True)
            ),
            120,
            "the pipe: command",
        )
        time.sleep(1)
        os.kill(run.pid, signal.SIGTERM)
        code, stdout, stderr = run.finish(timeout=60)
    assert code == 0, stderr[-3000:]
    assert "stopped by a signal at step 0" in stdout
    assert (run_dir / "checkpoints" / "step_00000000.dcp").is_dir()
    assert subprocess.run(["pgrep", "-f", sleep], capture_output=True).returncode == 1  # not left behind


def test_training_on_a_table_skips_a_missing_image_and_resumes_exactly(tmp_path, cache_dir):
    """open_clip's TSV (filepath, title) trained on in parts; a resume equals the run never stopped."""
    from tests.unit.test_data import _open_clip_table

    table = _open_clip_table(tmp_path / "data", rows=40, missing=(3,))
    common = [
        "data.source=null",
        f"data.train_shards={table}",
        f"data.val_shards={table}",
        "data.table.rows_per_part=8",
        "world.batch_per_device=8",
        "checkpoint_every=3",
        "eval_every=3",
    ]
    first = train(tmp_path / "run", cache_dir, "optim.max_steps=3", *common)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "image images/3.png: No such file or directory" in first.stderr
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]
    assert metrics["val_samples"] == 39 and metrics["val_skipped"] == 1 and "i2t_r1" in metrics
    resumed = train(tmp_path / "run", cache_dir, "optim.max_steps=5", *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "cannot continue sample for sample" not in resumed.stderr
    whole = train(tmp_path / "whole", cache_dir, "optim.max_steps=5", *common)  # within warmup: the same lr per step
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert [row["loss"] for row in read_jsonl(tmp_path / "run" / "train_log.jsonl")] == [
        row["loss"] for row in read_jsonl(tmp_path / "whole" / "train_log.jsonl")
    ]
