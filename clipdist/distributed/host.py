"""The host side of a rank: its CPUs, intra-op threads, how waiting threads wait, and the allocator, each
decided from the CPUs the rank may use (never from one workload's tuning) and logged with its reason.
Loader workers are the stream's (clipdist.data.workers)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping


def intra_op_threads(
    setting: int | None, procs_per_node: int, loader_workers: int = 0, environ: Mapping[str, str] | None = None
) -> tuple[int, str]:
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


OPENMP_SPIN = "300"  # GOMP_SPINCOUNT: spins at a barrier before a thread sleeps (libgomp's default: 300,000)


def spin_briefly(environ: dict | None = None) -> str | None:
    """Before torch (libgomp) is loaded: intra-op threads that wait at a parallel region's barrier spin
    only briefly, then sleep. With libgomp's default a thread spins ~300,000 times, so on a node where
    any other process is busy (another job, an agent, a compile) every barrier waits for a descheduled
    thread while its partner burns the core it needs: the default `python train.py` beside one busy
    process ran 3x slower. Measured (2 cores, 200 steps, median samples/s, alone / beside one busy loop,
    two interleaved rounds): default 634, 745 / 244, 220; GOMP_SPINCOUNT=300: 678, 661 / 561, 420; 1000:
    673, 646 / 446, 467; 3000: 837, 636 / 348, 362; OMP_WAIT_POLICY=PASSIVE (other rounds, beside default
    787, 672 / 252, 227): 633, 556 / 503, 561. Nothing is changed where OMP_WAIT_POLICY or GOMP_SPINCOUNT
    is set; returns what was set."""
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return None
    env["GOMP_SPINCOUNT"] = OPENMP_SPIN
    return f"GOMP_SPINCOUNT={OPENMP_SPIN}"


def openmp_wait(environ: Mapping[str, str] | None = None) -> str:
    """How waiting intra-op threads wait, for the log."""
    env = os.environ if environ is None else environ
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        if name in env:
            return f"{name}={env[name]}"
    return "libgomp's default spinning"


def rank_cpus(procs_per_node: int, environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """The CPUs one rank may use and where the number came from: srun's SLURM_CPUS_PER_TASK, else
    the CPUs this process may run on shared by the node's ranks."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_CPUS_PER_TASK", "").isdigit() and int(env["SLURM_CPUS_PER_TASK"]) > 0:
        return int(env["SLURM_CPUS_PER_TASK"]), f"SLURM_CPUS_PER_TASK={env['SLURM_CPUS_PER_TASK']}"
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, available // procs_per_node), f"{available} CPUs / {procs_per_node} rank(s) per node"


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep what the CPU step frees, for the next step (what a caching allocator does).

    By default every allocation above a dynamic threshold is its own mmap, and freed memory at the
    top of the heap goes back to the kernel: each step's large activations and gradients then come
    back as fresh pages, faulted in one by one (the 8.5 MB MLP activations of a patch-4 ViT took
    21 ms to copy). With these thresholds: 852-861 -> 899-941 samples/s at 2 ranks on 2 cores.
    False where the C library is not glibc (nothing changed)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # this process's own symbols: glibc's, where it is glibc
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt's parameter numbers (malloc.h)
    largest_heap_block, kept_before_trim = 1 << 30, (1 << 31) - 1
    return bool(mallopt(m_mmap_threshold, largest_heap_block)) and bool(mallopt(m_trim_threshold, kept_before_trim))
