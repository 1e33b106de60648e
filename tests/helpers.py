"""Run train.py the way a user does (a subprocess with a timeout, or its own process group), build small
shards and streams, and check refusals in this process."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# no W&B, no bar, every step logged, no picture at the end (~1 s a run; tests/unit/test_train.py asks for one), and
# the loader in the run's own process (data=digits' automatic workers would start a process per run; a test that
# names a data group or data.workers gets its own)
QUIET = (
    "logging.wandb=disabled",
    "logging.progress=false",
    "logging.log_every=1",
    "logging.report=false",
    "data.workers=0",
)


def own_environment() -> dict[str, str]:
    """This process's environment for a run started as a user starts one: without WANDB_SERVICE, which wandb sets
    here once a run in this process used it — a process started with it joins this process's W&B service, and a
    run killed there would leave its W&B run open in it."""
    return {key: value for key, value in os.environ.items() if key != "WANDB_SERVICE"}


def train_command(run_dir: Path, cache_dir: Path, *overrides: str) -> list[str]:
    """train.py with QUIET's settings, unless an override sets the same key."""
    given = {override.split("=", 1)[0] for override in overrides}
    quiet = [
        setting
        for setting in QUIET
        if setting.split("=", 1)[0] not in given and not (setting.startswith("data.") and "data" in given)
    ]
    return [
        sys.executable,
        str(REPO / "train.py"),
        f"run_dir={run_dir}",
        f"data.cache_dir={cache_dir}",
        *quiet,
        *overrides,
    ]


def train(
    run_dir: Path, cache_dir: Path, *overrides: str, timeout: float = 300, env=None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """train.py with these overrides: (exit code, stdout, stderr) as a user's shell sees them.

    Run in this process — train.py's entry point, called as train.py calls it; `world=cpu2` forks its
    ranks from here as it would from train.py — since a fresh interpreter spends ~8 s importing torch and
    the towers' libraries. `env` or `fresh=True`: in a fresh interpreter (with `timeout`), for what
    only a process start shows (environment variables, imports, the interpreter's exit)."""
    command = train_command(run_dir, cache_dir, *overrides)
    if env is not None or fresh:
        environment = {**own_environment(), "HYDRA_FULL_ERROR": "0", **(env or {})}
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=environment)
    return _train_here(command)


def _train_here(command: list[str]) -> subprocess.CompletedProcess:
    import tempfile

    import torch

    from clipdist.cli import train_main
    from clipdist.console import close_run_log

    threads, argv, full_error = torch.get_num_threads(), list(sys.argv), os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "0"
    code = 0
    with (
        tempfile.TemporaryDirectory() as folder,
        console_into(Path(folder) / "out", Path(folder) / "err"),
        hydra_composes_once(),
    ):
        try:
            train_main(command[2:])
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
        finally:
            torch.set_num_threads(threads)
            sys.argv = argv
            os.environ.pop("HYDRA_FULL_ERROR") if full_error is None else os.environ.update(HYDRA_FULL_ERROR=full_error)
            close_run_log()
    return subprocess.CompletedProcess(command, code, console_into.text[0], console_into.text[1])


def hydra_composes_once():
    """Hydra's entry point composes the config twice: once to read `hydra.mode` from it (Hydra.get_mode), then for
    the run. clipdist's config never sets hydra.mode, so that first answer is always None (the mode then comes from
    -m / --multirun): within the block it is None without composing — ~0.1-0.4 s a start, hundreds of starts."""
    from unittest import mock

    from hydra._internal.hydra import Hydra

    def get_mode(self, config_name, overrides):
        assert not any(override.lstrip("+~").startswith("hydra.mode=") for override in overrides), overrides
        return None

    return mock.patch.object(Hydra, "get_mode", get_mode)


