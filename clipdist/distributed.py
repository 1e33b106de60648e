"""Process-group set-up (torchrun, SLURM, local spawn) and the few collectives the loop uses.

The loss backends' collectives live in clipdist.losses.collectives; this module only
decides who is who and starts the group.
"""
from __future__ import annotations

import io
import logging
import os
import re
import signal
import socket
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping

import torch
import torch.distributed as dist


# Signals that ask a run to checkpoint and stop (preemption, SLURM's --signal, Ctrl-C): the trainer
# handles them, loader workers ignore them, the local launcher passes them on.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


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
                       rendezvous_timeout_s: float = 300, single: bool = False) -> None:
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
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                              is_master=env.rank == 0, timeout=timedelta(seconds=rendezvous_timeout_s),
                              wait_for_workers=True)
        dist.init_process_group(backend=backend, store=store, rank=env.rank, world_size=env.world_size,
                                timeout=timeout)
        return
    dist.init_process_group(backend=backend, timeout=timeout)


def intra_op_threads(setting: int | None, procs_per_node: int, loader_workers: int = 0,
                     environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """Threads per rank and where the number came from, so a node's ranks and their loader workers
    never oversubscribe it.

    An explicit `setting` wins; then OMP_NUM_THREADS (torchrun sets 1 for several ranks). Else the
    rank's CPUs — srun's SLURM_CPUS_PER_TASK, or the CPUs this process may run on shared by the
    node's ranks — less one per loader worker, which decodes on a core of its own: intra-op
    threads that share a core with a busy worker wait for each other at every parallel op
    (measured on 2 cores, 1 worker: 2 threads 595 samples/s, 1 thread 1020).
    """
    env = os.environ if environ is None else environ
    if setting is not None:
        return setting, "world.threads"
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    cpus, source = rank_cpus(procs_per_node, env)
    if loader_workers:
        source += f" - {loader_workers} loader worker(s)"
    return max(1, cpus - loader_workers), source


def rank_cpus(procs_per_node: int, environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """The CPUs one rank may use and where the number came from: srun's SLURM_CPUS_PER_TASK, else
    the CPUs this process may run on shared by the node's ranks."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_CPUS_PER_TASK", "").isdigit() and int(env["SLURM_CPUS_PER_TASK"]) > 0:
        return int(env["SLURM_CPUS_PER_TASK"]), f"SLURM_CPUS_PER_TASK={env['SLURM_CPUS_PER_TASK']}"
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, available // procs_per_node), f"{available} CPUs / {procs_per_node} rank(s) per node"


def low_priority_workers(setting: str, device_type: str, procs_per_node: int, loader_workers: int,
                         environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Whether the loader workers run at idle priority (SCHED_IDLE), and why.

    auto: yes for CPU ranks whose workers cannot each have a core beside the rank's (rank CPUs <
    1 + workers). Sharing cores as equals, a worker preempts its rank mid-step and every other rank
    waits for it at the next collective; at idle priority the workers decode in the time the ranks
    wait anyway (collectives, an empty data queue — where a rank that outruns its loader blocks and
    yields the core). Measured on 2 cores, 2 ranks × 1 worker: 715-777 -> 790-965 samples/s. GPU ranks
    keep normal priority: a rank spinning on a CUDA sync would starve its workers."""
    if setting == "normal" or loader_workers == 0:
        return False, f"data.worker_priority={setting}" if loader_workers else "no loader workers"
    if setting == "low":
        return True, "data.worker_priority=low"
    if device_type != "cpu":
        return False, f"data.worker_priority=auto: {device_type} ranks"
    cpus, source = rank_cpus(procs_per_node, environ)
    if cpus >= 1 + loader_workers:
        return False, f"data.worker_priority=auto: {source}, enough for the rank and {loader_workers} worker(s)"
    return True, f"data.worker_priority=auto: {source}, fewer than the rank + {loader_workers} worker(s)"


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep what the CPU step frees, for the next step (what a caching allocator does).

    By default every allocation above a dynamic threshold is its own mmap, and freed memory at the
    top of the heap goes back to the kernel: each step's large activations and gradients then come
    back as fresh pages, faulted in one by one (the 8.5 MB MLP activations of a patch-4 ViT took
    21 ms to copy). With these thresholds: 852-861 -> 899-941 samples/s at 2 ranks on 2 cores.
    False where the C library is not glibc (nothing changed)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, (1 << 31) - 1))


