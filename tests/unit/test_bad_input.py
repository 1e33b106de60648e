"""Bad input is one line naming it and what to do; an exception clipdist did not foresee is one line saying it is a
bug, its traceback in a file. Each case here was a traceback."""

from __future__ import annotations

import json

import pytest

from clipdist.cli import main as cli


@pytest.mark.parametrize(
    "option, said",
    [
        ("--nproc-per-node=abc", "(ValueError: Unsupported nproc_per_node value: abc)"),
        ("--nproc-per-node=0", "(AssertionError where self.local_world_size <= 0, in __post_init__)"),
        ("--nnodes=0", "(AssertionError: min_nodes must be > 0"),
        ("--monitor-interval=-1", "(AssertionError where self.monitor_interval <= 0, in __post_init__)"),
        ("--master-port=99999", "must be an integer between 0 and 65536"),
    ],
)
def test_torchruns_own_option_checks_are_one_line(capsys, option, said):
    """torchrun checks its options in its parser, its launch config and its worker spec, some with a bare assert:
    each is one line (exit 2), the condition said where torchrun gives no message."""
    assert cli(["torchrun", option, "train.py"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("clipdist torchrun: error: torchrun stopped the launch ("), lines
    assert said in lines[0], lines


def test_an_address_torchrun_would_wait_on_that_does_not_resolve_is_refused(capsys, monkeypatch):
    """A rank would retry an unresolvable master or local address until the rendezvous timeout: refused before.
    (The resolver answers "not known" here: a test sends no DNS query.)"""
    import socket

    from clipdist.distributed import torchrun

    asked = []
    resolve = socket.getaddrinfo

    def not_known(host, *args, **kwargs):
        asked.append(host)
        if host != "head-node":
            return resolve(host, *args, **kwargs)  # the default 127.0.0.1: numeric, no query
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", not_known)
    monkeypatch.setattr(torchrun, "run", lambda args: pytest.fail("the launch started"))
    for options, flag in (
        (["--master-addr=head-node"], "--master-addr head-node"),
        (["--rdzv-backend=c10d", "--rdzv-endpoint=head-node:29400"], "--rdzv-endpoint head-node"),
        (["--local-addr=head-node"], "--local-addr head-node"),
    ):
        assert cli(["torchrun", *options, "train.py"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines == [
            f"clipdist torchrun: error: {flag}: the address does not resolve ([Errno -2] Name or service "
            "not known); give a host or IP this node reaches"
        ], lines
    assert "head-node" in asked


@pytest.mark.parametrize(
    "row",
    [
        {"section": "step", "what": "B/16", "samples_per_s": "fast"},
        {"section": "step", "what": "B/16", "mfu": [0.3]},
        {"section": "step", "what": "B/16", "memory_bytes": float("inf")},
        {"section": "step", "what": "B/16", "device": 3},
        {"section": 1, "what": "B/16"},
    ],
)
def test_a_battery_row_of_the_wrong_type_is_refused_before_anything_runs(tmp_path, row):
    from clipdist.tools.gpu_battery import finished_rows

    path = tmp_path / "rows.json"
    path.write_text(json.dumps([row]))
    with pytest.raises(ValueError, match="not a battery's rows"):
        finished_rows(path, "cpu")
    good = {"section": "step", "what": "B/16", "device": "cpu", "samples_per_s": 10.5, "mfu": 0.2}
    path.write_text(json.dumps([good]))
    assert finished_rows(path, "cpu") == {("step", "B/16"): good}


def test_an_hf_hub_model_that_cannot_be_fetched_is_one_line(monkeypatch, tmp_path):
    """Offline (or no such repo): the config's fetch is the one clipdist's own helper makes, so its failure is the
    same line as the weights' — said before open_clip would try again."""
    from huggingface_hub import constants

    from clipdist.model.factory import create_model

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    said = "hf-hub:org/nothing-here: its open_clip_config.json is not in the cache"
    with pytest.raises(ValueError, match=said) as raised:
        create_model("hf-hub:org/nothing-here", device="meta", cache_dir=str(tmp_path))
    assert "\n" not in str(raised.value)


def test_an_unforeseen_exception_is_one_line_with_its_traceback_in_a_file(tmp_path, monkeypatch):
    from clipdist.errors import report_bug

    monkeypatch.chdir(tmp_path)
    try:
        raise KeyError("deep\ninside")
    except KeyError as error:
        said = report_bug(error, tmp_path / "missing-folder")  # not there: the working directory instead
    assert said.startswith("internal error (a bug in clipdist, not in your input): KeyError: ") and "\n" not in said
    written = list(tmp_path.glob("clipdist-bug-*.txt"))
    assert len(written) == 1 and str(written[0]) in said
    assert "Traceback" in written[0].read_text() and "test_an_unforeseen_exception" in written[0].read_text()


def _rank_failing_with(monkeypatch, error: Exception):
    """train.entry.train on a rank whose trainer raises `error`: what the rank raises."""
    from types import SimpleNamespace

    from clipdist.train import entry

    def failing(*args):
        raise error

    monkeypatch.setattr(entry, "Trainer", failing)
    monkeypatch.setattr(entry.launch, "init_process_group", lambda *args, **kwargs: None)
    monkeypatch.setattr(entry.startup, "configure_host", lambda *args: None)
    world = SimpleNamespace(device="cpu", backend="auto", timeout_s=1, rendezvous_timeout_s=1, parallel="ddp")
    with pytest.raises(Exception) as raised:
        entry.train(SimpleNamespace(world=world), None, None)
    return raised.value


def test_a_failed_allocation_is_said_as_one_not_as_a_bug(tmp_path, monkeypatch):
    """torch's CPU allocator, CUDA's OutOfMemoryError and Python's MemoryError: one line saying what it is, and no
    bug file; on a rank (train.entry.train) the error names the settings that ask less."""
    import torch

    from clipdist.errors import OutOfMemory, out_of_memory, report_bug

    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory")
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nGPU 0 has 79 GiB")
    monkeypatch.chdir(tmp_path)
    for error in (cpu, cuda, MemoryError()):
        assert out_of_memory(error)
        said = report_bug(error, tmp_path)
        assert said.startswith("out of memory: ") and "a bug" not in said and "\n" not in said
    assert not list(tmp_path.glob("clipdist-bug-*")) and not out_of_memory(RuntimeError("shape mismatch"))
    raised = _rank_failing_with(monkeypatch, cuda)
    assert isinstance(raised, OutOfMemory) and str(raised).startswith(
        "out of memory on rank 0 (cpu): CUDA out of memory. Tried to allocate 2.00 GiB.. Lower world.batch_per_device"
    )


def test_a_collective_past_its_timeout_names_the_setting_not_a_bug(monkeypatch):
    """gloo's own words when a peer is slower than world.timeout_s (a rank sleeping 4 s before a barrier, 1 s
    timeout), and NCCL's watchdog's: one line naming world.timeout_s; any other RuntimeError passes as it is."""
    from clipdist.errors import CollectiveTimeout

    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1000ms "
        "for recv operation to complete"
    )
    nccl = RuntimeError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)")
    for error in (gloo, nccl):
        raised = _rank_failing_with(monkeypatch, error)
        assert isinstance(raised, CollectiveTimeout) and raised.__cause__ is error
        assert str(raised).startswith("a collective on rank 0 waited past world.timeout_s=1 s (")
    other = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    assert _rank_failing_with(monkeypatch, other) is other


def test_hydras_own_failures_are_one_line(capsys, monkeypatch, tmp_path):
    """Where Hydra reports a failure itself (its start, --cfg, --info): a config it cannot compose is one `error:`
    line and exit 2; anything else one line saying it is a bug (exit 1) — never its stack trace."""
    from hydra.errors import MissingConfigException

    from clipdist import hydra_policy

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def missing():
        raise MissingConfigException("Cannot find primary config 'nope'.\n  details", missing_cfg_file="nope")

    def broken():
        raise RuntimeError("deep inside\nHydra")

    for action, code, said in ((missing, 2, "error: Cannot find primary config 'nope'."), (broken, 1, "a bug")):
        with pytest.raises(SystemExit) as stopped:
            hydra_policy.run_and_report(action)
        lines = capsys.readouterr().err.strip().splitlines()
        assert stopped.value.code == code and len(lines) == 1 and said in lines[0], lines
    assert hydra_policy.run_and_report(lambda: 7) == 7


def _actions(parser):
    """(command, action) of every argument of every subcommand, however deep."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from ((f"{name} {command}".strip(), inner) for command, inner in _actions(sub))
        else:
            yield "", action


def test_every_number_a_command_takes_is_bounded_where_it_is_parsed():
    """No command option takes a bare int or float (`--steps 0` ran `bench limit` into an internal error, `bench loss
    --repeats 0` too, `bench gpu --steps 0` failed every row): each number's type refuses what is below its bound,
    not a finite number, or not a number, and the declarations refuse a bare type."""
    import argparse

    from clipdist.cli import build_parser
    from clipdist.cli.arguments import csv
    from clipdist.cli.command import arg

    actions = list(_actions(build_parser()))
    assert not [(command, action.dest) for command, action in actions if action.type in (int, float)]
    bounded = [(command, action) for command, action in actions if hasattr(action.type, "bounds")]
    assert len(bounded) >= 20, [(command, action.dest) for command, action in bounded]
    for command, action in bounded:
        low, above, high = action.type.bounds
        below = low if above else low - 1
        for hostile in (str(below), "nan", "inf", "x"):
            with pytest.raises(argparse.ArgumentTypeError):
                action.type(hostile)
        assert action.type(str(int(low) + 1)) == int(low) + 1, (command, action.dest)
        if high is not None:
            with pytest.raises(argparse.ArgumentTypeError, match="at most"):
                action.type(str(int(high) + 1))
    with pytest.raises(TypeError, match="takes any number"):
        arg("--steps", type=int)
    with pytest.raises(TypeError, match="takes any number"):
        csv(float)


@pytest.mark.parametrize(
    "argv, line",
    [
        (["bench", "limit", "--steps", "0"], "clipdist bench limit: error: argument --steps: 0: must be at least 1"),
        (["bench", "loss", "--repeats", "0"], "clipdist bench loss: error: argument --repeats: 0: must be at least 1"),
        (
            ["bench", "gpu", "--tiny", "--large-batches", "512,-4"],
            "clipdist bench gpu: error: argument --large-batches: -4: must be at least 1",
        ),
        (
            ["gradcheck", "--seed", "-1"],
            "clipdist gradcheck: error: argument --seed: -1: must be at least 0 and at most 4294967295",
        ),
        (["plan", "--chunks", "auto,0"], "clipdist plan: error: argument --chunks: 0: must be at least 1"),
        (["eval"], "clipdist eval: error: the following arguments are required: target"),
        (["plan", "--nope"], "clipdist: error: unrecognized arguments: --nope"),
    ],
)
def test_a_number_out_of_its_bound_is_refused_before_anything_runs(capsys, argv, line):
    """One line naming the argument, exit 2 (cli.command.OneLineParser: argparse's own refusals too)."""
    assert cli(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]
