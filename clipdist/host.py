"""The host side of a rank: intra-op threads, loader-worker priority and the allocator, each decided from
the CPUs the rank may use (never from one workload's tuning) and logged with its reason by the trainer."""
from __future__ import annotations

import os
from typing import Mapping


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


MAX_CPU_RANK_WORKERS = 4


def loader_workers(setting: int | None, procs_per_node: int, shards_per_rank: int | None = None,
                   environ: Mapping[str, str] | None = None, device_type: str = "cpu") -> tuple[int, str]:
    """Loader workers per rank and why. An explicit `setting` wins; automatic (None): one per CPU the rank
    can spare beside itself, at least 1, and no more than the shards each rank reads (`shards_per_rank`,
    epoch mode), so that every worker has one.

    A GPU rank computes on the GPU: every CPU it can spare decodes (an H100 takes ~2,300 samples/s of
    ViT-B/32 at 224 px; a core decodes ~250). A CPU rank's spare CPUs also run its intra-op threads, so it
    takes at most MAX_CPU_RANK_WORKERS (1 where it has 2 CPUs: decoding overlaps the step even on a core
    shared with the rank, whose workers' priority is then measured: loader_priority)."""
    if setting is not None:
        return setting, "data.workers"
    cpus, source = rank_cpus(procs_per_node, environ)
    if device_type == "cpu":
        workers = min(max(1, cpus - 1), MAX_CPU_RANK_WORKERS)
        why = f"data.workers=auto: {source}, CPU ranks 1 to {MAX_CPU_RANK_WORKERS}"
    else:
        workers, why = max(1, cpus - 1), f"data.workers=auto: {source}, all but one for {device_type} ranks"
    if shards_per_rank is not None and shards_per_rank < workers:
        workers, why = max(1, shards_per_rank), why + f", {shards_per_rank} shard(s) per rank"
    return workers, why


def rank_cpus(procs_per_node: int, environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """The CPUs one rank may use and where the number came from: srun's SLURM_CPUS_PER_TASK, else
    the CPUs this process may run on shared by the node's ranks."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_CPUS_PER_TASK", "").isdigit() and int(env["SLURM_CPUS_PER_TASK"]) > 0:
        return int(env["SLURM_CPUS_PER_TASK"]), f"SLURM_CPUS_PER_TASK={env['SLURM_CPUS_PER_TASK']}"
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, available // procs_per_node), f"{available} CPUs / {procs_per_node} rank(s) per node"


def loader_priority(setting: str, device_type: str, procs_per_node: int, loader_workers: int,
                    environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """How the loader workers are scheduled and why: "low" (SCHED_IDLE from the start), "normal", or
    "measured" (normal until the run shows whether idle priority pays: MeasuredPriority).

    auto: measured for CPU ranks whose workers cannot each have a core beside the rank's (rank CPUs <
    1 + workers). There, sharing cores as equals, a worker preempts its rank mid-step and every other
    rank waits for it at the next collective; at idle priority the workers decode in the time the ranks
    wait anyway (collectives, an empty data queue) — measured on 2 cores, 2 ranks × 1 worker, a model-bound
    run: 715-777 -> 790-965 samples/s. But when the loader is what the rank waits for, or another process
    is busy on the node, idle workers starve (a loader-bound run beside another job: 0.77× open_clip_train's
    samples/s): so only a run whose loader measurably keeps up lowers them. GPU ranks keep normal priority: a
    rank spinning on a CUDA sync would starve its workers."""
    if setting == "normal" or loader_workers == 0:
        return "normal", f"data.worker_priority={setting}" if loader_workers else "no loader workers"
    if setting == "low":
        return "low", "data.worker_priority=low"
    if device_type != "cpu":
        return "normal", f"data.worker_priority=auto: {device_type} ranks"
    cpus, source = rank_cpus(procs_per_node, environ)
    if cpus >= 1 + loader_workers:
        return "normal", f"data.worker_priority=auto: {source}, enough for the rank and {loader_workers} worker(s)"
    return "measured", (f"data.worker_priority=auto: {source}, fewer than the rank + {loader_workers} worker(s); "
                        "idle priority once the run shows the loader keeps up")


def set_low_priority(pid: int, low: bool) -> bool:
    """Put every thread of process `pid` (0: this one) under SCHED_IDLE, or back under SCHED_OTHER (nice 19
    / 0 where there is no SCHED_IDLE). False where the OS refuses: going back needs CAP_SYS_NICE or
    RLIMIT_NICE >= 20 (sched(7): an unprivileged process cannot leave SCHED_IDLE)."""
    pid = pid or os.getpid()
    try:
        if not hasattr(os, "SCHED_IDLE"):
            os.setpriority(os.PRIO_PROCESS, pid, 19 if low else 0)
            return True
        policy = os.SCHED_IDLE if low else os.SCHED_OTHER
        threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")] if os.path.isdir(f"/proc/{pid}/task") else [pid]
        for tid in threads:
            try:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            except ProcessLookupError:  # a thread that has just ended
                pass
        return True
    except PermissionError:
        return False


class MeasuredPriority:
    """data.worker_priority=auto where CPU ranks share cores with their workers: decided from the run.

    The workers start at normal priority. After `skip` warm-up steps, over `window` steps: if the rank
    waited for data less than `idle_below` of its time (the loader keeps up, with room to spare), the
    workers go to idle priority. While they are there, each further window where the rank waits more
    than `normal_above` of its time (contention, slower data) brings them back to normal priority, for the
    rest of the run — where the OS lets this process do it (set_low_priority), else it says how to fix it.
    `observe` returns the decision's line for the log, once, when one is made."""

    def __init__(self, set_low, skip: int = 10, window: int = 20, idle_below: float = 0.02, normal_above: float = 0.1):
        self.set_low, self.skip, self.window = set_low, skip, window
        self.idle_below, self.normal_above = idle_below, normal_above
        self.state, self.steps, self.waited, self.total = "measuring", 0, 0.0, 0.0

    def observe(self, wait_s: float, step_s: float) -> str | None:
        """One step: `wait_s` spent waiting for its batch, `step_s` the whole step (the wait included)."""
        self.steps += 1
        if self.state == "settled" or self.steps <= self.skip:
            return None
        self.waited, self.total = self.waited + wait_s, self.total + step_s
        if (self.steps - self.skip) % self.window:
            return None
        share, first, last = self.waited / max(self.total, 1e-9), self.steps - self.window + 1, self.steps
        self.waited = self.total = 0.0
        measured = f"over steps {first}-{last} the rank waited {share:.1%} of its time for data"
        if self.state == "measuring":
            if share >= self.idle_below:
                self.state = "settled"
                return f"loader workers stay at normal priority: {measured} (the loader is what it waits for)"
            self.state = "low" if self.set_low(True) else "settled"
            return (f"loader workers to idle priority: {measured} (the loader keeps up); they now decode in the time "
                    "the rank leaves idle" if self.state == "low"
                    else "loader workers stay at normal priority: the OS refused idle priority")
        if share <= self.normal_above:
            return None
        self.state = "settled"
        if self.set_low(False):
            return f"loader workers back to normal priority: {measured} at idle priority"
        return (f"loader workers cannot return to normal priority ({measured}): this process may not raise a "
                "priority (RLIMIT_NICE < 20); set data.worker_priority=normal for runs on a shared node")


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
    m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt's parameter numbers (malloc.h)
    largest_heap_block, kept_before_trim = 1 << 30, (1 << 31) - 1
    return bool(mallopt(m_mmap_threshold, largest_heap_block)) and bool(mallopt(m_trim_threshold, kept_before_trim))