def wrap_model(model: torch.nn.Module, *, parallel: str = "ddp", compile: bool = False,
               param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """What the training step calls.

    ddp: the towers compiled in place (torch.compile), then DDP outermost when there is more than
    one rank — so DDP's `no_sync` stays reachable for gradient caching.
    fsdp: FSDP2 (`fully_shard`) on every transformer block of both towers (each compiled first),
    then on the root, which takes the rest (embeddings, projections, logit scale and bias); the
    model is changed in place and returned. `param_dtype` (bf16 on CUDA) is the compute dtype of
    the gathered parameters; gradients are reduced in fp32. Gradients are averaged over ranks, as
    DDP's are, so every loss backend's exactness argument holds unchanged.
    """
    if parallel == "fsdp":
        return _fully_shard(model, compile=compile, param_dtype=param_dtype)
    if compile:
        model.compile()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    device = next(model.parameters()).device
    from torch.nn.parallel import DistributedDataParallel

    # Buffers are broadcast from rank 0 before every forward (a collective and a sync per step) only when
    # training changes them (BatchNorm statistics); CLIP towers' buffers (attention masks) are constants.
    # Gradients live in DDP's buckets (no copy of every gradient into them and back after the all-reduce).
    running_stats = any(isinstance(module, torch.nn.modules.batchnorm._NormBase) and module.track_running_stats
                        for module in model.modules())
    # Vocabulary tables are left out of DDP's all-reduce: finish_gradient_sync sums only their used rows.
    # DDP's start-up broadcast from rank 0 skips them too: done here.
    tables = row_sparse_parameters(model)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(tables))
    for table in tables.values():
        dist.broadcast(table.data, src=0)
    wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                      forward_sync_buffers=running_stats, gradient_as_bucket_view=True)
    wrapped.row_sparse_parameters = list(tables.values())
    return wrapped


ROW_SPARSE_MIN_ROWS = 1024


def row_sparse_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """{name: weight} of the nn.Embedding tables with at least ROW_SPARSE_MIN_ROWS rows (token
    vocabularies: 49,408 rows in open_clip's text towers), whose gradient is zero outside the rows
    the step's tokens looked up."""
    return {f"{name}.weight" if name else "weight": module.weight for name, module in model.named_modules()
            if isinstance(module, torch.nn.Embedding) and module.weight.requires_grad
            and module.num_embeddings >= ROW_SPARSE_MIN_ROWS}


