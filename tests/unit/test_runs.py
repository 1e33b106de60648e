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


def test_a_stop_inside_the_data_path_leaves_the_generators_as_before_the_wait(monkeypatch):
    """A read cut short by a stop (stuck past the grace) may stop anywhere in `next(stream)` — in a loader read in
    this process, inside an augmentation that had seeded torch's and Python's generators from a sample's key
    (data.stream's _augment). The stand-in step and the checkpoint must see the generators as they were before the
    read, as the uninterrupted run has them (else the resumed run draws other dropout masks: seen as a flaky fp16 /
    Lion resume test)."""
    import random
    import time
    from types import SimpleNamespace

    import numpy as np
    import torch

    from clipdist.distributed.launch import StopSignal
    from clipdist.train import startup
    from clipdist.train.trainer import Trainer

    stop = StopSignal(grace_s=0.2)

    def interrupted_augmentation():
        torch.default_generator.manual_seed(1234)  # what _augment does first, for a sample's key
        random.seed(1234)
        np.random.seed(1234)
        os.kill(os.getpid(), signal.SIGTERM)  # the stop comes here, before the augmentation puts them back,
        time.sleep(30)  # and the read is stuck: interrupted after the grace
        raise AssertionError("the stop signal did not interrupt the read")

    monkeypatch.setattr(startup, "stand_in_batch", lambda trainer: "stand-in")
    stream = type("Stream", (), {"__next__": lambda self: interrupted_augmentation()})()
    trainer = SimpleNamespace(checkpointer=SimpleNamespace(stop=stop), stream=stream)
    for seed in (torch.manual_seed, random.seed, np.random.seed):
        seed(7)
    expected = (torch.rand(3), random.random(), np.random.rand())
    for seed in (torch.manual_seed, random.seed, np.random.seed):
        seed(7)
    try:
        assert Trainer.next_batch(trainer) == "stand-in"
    finally:
        stop.restore()
    drawn = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(drawn[0], expected[0]) and drawn[1:] == expected[1:]


def test_a_read_under_way_when_a_stop_comes_may_finish_and_a_stuck_one_is_cut_after_the_grace():
    """A stop during a read does not raise at an arbitrary point of it: a read that finishes within the grace gives
    its batch (the step then stops on its agreement); one still going then is interrupted."""
    import time

    from clipdist.distributed.launch import StopRequested, StopSignal

    stop = StopSignal(grace_s=0.3)
    try:
        with stop.interruptible():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the rest of a read that finishes
            finished = True
        assert finished and stop.received == signal.SIGTERM
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # no alarm left behind to fire later
        stop.received = None
        started = time.monotonic()
        with pytest.raises(StopRequested):
            with stop.interruptible():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)  # stuck
        assert 0.25 < time.monotonic() - started < 5
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
