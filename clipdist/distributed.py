"""Process-group set-up (torchrun, SLURM, local spawn) and the few collectives the loop uses.

The loss backends' collectives live in clipdist.losses.collectives; this module only
decides who is who and starts the group.
"""
from __future__ import annotations

import os
import re
import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """Rank, world size and local rank as the launcher set them."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "torchrun" | "slurm" | "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _expand_first_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    match = re.match(r"([^\[,]+)(?:\[([^\]]+)\])?", nodelist)
    if not match:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read rank/world from torchrun's variables, else from srun's, else one process.

    Under srun (one task per device, no torchrun) MASTER_ADDR defaults to the first node
    of the job and MASTER_PORT to a port derived from the job id, written back into
    `os.environ` so that `init_process_group("env://")` finds them.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun")
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        if environ is None:
            os.environ.setdefault("MASTER_ADDR", _expand_first_host(env.get("SLURM_JOB_NODELIST", "localhost")))
            os.environ.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
        return DistEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)), "slurm")
    return DistEnv(0, 1, 0, "single")


def init_process_group(env: DistEnv, backend: str | None = None, timeout_s: float = 600,
                       rendezvous_timeout_s: float = 300) -> None:
    """Start the default process group for `env` (nothing for a single process).

    `timeout_s` bounds every collective: a rank that dies makes the others fail after
    `timeout_s` instead of hanging forever. Under srun (no launcher of torch's), the ranks meet
    at rank 0's TCP store, bounded by `rendezvous_timeout_s`: a task that never starts fails
    the others then, not after the collective timeout.
    """
    if env.world_size == 1 or dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = timedelta(seconds=timeout_s)
    if env.launcher == "slurm":
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                              is_master=env.rank == 0, timeout=timedelta(seconds=rendezvous_timeout_s),
                              wait_for_workers=True)
        dist.init_process_group(backend=backend, store=store, rank=env.rank, world_size=env.world_size,
                                timeout=timeout)
        return
    dist.init_process_group(backend=backend, timeout=timeout)


def intra_op_threads(setting: int | None, procs_per_node: int, environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """Threads per rank and where the number came from, so N ranks on a node never oversubscribe it.

    An explicit `setting` wins; then OMP_NUM_THREADS (torchrun sets 1 for several ranks); then
    srun's SLURM_CPUS_PER_TASK; else the CPUs this process may run on, shared by the node's ranks.
    """
    env = os.environ if environ is None else environ
    if setting is not None:
        return setting, "world.threads"
    for variable in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK"):
        if env.get(variable, "").isdigit() and int(env[variable]) > 0:
            return int(env[variable]), variable
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // procs_per_node), f"{cpus} CPUs / {procs_per_node} ranks per node"


def wrap_model(model: torch.nn.Module, *, compile: bool = False) -> torch.nn.Module:
    """What the training step calls: the towers compiled in place (torch.compile), then DDP outermost
    when there is more than one rank — so DDP's `no_sync` stays reachable for gradient caching."""
    if compile:
        model.compile()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    device = next(model.parameters()).device
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over ranks (a copy; the input is left alone)."""
    out = tensor.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out)
        out /= dist.get_world_size()
    return out


def all_ranks(obj) -> list:
    """Every rank's `obj` (picklable), in rank order."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawned_worker(fn: Callable, timeout_s: float, args: tuple):
    # A real group even for one rank: that is what torchrun --nproc-per-node 1 gives.
    dist.init_process_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    try:
        return fn(*args)
    finally:
        destroy_process_group()


def launch_local(fn: Callable, world_size: int, *args, timeout_s: float = 120) -> dict[int, object]:
    """Run `fn(*args)` on `world_size` local gloo ranks with torch's elastic launcher.

    Returns {rank: return value}. `fn` must be importable (module level). A failing rank
    tears the others down and raises; `timeout_s` bounds every collective.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"clipdist-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    return elastic_launch(config, _spawned_worker)(fn, timeout_s, args)