BLOCK_LISTS = ("resblocks", "blocks", "layers")  # open_clip transformers, timm ViTs, HF-style text towers


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of every tower (open_clip `resblocks`, timm `blocks`): FSDP's units, outermost
    only (a block list inside a block belongs to that block's unit)."""
    lists = [name for name, module in model.named_modules()
             if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and name.rsplit(".", 1)[-1] in BLOCK_LISTS]
    outer = [name for name in lists if not any(name.startswith(other + ".") for other in lists)]
    return [block for name in outer for block in model.get_submodule(name) if any(True for _ in block.parameters())]


def _fully_shard(model: torch.nn.Module, *, compile: bool, param_dtype: torch.dtype | None) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    if not dist.is_initialized():
        raise RuntimeError("world.parallel=fsdp needs a process group (torchrun, srun or world.spawn)")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in transformer_blocks(model):  # preflight (trainer.check_shardable) made sure there are some
        if compile:
            block.compile()
        fully_shard(block, mp_policy=policy)
    # fully_shard cannot shard 0-dim parameters (the logit scale and bias): they stay whole on every rank,
    # outside FSDP, and their gradients are averaged by finish_gradient_sync after backward.
    scalars = [param for param in model.parameters() if param.ndim == 0]
    # The root's parameters are needed again at once by backward: keep them gathered after forward.
    fully_shard(model, mp_policy=policy, reshard_after_forward=False, ignored_params=set(scalars))
    model.replicated_parameters = scalars
    for method in ("encode_image", "encode_text"):  # evaluation calls these, not forward
        if hasattr(model, method):
            register_fsdp_forward_method(model, method)
    return model


def finish_gradient_sync(model: torch.nn.Module) -> None:
    """Average over ranks the gradients that the wrapper leaves to us, as it averages all others.
    Called once after the step's last backward.

    FSDP: the parameters it keeps whole (0-dim scalars: logit scale and bias).
    DDP: the vocabulary tables (row_sparse_parameters). Only the rows some rank's tokens used can be
    non-zero, so the mean of the union of those rows over ranks is the whole table's mean, exactly:
    every other row is zero on every rank. A (vocabulary,) byte mask is all-reduced (max) for the
    union, then only its rows (a batch of 128 captions of 16 tokens uses < 1,000 of 49,408 rows), or
    the whole table where the union is more than half of it (tied weights, huge batches)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    grads = [param.grad for param in getattr(model, "replicated_parameters", ()) if param.grad is not None]
    if grads:
        for grad, mean in zip(grads, all_reduce_mean(torch.stack(grads))):
            grad.copy_(mean)
    for param in getattr(model, "row_sparse_parameters", ()):
        if param.grad is not None:
            _average_used_rows(param.grad)


def _average_used_rows(grad: torch.Tensor) -> None:
    # A row is used where any entry is non-zero (NaN included); abs().amax is ~8x faster than ne().any here.
    used = grad.abs().amax(dim=1).ne(0).to(torch.uint8)
    dist.all_reduce(used, op=dist.ReduceOp.MAX)
    rows = used.nonzero().squeeze(1)
    if 2 * rows.numel() > grad.shape[0]:
        grad.copy_(all_reduce_mean(grad))
    else:
        grad.index_copy_(0, rows, all_reduce_mean(grad.index_select(0, rows)))


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: every rank calls it); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool):
    """Backward passes inside accumulate gradients locally when not `enabled` (DDP's no_sync, FSDP's
    set_requires_gradient_sync); the next backward with sync reduces everything accumulated."""
    from torch.nn.parallel import DistributedDataParallel

    if enabled:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif is_sharded(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


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


class _UserError:
    """A ClipdistError raised in a spawned rank, carried back to the launching process to be raised there."""

    def __init__(self, error: Exception):
        self.type, self.message = type(error), str(error)


def _spawned_worker(rank: int, world_size: int, port: int, fn: Callable, timeout_s: float, args: tuple, results):
    from clipdist.errors import ClipdistError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    logging.getLogger("clipdist").setLevel(logging.INFO)
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
    torch.save(result, buffer)
    results.put((rank, buffer.getvalue()))


def launch_local(fn: Callable, world_size: int, *args, timeout_s: float = 120) -> dict[int, object]:
    """Run `fn(*args)` on `world_size` local gloo ranks (spawned processes, torch's env:// rendezvous).

    Returns {rank: return value}. `fn` must be importable (module level). A rank that fails
    makes the others stop (5 s grace, then SIGTERM, then SIGKILL) and its error is raised here;
    `timeout_s` bounds every collective. SIGTERM, SIGUSR1 and SIGINT sent to this process alone
    (`timeout`, `docker stop`) are passed to the ranks (SIGINT as SIGTERM, since a terminal's
    Ctrl-C reaches them directly too), which checkpoint and exit.
    """
    import queue as queue_module

    import torch.multiprocessing as mp

    results = mp.get_context("spawn").Queue()
    context = mp.start_processes(_spawned_worker, args=(world_size, _free_port(), fn, timeout_s, args, results),
                                 nprocs=world_size, join=False, start_method="spawn")

    def forward(signum, _frame):
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM if signum == signal.SIGINT else signum)

    previous = {signum: signal.signal(signum, forward) for signum in STOP_SIGNALS} \
        if threading.current_thread() is threading.main_thread() else {}
    collected: dict[int, object] = {}
    try:
        while True:
            done = context.join(timeout=0.2, grace_period=5)
            try:  # drain as we go: a rank blocked on a full pipe would never exit
                while True:
                    rank, result = results.get_nowait()
                    collected[rank] = torch.load(io.BytesIO(result), weights_only=False)
            except queue_module.Empty:
                pass
            if done:
                break
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    while len(collected) < world_size:  # results put just before the last exit
        rank, result = results.get(timeout=30)
        collected[rank] = torch.load(io.BytesIO(result), weights_only=False)
    for result in collected.values():
        if isinstance(result, _UserError):
            raise result.type(result.message)
    return collected
