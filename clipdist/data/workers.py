"""How many loader workers a rank runs and at which CPU priority: decided from the CPUs the rank may use,
then from what the run measures (CPU ranks), by the stream that owns the workers (TrainStream.tune).

    loader_workers(...)    the plan at the start: readers (the stream's layout), workers, the counts it may move to
    loader_priority(...)   normal, low (SCHED_IDLE) or measured
    LoaderTuning           the stream's per-step observer: MeasuredWorkers, then MeasuredPriority
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

from clipdist.distributed import host

MAX_CPU_RANK_WORKERS = 4  # a CPU rank's loader workers at the start, until the run measures how many it needs


class LoaderPlan(NamedTuple):
    """A rank's loader: `readers` (the rank's shards are dealt to them: the stream's layout), `workers` (the
    processes that run them at the start), `choices` (worker counts the run may move to once it has measured
    the loader against the step: MeasuredWorkers; one choice: fixed), why, and `cpus` (the CPUs the rank may
    use, where the plan came from them)."""

    readers: int
    workers: int
    choices: tuple[int, ...]
    why: str
    cpus: int | None = None


def loader_workers(
    setting: int | None,
    procs_per_node: int,
    shards_per_rank: int | None = None,
    environ: Mapping[str, str] | None = None,
    device_type: str = "cpu",
) -> LoaderPlan:
    """The rank's loader plan. An explicit `setting` (data.workers) is taken as it is: that many readers and
    workers. Automatic (None), from the CPUs the rank can spare beside itself (at least 1; in epoch mode no
    more readers than the shards each rank reads, `shards_per_rank`):

    - a GPU rank computes on the GPU: every spare CPU decodes (an H100 takes ~2,300 samples/s of ViT-B/32
      at 224 px; a core decodes ~250-300), one reader and one worker each;
    - a CPU rank's spare CPUs also run its intra-op threads: it starts with at most MAX_CPU_RANK_WORKERS
      workers, no more than its spare CPUs, and moves to the count the run's own measurements favour
      (MeasuredWorkers). The readers are the count with the most divisors up to the rank's CPUs, so that more
      worker counts are open to it — one worker per CPU among them, beyond the spare ones, for a run whose
      loader is what the rank waits for and whose cores have time left (two workers beside one rank on two
      cores: 224-px web photos 383-426 -> 452-463 samples/s). A rank of one CPU has no such time to give."""
    if setting is not None:
        return LoaderPlan(max(setting, 1), setting, (setting,), "data.workers")
    cpus, source = host.rank_cpus(procs_per_node, environ)
    spare, why = spare_cpus(cpus), f"data.workers=auto: {source}"
    most = cpus if device_type == "cpu" else spare
    if shards_per_rank is not None and shards_per_rank < most:
        most, why = max(1, shards_per_rank), why + f", {shards_per_rank} shard(s) per rank"
    if device_type != "cpu":
        return LoaderPlan(most, most, (most,), why + f", all but one for {device_type} ranks", cpus)
    readers = max(range(most, 0, -1), key=lambda n: len(divisors(n)))  # the largest of the most divisible
    choices = divisors(readers)
    workers = max(n for n in choices if n <= min(spare, MAX_CPU_RANK_WORKERS))
    return LoaderPlan(
        readers,
        workers,
        choices,
        why + f", CPU ranks start with up to {MAX_CPU_RANK_WORKERS}, "
        f"no more than their spare CPUs, and measure ({readers} readers)",
        cpus,
    )


def spare_cpus(cpus: int) -> int:
    """The CPUs a rank of `cpus` can spare beside itself for loader workers (at least one)."""
    return max(1, cpus - 1)


def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


class MeasuredWorkers:
    """data.workers=auto: how many loader workers a rank needs, from what the run measures.

    After `skip` warm-up steps, over `window` steps: L, the CPU time one worker spends on a batch (reading,
    decoding, augmenting: thread CPU time in the worker, so not inflated by sharing a core), C, the step's
    own time (the step less its wait for data), and S, the CPU time the rank's process spent a step
    (`clock`: all its threads). W workers deliver W / L batches a second; the rank computes 1 / C with
    its T threads now, T(W) / (T · C) with the threads W workers leave it (`threads(W)`: the rank's CPUs
    less W, or fixed where world.threads / OMP_NUM_THREADS says); and the rank's `cpus` cores, however the
    workers and threads share them, do at most cpus / (L + S) batches a second. The count among `choices`
    whose slowest side is fastest is taken, if it beats the current count by more than `gain` (else no
    restart for noise); a count beyond the spare CPUs only where `whole(count)` says its workers make
    whole batches (assembling every batch from workers that share the rank's cores costs more than the model
    sees: 2 workers that way ran 1 rank of 224-px web photos at 383 samples/s against one worker's 400-426).
    With one choice (GPU ranks, an explicit data.workers) it only says whether the loader keeps up.
    `observe` returns (the new count or None, the line for the log) once."""

    def __init__(
        self,
        choices: tuple[int, ...],
        workers: int,
        threads,
        skip: int = 10,
        window: int = 20,
        gain: float = 1.1,
        *,
        cpus: int | None = None,
        clock: Callable[[], float] = time.process_time,
        whole: Callable[[int], bool] = lambda workers: True,
    ):
        self.choices, self.workers, self.threads, self.whole = choices, workers, threads, whole
        self.skip, self.window, self.gain, self.cpus, self.clock = skip, window, gain, cpus, clock
        self.steps, self.loads, self.computes, self.spent, self.waited, self.total = 0, [], [], [], 0.0, 0.0
        self.last_cpu = clock()  # the baseline again at the last warm-up step

    def observe(self, wait_s: float, step_s: float, load_s: float | None) -> tuple[int | None, str | None]:
        self.steps += 1
        if self.steps < self.skip or self.steps > self.skip + self.window:
            return None, None
        cpu, self.last_cpu = self.last_cpu, self.clock()  # the rank's CPU from the last warm-up step on
        if self.steps == self.skip:
            return None, None
        self.waited, self.total = self.waited + wait_s, self.total + step_s
        self.computes.append(max(step_s - wait_s, 1e-9))
        self.spent.append(self.last_cpu - cpu)
        if load_s is not None:
            self.loads.append(load_s)
        if self.steps < self.skip + self.window or not self.loads:
            return None, None
        load, compute, spent = (statistics.median(values) for values in (self.loads, self.computes, self.spent))
        cores = self.cpus / (load + spent) if self.cpus else math.inf
        now = self.threads(self.workers)

        def rate(workers: int) -> float:  # batches a second: the slowest of the loader, the step and the cores
            return min(workers / load, self.threads(workers) / (now * compute), cores)

        def fastest(options) -> int:  # the fewest workers among the fastest
            return max(options, key=lambda workers: (rate(workers), -workers))

        spare = spare_cpus(self.cpus) if self.cpus else math.inf
        choices = [workers for workers in self.choices if workers <= max(spare, self.workers) or self.whole(workers)]
        best = fastest(choices)
        measured = (
            f"over steps {self.skip + 1}-{self.steps} a batch took {load * 1e3:.0f} ms of a loader worker's "
            f"CPU and the step {compute * 1e3:.0f} ms ({spent * 1e3:.0f} ms of the rank's CPU), and the rank "
            f"waited {self.waited / self.total:.1%} of its time for data"
        )
        if best != self.workers and rate(best) > self.gain * rate(self.workers):
            moved = f"{self.workers} -> {best} loader worker(s)"
            if self.threads(best) != now:
                moved += f", {now} -> {self.threads(best)} intra-op thread(s)"
            return best, f"{moved}: {measured}"
        if len(self.choices) > 1:
            faster = fastest(self.choices)
            closed = (
                f"; {faster} would measure faster but, sharing the rank's cores, would not each make whole batches"
                if faster not in choices and rate(faster) > self.gain * rate(self.workers)
                else ""
            )
            return None, f"{self.workers} loader worker(s) kept: {measured}{closed}"
        needed = math.ceil(load / compute)
        verdict = (
            "the loader keeps up"
            if needed <= self.workers
            else f"the loader limits this run: it needs ~{needed} worker(s) to keep up, this rank has {self.workers}"
        )
        return None, f"{verdict}: {measured}"


def loader_priority(
    setting: str, device_type: str, procs_per_node: int, loader_workers: int, environ: Mapping[str, str] | None = None
) -> tuple[str, str]:
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
    cpus, source = host.rank_cpus(procs_per_node, environ)
    if cpus >= 1 + loader_workers:
        return "normal", f"data.worker_priority=auto: {source}, enough for the rank and {loader_workers} worker(s)"
    return "measured", (
        f"data.worker_priority=auto: {source}, fewer than the rank + {loader_workers} worker(s); "
        "idle priority once the run shows the loader keeps up"
    )


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
    `observe` returns the decision's line for the log, once, when one is made; its steps are numbered from
    the run's step `after` (the workers' restart)."""

    def __init__(
        self,
        set_low,
        skip: int = 10,
        window: int = 20,
        idle_below: float = 0.02,
        normal_above: float = 0.1,
        *,
        after: int = 0,
    ):
        self.set_low, self.skip, self.window, self.after = set_low, skip, window, after
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
        share, last = self.waited / max(self.total, 1e-9), self.after + self.steps
        first = last - self.window + 1
        self.waited = self.total = 0.0
        measured = f"over steps {first}-{last} the rank waited {share:.1%} of its time for data"
        if self.state == "measuring":
            if share >= self.idle_below:
                self.state = "settled"
                return f"loader workers stay at normal priority: {measured} (the loader is what it waits for)"
            self.state = "low" if self.set_low(True) else "settled"
            return (
                f"loader workers to idle priority: {measured} (the loader keeps up); they now decode in the time "
                "the rank leaves idle"
                if self.state == "low"
                else "loader workers stay at normal priority: the OS refused idle priority"
            )
        if share <= self.normal_above:
            return None
        self.state = "settled"
        if self.set_low(False):
            return f"loader workers back to normal priority: {measured} at idle priority"
        return (
            f"loader workers cannot return to normal priority ({measured}): this process may not raise a "
            "priority (RLIMIT_NICE < 20); set data.worker_priority=normal for runs on a shared node"
        )


class LoaderTuning:
    """data.workers=null / data.worker_priority=auto decided from the run, for the stream that owns the workers.

    `priority_for(workers)` gives (normal | low | measured, why) for a worker count (loader_priority with the
    run's settings) and `threads(workers)` the rank's intra-op threads beside them. After each step,
    `observe(wait for data, whole step, the batch's worker CPU time)` moves to the worker count the run's
    measurements favour (MeasuredWorkers: the stream restarts its workers where the consumed batches left it,
    sample for sample the same), then decides the workers' priority (MeasuredPriority); it returns the
    lines worth logging."""

    def __init__(
        self, stream, plan: LoaderPlan, priority_for: Callable[[int], tuple[str, str]], threads: Callable[[int], int]
    ):
        self.stream, self.priority_for, self.threads = stream, priority_for, threads
        self.count = (
            MeasuredWorkers(
                plan.choices,
                plan.workers,
                threads,
                cpus=plan.cpus,
                whole=lambda workers: stream.worker_readers(workers) is not None,
            )
            if plan.workers
            else None
        )
        self.priority: MeasuredPriority | None = None
        self.started = self.schedule(plan.workers)  # the start's line, for the log

    def schedule(self, workers: int) -> str | None:
        """The workers' priority from their (re)start; the line saying which and why."""
        priority, why = self.priority_for(workers)
        self.stream.low_priority_workers = priority == "low"
        after = self.count.steps if self.count is not None else 0  # the run's steps before this (re)start
        self.priority = (
            MeasuredPriority(self.stream.set_worker_priority, after=after) if priority == "measured" else None
        )
        return f"loader workers at {'idle' if priority == 'low' else 'normal'} priority ({why})" if workers else None

    def observe(self, waited: float, seconds: float, load_s: float | None) -> list[str]:
        lines = []
        if self.count is not None:
            workers, line = self.count.observe(waited, seconds, load_s)
            lines += [line] if line else []
            if workers is not None:
                import torch

                torch.set_num_threads(self.threads(workers))
                self.stream.set_workers(workers)
                return lines + [line for line in [self.schedule(workers)] if line]
        if self.priority is not None and (decision := self.priority.observe(waited, seconds)):
            lines.append(decision)
        return lines
