"""A run is safe from its user: one locked directory, resumes that check what they resume, signals
to the whole process group (as SLURM, `timeout` and Ctrl-C send them) end in a checkpoint."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import QUIET, REPO, Run, logged_steps, python, read_jsonl, train, train_command


def test_one_run_writes_one_directory_with_its_resolved_name(tmp_path, cache_dir):
    command = [str(REPO / "train.py"), f"data.cache_dir={cache_dir}", *QUIET, "optim.max_steps=2", "eval_every=2"]
    result = python(command, cwd=tmp_path, timeout=300)  # `python train.py ...` from another directory
    assert result.returncode == 0, result.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1, runs
    run_dir = runs[0]
    assert {"hydra", "train.log", "checkpoints", "metrics.jsonl", "train_log.jsonl"} <= {
        p.name for p in run_dir.iterdir()
    }
    record = (run_dir / "hydra" / "config.yaml").read_text()
    assert f"name: '{run_dir.name}'" in record or f"name: {run_dir.name}\n" in record, record[:300]
    assert "${now" not in record


def test_multirun_jobs_each_get_their_own_run(tmp_path, cache_dir):
    command = [str(REPO / "train.py"), "-m", "name=sweep", f"data.cache_dir={cache_dir}", *QUIET]
    result = python([*command, "optim.max_steps=2", "eval_every=2", "optim.lr=0.001,0.002"], cwd=tmp_path, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    for job in ("0", "1"):
        run_dir = tmp_path / "runs" / "sweep" / job
        assert [row["step"] for row in read_jsonl(run_dir / "train_log.jsonl")] == [1, 2], job
        assert (run_dir / "checkpoints" / "step_00000002.dcp").is_dir()
    lrs = {read_jsonl(tmp_path / "runs" / "sweep" / job / "train_log.jsonl")[0]["lr"] for job in ("0", "1")}
    assert len(lrs) == 2  # two different runs, not one run resumed


def test_second_process_on_the_same_run_is_refused_with_the_holder(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    with Run.train(run_dir, cache_dir, "optim.max_steps=2000", "eval_every=1000") as first:
        first.wait_for_steps(2)
        second = train(run_dir, cache_dir, "optim.max_steps=2000", "seed=1", timeout=120)
        assert second.returncode == 2
        assert second.stderr.strip().startswith("error: ") and len(second.stderr.strip().splitlines()) == 1
        assert "is in use by pid" in second.stderr and str(first.pid) in second.stderr
        assert first.process.poll() is None
        first.signal_group(signal.SIGTERM)
        code, _, stderr = first.finish()
    assert code == 0, stderr[-3000:]
    steps = [row["step"] for row in read_jsonl(run_dir / "train_log.jsonl")]
    assert steps == list(range(1, len(steps) + 1))  # the first run's alone


def test_resume_with_another_world_size_warns_of_the_new_global_batch(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    assert train(run_dir, cache_dir, "optim.max_steps=2", "eval_every=2", "world.batch_per_device=16").returncode == 0
    resumed = train(run_dir, cache_dir, "optim.max_steps=3", "eval_every=3", "world=cpu2", "world.batch_per_device=16")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        "warning: resuming" in resumed.stderr and "with global batch 32 (2 rank(s) × 16), it was 16" in resumed.stderr
    )
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout  # on every launcher, spawned ranks too
    assert [row["step"] for row in read_jsonl(run_dir / "train_log.jsonl")] == [1, 2, 3]


def torchrun_command(run_dir, cache_dir, *overrides):
    """torchrun itself, its agent's files beside the run (its default, a torchelastic_* folder in /tmp, stays)."""
    command = train_command(run_dir, cache_dir, *overrides)
    agent = f"--log-dir={Path(run_dir).parent / 'torchelastic'}"
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", agent, *command[1:]]


