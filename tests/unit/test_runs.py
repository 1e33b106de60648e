"""A run is safe from its user: one locked directory, resumes that check what they resume, signals
to the whole process group (as SLURM, `timeout` and Ctrl-C send them) end in a checkpoint."""

from __future__ import annotations

import os
import signal

import pytest
from helpers import refusal


def test_resume_with_another_loss_is_refused_and_changes_nothing(trained_run, cache_dir, capsys, monkeypatch):
    before = {path: path.read_bytes() for path in trained_run.rglob("*") if path.is_file()}
    code, lines = refusal(
        capsys,
        monkeypatch,
        f"run_dir={trained_run}",
        f"data.cache_dir={cache_dir}",
        "optim.max_steps=40",
        "loss=siglip",
    )
    assert code == 2 and len(lines) == 1, lines
    assert "loss.name=disco" in lines[0] and "not loss.name=siglip" in lines[0] and "name=<new name>" in lines[0]
    assert {path: path.read_bytes() for path in trained_run.rglob("*") if path.is_file()} == before


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_every_stop_signal_asks_for_a_stop(signum):
    from clipdist.distributed.launch import StopRequested, StopSignal

    stop = StopSignal()
    try:
        os.kill(os.getpid(), signum)
        assert stop.received == signum
        with pytest.raises(StopRequested):  # a loader waiting for data is interrupted at once
            with stop.interruptible():
                pass
    finally:
        stop.restore()


def test_a_file_system_without_flock_is_one_line_saying_where_to_run(tmp_path, monkeypatch):
    import errno
    import fcntl

    from clipdist.checkpoint.run_dir import RunLock
    from clipdist.errors import ConfigError

    def no_flock(*_):  # what Lustre mounted without -o flock answers
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(
        ConfigError,
        match=r"does not support flock \(Function not implemented\); put the run on one "
        r"that does with run_dir=",
    ):
        RunLock(tmp_path / "run").acquire()