class console_into:
    """stdout and stderr of this process and of what it forks (ranks, loader workers) into two files, at the
    Python and the file-descriptor level; their text is in `console_into.text` once the block ends."""

    text = ("", "")

    def __init__(self, out: Path, err: Path):
        self.paths = (out, err)

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved, self.saved_fds = (sys.stdout, sys.stderr), (os.dup(1), os.dup(2))
        self.files = [open(path, "a", buffering=1) for path in self.paths]
        for fd, handle in zip((1, 2), self.files):
            os.dup2(handle.fileno(), fd)
        sys.stdout, sys.stderr = self.files
        return self

    def __exit__(self, *exc):
        for handle in self.files:
            handle.flush()
        sys.stdout, sys.stderr = self.saved
        for fd, saved in zip((1, 2), self.saved_fds):
            os.dup2(saved, fd)
            os.close(saved)
        for handle in self.files:
            handle.close()
        console_into.text = tuple(path.read_text() for path in self.paths)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_log(run_dir: Path) -> list[str]:
    """<run_dir>/train.log's lines without their times: what the console showed."""
    import re

    text = (Path(run_dir) / "train.log").read_text()
    return [line for line in re.sub(r"^\[[0-9-]+ [0-9:,]+\] ", "", text, flags=re.M).splitlines() if line.strip()]


def logged_steps(run_dir: Path) -> int:
    log = Path(run_dir) / "train_log.jsonl"
    return len(log.read_text().splitlines()) if log.exists() else 0


# What a training process imports (~8 s in a fresh interpreter, most of a short run's start): a Run forks from a
# server that has imported them once (multiprocessing's forkserver, started by the first Run of a test process).
PRELOAD = ["helpers", "clipdist.cli", "clipdist.train.trainer"]


class Run:
    """A training process in its own process group (as srun or a terminal starts one): wait for it, signal
    it or its group, and on leaving the `with` block the whole group is killed if still running.

    `python X ...` and `python -m M ...` commands start as a process forked from a server that has imported
    PRELOAD (a new session, this process's environment, the command's argv, stdout and stderr to files): the same
    program without the fresh interpreter's imports. `env` or `fresh=True`: a fresh interpreter (subprocess), for
    what only a process start shows (environment variables read at import, the command line in /proc)."""

    def __init__(
        self, command: list[str], run_dir: Path, env: dict | None = None, fresh: bool = False, cwd: Path = REPO
    ):
        import tempfile

        self.run_dir = Path(run_dir)
        self.output = Path(tempfile.mkdtemp(prefix="run-output-"))
        out, err = self.output / "stdout", self.output / "stderr"
        out.touch(), err.touch()
        if fresh or env is not None or command[0] != sys.executable:
            with open(out, "w") as stdout, open(err, "w") as stderr:
                self.process = subprocess.Popen(
                    command,
                    cwd=cwd,
                    start_new_session=True,
                    stdout=stdout,
                    stderr=stderr,
                    env={**own_environment(), **(env or {})},
                )
        else:
            self.process = _forked(command[1:], out, err, cwd)
        self.pid = self.process.pid

    @classmethod
    def train(cls, run_dir: Path, cache_dir: Path, *overrides: str, env: dict | None = None, fresh=False) -> Run:
        return cls(train_command(run_dir, cache_dir, *overrides), run_dir, env, fresh)

    def text(self) -> tuple[str, str]:
        return (self.output / "stdout").read_text(), (self.output / "stderr").read_text()

    def wait_for(self, condition, seconds: float = 240, what: str = "the condition") -> None:
        deadline = time.time() + seconds
        while not condition():
            if self.process.poll() is not None:
                raise AssertionError(f"exited early ({self.process.returncode}): {self.text()[1][-3000:]}")
            assert time.time() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def wait_for_steps(self, steps: int, seconds: float = 240) -> None:
        self.wait_for(lambda: logged_steps(self.run_dir) >= steps, seconds, f"{steps} logged steps")

    def signal_group(self, signum: int) -> None:
        os.killpg(self.pid, signum)

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) once it exits by itself within `timeout`."""
        code = self.process.wait(timeout=timeout)
        return (code, *self.text())

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        import shutil

        if self.process.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=60)
        shutil.rmtree(self.output, ignore_errors=True)


class _forked:
    """A command run as `python argv...` would run it, in a process forked from the preloading server: the parts
    of subprocess.Popen a Run uses (pid, poll, returncode, wait)."""

    def __init__(self, argv: list[str], out: Path, err: Path, cwd: Path):
        import multiprocessing
        from multiprocessing import forkserver

        from clipdist.distributed.host import spin_briefly

        multiprocessing.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        try:  # the server loads libgomp as train.py would: after the CLI has set its spin count (host.spin_briefly)
            spin_briefly()
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        context = multiprocessing.get_context("forkserver")
        self.child = context.Process(target=_python, args=(argv, own_environment(), str(cwd), str(out), str(err)))
        self.child.start()
        self.pid = self.child.pid

    @property
    def returncode(self) -> int | None:
        return self.child.exitcode

    def poll(self) -> int | None:
        return self.child.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.child.join(timeout)
        if self.child.exitcode is None:
            raise subprocess.TimeoutExpired(["python", "(forked)"], timeout or 0)
        return self.child.exitcode


def train_until(run_dir: Path, cache_dir: Path, overrides, step: int, signum: int = signal.SIGTERM) -> int:
    """Train until `step` steps are logged, then send `signum` to the run's process group: SIGTERM or SIGINT must
    end it cleanly (exit 0, a checkpoint at the step it stopped at), SIGKILL leaves what it leaves. Returns the last
    logged step (a crash on any rank during the stop fails here, not as a resume that starts over)."""
    with Run.train(run_dir, cache_dir, *overrides) as run:
        run.wait_for_steps(step)
        run.signal_group(signum)
        code, _, stderr = run.finish()
    if signum != signal.SIGKILL:
        assert code == 0, stderr[-3000:]
    return read_jsonl(Path(run_dir) / "train_log.jsonl")[-1]["step"]


def python(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python argv...` in `cwd` as a program (a Run; its group killed after `timeout`): its exit code and output
    as subprocess.run gives them."""
    with Run([sys.executable, *argv], cwd, cwd=cwd) as run:
        code, stdout, stderr = run.finish(timeout)
    return subprocess.CompletedProcess(["python", *argv], code, stdout, stderr)


