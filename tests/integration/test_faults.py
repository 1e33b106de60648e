"""Faults survived with nothing lost: signals, a killed rank, non-finite losses, srun-style launch."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest
import torch
from helpers import Run, read_jsonl, run_log, train

from clipdist.checkpoint.weights import read_progress

STEPS = ["optim.max_steps=400", "optim.warmup_steps=5", "eval_every=1000", "checkpoint_every=50"]


# SIGUSR1 (SLURM's --signal) takes the same path: test_every_stop_signal_asks_for_a_stop, and test_slurm for real.
@pytest.mark.parametrize("signum", [signal.SIGTERM])
def test_signal_writes_a_checkpoint_and_resume_continues_the_schedule(tmp_path, cache_dir, signum):
    run_dir = tmp_path / "run"
    with Run.train(run_dir, cache_dir, *STEPS) as run:
        run.wait_for_steps(7)
        os.kill(run.pid, signum)
        code, _, stderr = run.finish()
    assert code == 0, stderr[-3000:]
    before = read_jsonl(run_dir / "train_log.jsonl")
    stopped_at = before[-1]["step"]
    assert stopped_at < 400
    assert (run_dir / "checkpoints" / f"step_{stopped_at:08d}.dcp").is_dir()

    resumed = train(run_dir, cache_dir, *STEPS[:-1], "optim.max_steps=" + str(stopped_at + 5), "checkpoint_every=50")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = read_jsonl(run_dir / "train_log.jsonl")[len(before) :]
    assert [row["step"] for row in after] == list(range(stopped_at + 1, stopped_at + 6))
    # The checkpoint holds the state after exactly the steps that were logged.
    saved = read_progress(run_dir / "checkpoints" / f"step_{stopped_at:08d}.dcp")
    assert saved["step"] == stopped_at and saved["samples_seen"] == stopped_at * 64


HOST_LINES = ("1 loader worker", "1 intra-op thread", "malloc keeps", "images normalized", "loader workers at")


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_killed_rank_tears_the_job_down_and_resume_restarts(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    overrides = ["world=cpu2", "world.timeout_s=60", *STEPS[:-1], "checkpoint_every=5"]
    with Run.train(run_dir, cache_dir, *overrides, fresh=True) as run:  # train.py's command line, for its ranks
        run.wait_for(lambda: (run_dir / "checkpoints" / "step_00000005.dcp").exists())
        # The ranks are forked from the launcher: its command line (not the resource tracker's).
        workers = [pid for pid in children(run.pid) if b"train.py" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        code, _, stderr = run.finish(timeout=180)  # torn down, not hung
    assert code != 0
    newest = max(int(p.stem.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*.dcp"))

    resumed = train(run_dir, cache_dir, *overrides[:-1], f"optim.max_steps={newest + 3}", "checkpoint_every=5")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [row["step"] for row in read_jsonl(run_dir / "train_log.jsonl")]
    assert steps[-3:] == [newest + 1, newest + 2, newest + 3]
    assert (run_dir / "checkpoints" / "step_00000005.dcp").exists()  # nothing before it lost


def test_non_finite_losses_stop_the_run_and_say_where_to_go_on(tmp_path, cache_dir):
    """Also the console convention: progress on stdout, warnings and the error on stderr, all of it in
    train.log, the final error last."""
    from clipdist.model.factory import create_model

    model = create_model()
    with torch.no_grad():
        model.logit_scale.fill_(float("nan"))
    torch.save({"state_dict": model.state_dict()}, tmp_path / "nan.pt")
    result = train(
        tmp_path / "run",
        cache_dir,
        f"model.checkpoint={tmp_path / 'nan.pt'}",
        "max_nonfinite_steps=3",
        "optim.max_steps=50",
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.count("warning: step 1: non-finite loss, step skipped") == 3
    error = result.stderr.strip().splitlines()[-1]
    shown = result.stdout.splitlines() + result.stderr.splitlines()
    assert not [line for line in result.stdout.splitlines() if line.startswith(("warning:", "error:"))]
    assert f"run directory: {tmp_path / 'run'}" in result.stdout and run_log(tmp_path / "run")[-1] == error
    logged = run_log(tmp_path / "run")  # every console line, and the host's lines the console leaves out
    assert sorted(line for line in logged if not line.startswith(HOST_LINES)) == sorted(x for x in shown if x.strip())
    assert any(line.startswith(HOST_LINES) for line in logged)
    assert not any(line.startswith(HOST_LINES) for line in shown)
    assert error.startswith("error: 3 non-finite losses in a row after step 0") and "stopped without saving" in error
    assert "Start again with a lower learning rate (optim.lr=0.0002)" in error  # no checkpoint to go on from
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_two_processes_started_like_srun_train(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    with contextlib.ExitStack() as ranks:
        runs = [
            ranks.enter_context(
                Run.train(
                    run_dir,
                    cache_dir,
                    "world=cpu2",
                    "optim.max_steps=6",
                    "eval_every=6",
                    env={
                        "SLURM_PROCID": str(rank),
                        "SLURM_NTASKS": "2",
                        "SLURM_LOCALID": str(rank),
                        "SLURM_JOB_NODELIST": "localhost",
                        "SLURM_JOB_ID": str(4000 + os.getpid() % 1000),
                        "OMP_NUM_THREADS": "1",
                    },
                )
            )
            for rank in range(2)
        ]
        for run in runs:
            code, _, stderr = run.finish(timeout=240)
            assert code == 0, stderr[-3000:]
    log = read_jsonl(run_dir / "train_log.jsonl")
    assert [row["step"] for row in log] == list(range(1, 7))
    console = run_log(run_dir)  # the main rank's lines, once
    assert console.count(f"run directory: {run_dir}") == 1 and sum(line.startswith("step 6: ") for line in console) == 1
    assert read_jsonl(run_dir / "metrics.jsonl")[-1]["step"] == 6
