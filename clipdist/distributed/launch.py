"""Who is who and how the ranks start: the launcher's environment (torchrun, srun, a local spawn),
the process group, the local launcher, the stop signals a run answers with a checkpoint, and the
killing of a process tree (loader workers, `pipe:` commands).

The loss backends' collectives live in clipdist.losses.collectives, the loop's in clipdist.distributed.parallel.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import glob
import io
import multiprocessing.util
import os
import queue as queue_module
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any, TypeVar

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from clipdist import console
from clipdist.defaults import COLLECTIVE_TIMEOUT_S
from clipdist.distributed.network import free_port, unreachable  # noqa: F401 -- re-exported
from clipdist.distributed.world import (  # noqa: F401 -- detect_env: re-exported
    DistEnv,
    check_local_ranks,
    check_world,
    detect_env,
)
from clipdist.errors import ClipdistError, ConfigError
from clipdist.files import save_torch

# Signals that ask a run to checkpoint and stop (preemption, SLURM's --signal, Ctrl-C): the trainer
# handles them (StopSignal), loader workers ignore them, the local launcher passes them on.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
Result = TypeVar("Result")  # what a rank's function returns (launch_local)


def placement(env: DistEnv) -> str:
    """Where the ranks run and where they met, for rank 0 to log (a collective: every rank calls it).

    '4 ranks on 2 node(s) (n1: ranks 0-1, n2: ranks 2-3), rendezvous at n1:20017'."""
    hosts: list = [None] * env.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    ranks: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        ranks.setdefault(host, []).append(rank)
    spans = ", ".join(
        f"{host}: ranks {r[0]}-{r[-1]}"
        if r == list(range(r[0], r[-1] + 1))
        else f"{host}: ranks {','.join(map(str, r))}"
        for host, r in ranks.items()
    )
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return f"{env.world_size} ranks on {len(ranks)} node(s) ({spans}), rendezvous at {where} ({env.launcher})"


def init_process_group(
    env: DistEnv, *, timeout_s: float, rendezvous_timeout_s: float, backend: str | None = None, single: bool = False
) -> None:
    """Start the default process group for `env` (for a single process only if `single`: FSDP needs one).

    `timeout_s` bounds every collective: a rank that dies makes the others fail after
    `timeout_s` instead of hanging forever. Under srun (no launcher of torch's), the ranks meet
    at rank 0's TCP store, bounded by `rendezvous_timeout_s`: a task that never starts fails
    the others then, not after the collective timeout.
    """
    if dist.is_initialized() or (env.world_size == 1 and not single):
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = timedelta(seconds=timeout_s)
    if env.world_size == 1 and env.launcher == "single":  # no launcher, no rendezvous: an in-memory store
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    if env.launcher == "slurm":
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            env.world_size,
            is_master=env.rank == 0,
            timeout=timedelta(seconds=rendezvous_timeout_s),
            wait_for_workers=True,
        )
        dist.init_process_group(backend=backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
        return
    dist.init_process_group(backend=backend, timeout=timeout)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class StopRequested(BaseException):
    """Raised by StopSignal.interruptible(): a stop signal came while the trainer waited for data, and the read did
    not finish within the grace."""


class StopSignal:
    """SIGTERM, SIGUSR1 (preemption, SLURM's --signal) and SIGINT (Ctrl-C) ask for a checkpoint at the
    next step and a clean exit. A second SIGINT exits at once, without a checkpoint — if it comes a
    second or more after the first: a launcher (torchrun) passes the terminal's Ctrl-C on to its
    ranks, which get it from the terminal too."""

    SAME_INTERRUPT_S = 1.0
    GRACE_S = 2.0  # a read under way when a stop comes may finish for this long; one still going is stuck
    in_this_process: bool = False  # a stop was asked for in this process (the run's end then skips the report)

    def __init__(self, grace_s: float = GRACE_S):
        self.received: int | None = None
        self.grace_s = grace_s
        self._waiting = self._armed = False
        self._first_interrupt: float | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
            self._previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._overdue)

    def _handle(self, signum, _frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._first_interrupt is not None and now - self._first_interrupt >= self.SAME_INTERRUPT_S:
                os.write(2, b"\nsecond interrupt: exiting now, without a checkpoint\n")
                os._exit(130)
            self._first_interrupt = self._first_interrupt or now
        self.received = signum
        StopSignal.in_this_process = True
        if self._waiting and not self._armed:
            self._armed = True
            signal.setitimer(signal.ITIMER_REAL, self.grace_s)

    def _overdue(self, _signum, _frame) -> None:
        self._armed = False
        if self._waiting:
            self._waiting = False
            raise StopRequested()

    @contextmanager
    def interruptible(self):
        """A read that a stop signal may cut short. A stop already received raises StopRequested here, before the
        read begins. One that comes during the read lets it finish (the step then stops on its agreement) unless it
        is still going `grace_s` later: a loader stuck on a hung source (a stalled network read, a pipe: command
        that never writes) is interrupted then, so it cannot hold a stop up. Not at once: an exception raised at an
        arbitrary point of a read in this process can land between a lock's acquire and its `try`, or between an
        augmentation's seeding of the generators and its `finally`. A BaseException, so no `except Exception` on the
        way (webdataset's handlers) swallows it."""
        if self.received is not None:
            raise StopRequested()
        self._waiting = True
        try:
            yield
        finally:
            self._waiting = False
            if self._armed:
                self._armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


def share_temp_dir() -> None:
    """This process's multiprocessing temporary folder (pymp-*), made now so the processes it starts next inherit it
    (a child copies its parent's `_config` when it is made) rather than each making its own: a worker sharing a
    tensor puts a socket there, and workers and ranks are stopped with SIGKILL (Loader.close, launch_local), which
    left each one's folder in /tmp for good. This process removes the one folder at its exit."""
    multiprocessing.util.get_temp_dir()


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything it started."""
    try:
        process = psutil.Process(pid)
        members = [*process.children(recursive=True), process]
    except psutil.NoSuchProcess:
        return
    for member in members:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass


class _UserError:
    """A ClipdistError raised in a spawned rank, carried back to the launching process to be raised there."""

    def __init__(self, error: Exception):
        self.type, self.message = type(error), str(error)


def _spawned_worker(
    rank: int, world_size: int, port: int, fn: Callable, timeout_s: float, args: tuple, results, log_file: str | None
):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    console.configure(main=rank == 0)
    if log_file is not None:
        console.open_run_log(log_file)
    # A real group even for one rank: that is what torchrun --nproc-per-node 1 gives.
    dist.init_process_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(*args)
    except ClipdistError as error:  # the same on every rank (agreed through a collective): one line, not a traceback
        result = _UserError(error)
    finally:
        destroy_process_group()
    # By value: tensors passed through a queue live in this process's shared memory, gone once it exits.
    buffer = io.BytesIO()
    save_torch(result, buffer)
    results.put((rank, buffer.getvalue()))
    if isinstance(result, _UserError):  # exit 1 (its message is sent first): the launcher stops the other ranks at
        sys.exit(1)  # once, since one that did not fail alike (a rank out of memory) may wait in a collective


OMP_PAUSE_HARD = 2  # OpenMP 5's omp_pause_hard: the runtime frees its threads; the next parallel region starts anew


@functools.cache
def _openmp_runtime():
    """torch's own OpenMP runtime (libgomp, shipped in torch/lib), or None where there is none to find."""
    package = os.path.dirname(torch.__file__)  # torch/lib, or a wheel's torch.libs beside it
    folders = (os.path.join(package, "lib"), package + ".libs")
    found = [glob.glob(os.path.join(folder, "libgomp*.so*")) for folder in folders]
    for path in sorted(path for paths in found for path in paths):
        try:
            runtime = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(runtime, "omp_pause_resource_all"):
            return runtime
    return None


def release_openmp_threads() -> None:
    """Before a fork: let OpenMP's thread pool go (omp_pause_resource_all). A child forked from a process whose
    pool has run a parallel op (any op on more than ~32k elements, e.g. comparing two gradients) inherits a pool
    whose threads do not exist, and hangs in its first parallel op; once the pool is released the child starts
    its own, as this process does on its next parallel op."""
    runtime = _openmp_runtime()
    if runtime is not None:
        runtime.omp_pause_resource_all(OMP_PAUSE_HARD)


def _drained(done: bool, results, collected: dict[int, Any]) -> bool:
    """Whether the ranks are done; their results read as they come (a rank blocked on a full pipe never exits)."""
    try:
        while True:
            rank, result = results.get_nowait()
            collected[rank] = torch.load(io.BytesIO(result), weights_only=False)
    except queue_module.Empty:
        return done


def launch_local(
    fn: Callable[..., Result], world_size: int, *args, timeout_s: float = COLLECTIVE_TIMEOUT_S
) -> dict[int, Result]:
    """Run `fn(*args)` on `world_size` local gloo ranks (child processes, torch's env:// rendezvous).

    The ranks are forked from this process, which has imported torch and the towers' libraries already
    (about 8 s of imports a process here, that spawned ranks would each repeat), unless CUDA is initialised
    here — then they are spawned afresh, as CUDA does not survive a fork. Either way `fn` must be importable
    (module level) and no process group may exist here yet. OpenMP's threads are released before the fork
    (release_openmp_threads), and what the ranks inherit is frozen for their garbage collector: otherwise a rank
    forked after this process ran a parallel op, or made a process group, hangs.

    Returns {rank: return value}. A rank that fails
    makes the others stop (5 s grace, then SIGTERM, then SIGKILL) and its error is raised here;
    `timeout_s` bounds every collective. SIGTERM, SIGUSR1 and SIGINT sent to this process alone
    (`timeout`, `docker stop`) are passed to the ranks (SIGINT as SIGTERM, since a terminal's
    Ctrl-C reaches them directly too), which checkpoint and exit.
    """
    check_local_ranks(world_size, "this launch")
    method = "spawn" if torch.cuda.is_initialized() else "fork"
    share_temp_dir()  # the ranks' and their workers' sockets in one folder this process removes
    results = mp.get_context(method).Queue()
    if method == "fork":
        release_openmp_threads()
    sys.stdout.flush()  # a forked child would write what is still buffered here again
    sys.stderr.flush()
    # The ranks never collect what they inherit (frozen at the fork; this process unfreezes it at once and collects
    # it itself, where its threads exist): a destroyed process group still held in a cycle (an FSDP2 model's mesh)
    # collected in a rank ran a gloo destructor that joins threads the rank never had, a hang. (A gc.collect() here
    # took ~200 ms a launch.)
    gc.freeze()
    try:
        context = mp.start_processes(
            _spawned_worker,
            nprocs=world_size,
            join=False,
            start_method=method,
            args=(world_size, free_port(), fn, timeout_s, args, results, console.run_log()),
        )
    finally:
        gc.unfreeze()

    def forward(signum, _frame):
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM if signum == signal.SIGINT else signum)

    previous = (
        {signum: signal.signal(signum, forward) for signum in STOP_SIGNALS}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    try:
        return _collected(context, results, world_size)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _collected(context, results, world_size: int) -> dict[int, Any]:
    """Each rank's return value once every rank has exited; a rank that fails stops the others (torch's join), and a
    rank's own error (its _UserError) is raised before the failures it caused elsewhere."""
    collected: dict[int, Any] = {}
    try:
        while not _drained(context.join(timeout=0.2, grace_period=5), results, collected):
            pass
    except ProcessException:  # the first failure join saw may be a consequence (a peer's connection reset)
        _drained(True, results, collected)  # join has waited for every rank: what they sent is here
        said = next((result for result in collected.values() if isinstance(result, _UserError)), None)
        if said is not None:
            raise said.type(said.message) from None
        raise
    finally:  # a rank that raised left its traceback in a file torch names in the temporary folder and never removes
        for path in context.error_files:
            with suppress(OSError):
                os.unlink(path)
    while len(collected) < world_size:  # results put just before the last exit
        rank, result = results.get(timeout=30)
        collected[rank] = torch.load(io.BytesIO(result), weights_only=False)
    return collected


def check_launch(world, env: DistEnv) -> None:
    """The world preset against how this process was launched (world.check_world), and a CUDA device where it asks
    for one (check_cuda)."""
    check_world(world, env)
    check_cuda(world)


def check_cuda(world) -> None:
    """A CUDA device where world.device asks for one."""
    if str(world.device) == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"world.device=cuda (world={world.name}) but no CUDA device is visible; "
            "use world=local or world=cpu2, or world.device=cpu"
        )