def _python(argv: list[str], environment: dict, cwd: str, out: str, err: str) -> None:
    """In the forked process: what `python argv...` runs, as the leader of a new session (its exit code: the
    program's; a signal that kills it: −signum, as subprocess reports it)."""
    import multiprocessing
    import runpy

    multiprocessing.set_start_method(None, force=True)  # the interpreter's default again (not the server's)
    os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environment)
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


def identity_transform(image):
    """An image as one number (its mean): a stream test's transform, cheap and telling images apart."""
    import numpy as np
    import torch

    return torch.from_numpy(np.array(image)).float().mean()


def train_stream(
    sources,
    batch_size: int,
    image_transform,
    *,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    start_method: str | None = None,
    low_priority_workers: bool = False,
    readers: int | None = None,
    sizes=None,
    layout: tuple[int, int] | None = None,
    **data,
):
    """A TrainStream over `sources` (shard paths, or a list of such lists: one per source), with
    DataConfig(**data) for everything else (shuffle_buffer=0 unless given); `layout` a run's (order.run_layout)."""
    from clipdist.config import DataConfig
    from clipdist.data.stream import TrainStream
    from clipdist.model.factory import get_tokenizer

    if sources and not isinstance(sources[0], (list, tuple)):
        sources = [sources]
    data.setdefault("shuffle_buffer", 0)
    return TrainStream(
        [[str(url) for url in urls] for urls in sources],
        DataConfig(source=None, **data),
        batch_size=batch_size,
        image_transform=image_transform,
        tokenizer=get_tokenizer(),
        rank=rank,
        world_size=world_size,
        seed=seed,
        low_priority_workers=low_priority_workers,
        start_method=start_method,
        readers=readers,
        sizes=sizes,
        layout=layout,
    )


def refusal(capsys, monkeypatch, *overrides: str) -> tuple[int, list[str]]:
    """Start train.py's entry point in this process and expect it to refuse before any rank starts:
    (exit code, the non-empty lines on stderr). Starting to train fails the test instead."""
    import pytest

    import clipdist
    from clipdist.cli import train_main
    from clipdist.distributed import launch
    from clipdist.train import entry

    def started(*_args, **_kwargs):
        raise AssertionError(f"the start with {overrides} was not refused: it began to train")

    # Every module that binds launch_local by name is imported first: one imported during the patch would keep the
    # stand-in after it (a later test's `clipdist eval` then "began to train": seen when test files ran in another
    # order).
    for module in pkgutil.walk_packages(clipdist.__path__, "clipdist."):
        if not module.name.endswith("__main__"):  # which would run the command line
            importlib.import_module(module.name)
    monkeypatch.setattr(entry, "train", started)
    monkeypatch.setattr(launch, "launch_local", started)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    with pytest.raises(SystemExit) as stopped, hydra_composes_once():
        train_main([*overrides])
    return stopped.value.code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]