@pytest.mark.parametrize(
    "signum, launch, workers",
    [
        (signal.SIGTERM, "local", 2),
        (signal.SIGINT, "local", 4),
        (signal.SIGTERM, "cpu2", 1),
        (signal.SIGINT, "cpu2", 0),
        (signal.SIGTERM, "torchrun", 1),
    ],
)
def test_signal_to_the_process_group_ends_in_a_checkpoint(tmp_path, cache_dir, signum, launch, workers):
    run_dir = tmp_path / "run"
    overrides = [
        "optim.max_steps=400",
        "eval_every=1000",
        "checkpoint_every=1000",
        f"data.workers={workers}",
        "data.resampled=true",
        "world.batch_per_device=16",
    ]
    if launch == "torchrun":
        command = torchrun_command(run_dir, cache_dir, *overrides, "world=cpu2", "world.spawn=false")
    else:
        command = train_command(run_dir, cache_dir, *overrides, f"world={launch}")
    with Run(command, run_dir) as run:
        run.wait_for_steps(4)
        run.signal_group(signum)
        code, _, stderr = run.finish()
    if launch != "torchrun":  # torchrun's own agent exits 1 when it is signalled, after its ranks
        assert code == 0, stderr[-3000:]
    stopped = read_jsonl(run_dir / "train_log.jsonl")[-1]["step"]
    assert (run_dir / "checkpoints" / f"step_{stopped:08d}.dcp").is_dir(), stderr[-3000:]
    if launch != "torchrun":  # torchrun's agent signals its ranks' whole groups itself once they have checkpointed
        assert "DataLoader worker" not in stderr and "Traceback" not in stderr


