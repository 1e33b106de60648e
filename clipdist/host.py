"""The host side of a rank: intra-op threads, loader-worker priority and the allocator, each decided from
the CPUs the rank may use (never from one workload's tuning) and logged with its reason by the trainer."""
from __future__ import annotations

import math
import os
import statistics
from typing import Mapping, NamedTuple


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


MAX_CPU_RANK_WORKERS = 4  # a CPU rank's loader workers at the start, until the run measures how many it needs


class LoaderPlan(NamedTuple):
    """A rank's loader: `readers` (the rank's shards are dealt to them: the stream's layout), `workers` (the
    processes that run them at the start), `choices` (worker counts the run may move to once it has measured
    the loader against the step: MeasuredWorkers; one choice: fixed) and why."""

    readers: int
    workers: int
    choices: tuple[int, ...]
    why: str


def loader_workers(setting: int | None, procs_per_node: int, shards_per_rank: int | None = None,
                   environ: Mapping[str, str] | None = None, device_type: str = "cpu") -> LoaderPlan:
    """The rank's loader plan. An explicit `setting` (data.workers) is taken as it is: that many readers and
    workers. Automatic (None): the readers are the CPUs the rank can spare beside itself (at least 1, at most
    the shards each rank reads in epoch mode, `shards_per_rank`), and

    - a GPU rank computes on the GPU: every spare CPU decodes (an H100 takes ~2,300 samples/s of ViT-B/32
      at 224 px; a core decodes ~250-300), one worker per reader;
    - a CPU rank's spare CPUs also run its intra-op threads: it starts with at most MAX_CPU_RANK_WORKERS
      workers and moves to the count the run's own measurements favour (MeasuredWorkers) — the readers are
      then the count with the most divisors, so that more worker counts are open to it."""
    if setting is not None:
        return LoaderPlan(max(setting, 1), setting, (setting,), "data.workers")
    cpus, source = rank_cpus(procs_per_node, environ)
    spare, why = max(1, cpus - 1), f"data.workers=auto: {source}"
    if shards_per_rank is not None and shards_per_rank < spare:
        spare, why = max(1, shards_per_rank), why + f", {shards_per_rank} shard(s) per rank"
    if device_type != "cpu":
        return LoaderPlan(spare, spare, (spare,), why + f", all but one for {device_type} ranks")
    readers = max(range(spare, 0, -1), key=lambda n: len(divisors(n)))  # the largest of the most divisible
    choices = divisors(readers)
    workers = max(n for n in choices if n <= MAX_CPU_RANK_WORKERS)
    return LoaderPlan(readers, workers, choices,
                      why + f", CPU ranks start with up to {MAX_CPU_RANK_WORKERS} and measure ({readers} readers)")


def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


class MeasuredWorkers:
    """data.workers=auto: how many loader workers a rank needs, from what the run measures.

    After `skip` warm-up steps, over `window` steps: L, the CPU time one worker spends on a batch (reading,
    decoding, augmenting: thread CPU time in the worker, so not inflated by sharing a core), and C, the
    step's own time (the step less its wait for data). W workers deliver W / L batches a second; the rank
    computes 1 / C with its T threads now, T(W) / (T · C) with the threads W workers leave it
    (`threads(W)`: the rank's CPUs less W, or fixed where world.threads / OMP_NUM_THREADS says). The count
    among `choices` whose slower side is fastest is taken, if it beats the current count by more than
    `gain` (else no restart for noise). With one choice (GPU ranks, an explicit data.workers) it only says
    whether the loader keeps up. `observe` returns (the new count or None, the line for the log) once."""

    def __init__(self, choices: tuple[int, ...], workers: int, threads, skip: int = 10, window: int = 20,
                 gain: float = 1.1):
        self.choices, self.workers, self.threads = choices, workers, threads
        self.skip, self.window, self.gain = skip, window, gain
        self.steps, self.loads, self.computes, self.waited, self.total = 0, [], [], 0.0, 0.0

    def observe(self, wait_s: float, step_s: float, load_s: float | None) -> tuple[int | None, str | None]:
        self.steps += 1
        if self.steps <= self.skip or self.steps > self.skip + self.window:
            return None, None
        self.waited, self.total = self.waited + wait_s, self.total + step_s
        self.computes.append(max(step_s - wait_s, 1e-9))
        if load_s is not None:
            self.loads.append(load_s)
        if self.steps < self.skip + self.window or not self.loads:
            return None, None
        load, compute = statistics.median(self.loads), statistics.median(self.computes)
        now = self.threads(self.workers)

        def rate(workers: int) -> float:  # batches a second: the slower of the loader and the step
            return min(workers / load, self.threads(workers) / (now * compute))

        best = max(self.choices, key=lambda workers: (rate(workers), -workers))
        measured = (f"over steps {self.skip + 1}-{self.steps} a batch took {load * 1e3:.0f} ms of a loader worker's "
                    f"CPU and the step {compute * 1e3:.0f} ms, and the rank waited {self.waited / self.total:.1%} "
                    "of its time for data")
        if best != self.workers and rate(best) > self.gain * rate(self.workers):
            moved = f"{self.workers} -> {best} loader worker(s)"
            if self.threads(best) != now:
                moved += f", {now} -> {self.threads(best)} intra-op thread(s)"
            return best, f"{moved}: {measured}"
        if len(self.choices) > 1:
            return None, f"{self.workers} loader worker(s) kept: {measured}"
        needed = math.ceil(load / compute)
        verdict = ("the loader keeps up" if needed <= self.workers else
                   f"the loader limits this run: it needs ~{needed} worker(s) to keep up, this rank has {self.workers}")
        return None, f"{verdict}: {measured}"


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