def test_second_interrupt_a_second_later_exits_at_once():
    code = """
import os, signal, time
from clipdist.distributed.launch import StopSignal
stop = StopSignal()
os.kill(os.getpid(), signal.SIGINT)
os.kill(os.getpid(), signal.SIGINT)  # the same Ctrl-C passed on by a launcher: still one interrupt
time.sleep(0.2)
assert stop.received == signal.SIGINT
print("asked to stop", flush=True)
time.sleep(1.1)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(10)
print("still running")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 130, result.stderr
    assert result.stdout.strip() == "asked to stop" and "second interrupt: exiting now" in result.stderr


def test_kill_and_resume_logs_each_step_once(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    overrides = ["optim.max_steps=12", "eval_every=4", "checkpoint_every=3", "world.batch_per_device=16"]
    with Run.train(run_dir, cache_dir, *overrides) as run:
        run.wait_for(
            lambda: (
                (run_dir / "checkpoints" / "step_00000006.dcp").exists()
                and (run_dir / "metrics.jsonl").exists()
                and logged_steps(run_dir) >= 8
            )
        )
        run.signal_group(signal.SIGKILL)
        run.finish(timeout=30)
    killed = [row["step"] for row in read_jsonl(run_dir / "train_log.jsonl")]
    assert killed[-1] > 6

    resumed = train(run_dir, cache_dir, *overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [row["step"] for row in read_jsonl(run_dir / "train_log.jsonl")] == list(range(1, 13))
    assert [row["step"] for row in read_jsonl(run_dir / "metrics.jsonl")] == [4, 8, 12]
    saved = re.findall(
        r"saved (step_\d+\.dcp): the loop held ([\d.]+) s .*, written in ([\d.]+) s in the background",
        (run_dir / "train.log").read_text(),
    )
    assert {name for name, _, _ in saved} >= {"step_00000009.dcp", "step_00000012.dcp"}, saved  # each save's stall
    assert all(float(held) <= float(written) for _, held, written in saved), saved


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({result.stderr.strip() or 'not root'})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_disk_full_is_one_line_and_leaves_no_partial_file(small_disk, cache_dir):
    """The 12 MB disk takes the logs but not a checkpoint (41 MB). Written in the step, the save's failure is the
    one line; in the background (the default), whichever of the checkpoint and the log line beside it meets the
    full disk first says so in one line. No partial file is left either way."""
    background = train(
        small_disk / "background", cache_dir, "optim.max_steps=3", "checkpoint_every=2", "eval_every=1000", timeout=120
    )
    assert background.returncode == 1 and "Traceback" not in background.stderr
    last = background.stderr.strip().splitlines()[-1]
    assert last.startswith("error: could not write ") and "No space left on device" in last, last
    assert not list((small_disk / "background" / "checkpoints").glob(".*partial"))
    shutil.rmtree(small_disk / "background")

    run_dir = small_disk / "run"
    result = train(
        run_dir,
        cache_dir,
        "optim.max_steps=3",
        "checkpoint_every=2",
        "eval_every=1000",
        "checkpoint.async_save=false",
        timeout=120,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: could not write checkpoint ") and "No space left on device" in lines[-1]
    assert str(run_dir / "checkpoints" / "step_00000002.dcp") in lines[-1]
    assert "Traceback" not in result.stderr
    assert not list((run_dir / "checkpoints").glob(".*partial"))

    goes_on = train(
        small_disk / "run2",
        cache_dir,
        "optim.max_steps=3",
        "checkpoint_every=2",
        "eval_every=1000",
        "on_checkpoint_error=warn",
        "checkpoint.async_save=false",
        timeout=120,
    )
    assert goes_on.returncode == 0, goes_on.stderr[-3000:]
    assert goes_on.stderr.count("No space left on device") == 2  # steps 2 and 3 tried, warned, went on
    assert [row["step"] for row in read_jsonl(small_disk / "run2" / "train_log.jsonl")] == [1, 2, 3]


def test_two_torchrun_agents_meet_over_loopback_and_train_as_two_nodes(tmp_path, cache_dir):
    """`torchrun --nnodes 2` on one machine: two agents (one per "node", one rank each) meet at a c10d rendezvous on
    127.0.0.1 and train world=cpu2 laid out as 2 nodes × 1, writing its checkpoint. (A two-node run resumed from its
    own checkpoint: tests/integration/test_slurm.py's two-node requeue.)"""
    from clipdist.distributed.launch import free_port

    run_dir = tmp_path / "run"

    def agents(steps):
        port = free_port()
        overrides = [
            "world=cpu2",
            "world.nodes=2",
            "world.procs_per_node=1",
            "world.spawn=false",
            f"optim.max_steps={steps}",
            "checkpoint_every=2",
            "eval_every=1000",
            "logging.log_every=1",
            "world.batch_per_device=16",
        ]
        started = []
        for node in range(2):
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=two-nodes-{steps}",
                f"--rdzv-conf=is_host={int(node == 0)}",
                f"--log-dir={tmp_path / f'torchelastic{node}'}",
                *train_command(run_dir, cache_dir, *overrides)[1:],
            ]
            started.append(
                subprocess.Popen(
                    command,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env={**os.environ, "HYDRA_FULL_ERROR": "0"},
                )
            )
        outputs = []
        for agent in started:
            try:
                outputs.append(agent.communicate(timeout=240))
            except subprocess.TimeoutExpired:
                for other in started:
                    other.kill()
                raise
        for agent, (_, stderr) in zip(started, outputs):
            assert agent.returncode == 0, stderr[-3000:]
        return outputs

    (first_out, first_err), _ = agents(2)
    assert "2 ranks on 1 node(s) (" in first_out + first_err and "(torchrun)" in first_out + first_err
    rows = read_jsonl(run_dir / "train_log.jsonl")
    assert [row["step"] for row in rows] == [1, 2] and all(row["loss"] == row["loss"] for row in rows)
    assert (run_dir / "checkpoints" / "step_00000002.dcp").is_dir()


def test_clipdist_torchrun_ends_a_failed_launch_in_one_line(tmp_path, cache_dir):
    """torchrun answers a rank's one-line refusal with its agent's traceback and a failure table; `clipdist torchrun`
    (the same launcher in-process) with one line naming the rank, and the rank's exit code as its own. The agent's
    files go to a folder the launch removes (torchrun's default left a torchelastic_* folder in /tmp each time)."""
    command = train_command(tmp_path / "run", cache_dir, "world=8gpu")
    launched = [sys.executable, "-m", "clipdist", "torchrun", "--standalone", "--nproc-per-node=2", *command[1:]]
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    environment = {**os.environ, "TMPDIR": str(temporary)}
    result = subprocess.run(launched, capture_output=True, text=True, timeout=120, cwd=REPO, env=environment)
    assert result.returncode == 2, result.stderr[-2000:]
    assert not list(temporary.iterdir()), sorted(p.name for p in temporary.iterdir())
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert errors[0].startswith("error: world=8gpu expects 8 processes"), errors
    assert "clipdist torchrun: error: rank" in errors[-1] and "exited with code 2" in errors[-1], errors
