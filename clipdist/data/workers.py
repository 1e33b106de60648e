"""How many loader workers a rank runs, and at which CPU priority: decided once, before any rank starts, from the
CPUs the rank may use (preflight hands the plan to the ranks).

    loader_workers(...)    the plan: readers (the stream's layout) and the worker processes that run them
    loader_priority(...)   normal or low (SCHED_IDLE)

Measured on this project's 2-core CPU machine (scripts/bench_variants.py, interleaved, 1 rank; docs/data.md has the
commands): two workers beside a one-thread rank made 1.09-1.16x one worker's samples/s on the digits and 1.07-1.18x
on 224-px web photos, and 0.96-0.99x the run-time tuner this replaced there (which moved to two workers); on the
digits that tuner made 0.83-0.92x one fixed worker (the extra readers it kept for a move cost more than it gained).
So a CPU rank gets as many workers as it has CPUs (at most MAX_CPU_RANK_WORKERS), decoding in the time the rank's
intra-op threads leave, at normal priority.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

from clipdist.distributed import host

MAX_CPU_RANK_WORKERS = 4  # a CPU rank's loader workers at most, where data.workers is automatic
WORKER_MEMORY_FLOOR = 16 << 20  # a loader worker's own memory at the least (20 MiB USS measured, the default run)


class LoaderPlan(NamedTuple):
    """A rank's loader: `readers` (a reader a worker), `workers` (the processes that run them; 0: the rank reads in
    its own process), why, and the run's `layout` (V readers, a cycle of Λ samples: data/order.py), which preflight
    adds; a rank reads its share of those readers on its workers."""

    readers: int
    workers: int
    why: str
    layout: tuple[int, int] | None = None


def loader_workers(
    setting: int | None,
    procs_per_node: int,
    readers_per_rank: int | None = None,
    environ: Mapping[str, str] | None = None,
    device_type: str = "cpu",
) -> LoaderPlan:
    """The rank's loader plan. An explicit `setting` (data.workers) is taken as it is: that many readers and
    workers. Automatic (None), at least 1 and no more than the readers of the run's layout a rank reads
    (`readers_per_rank`):

    - a GPU rank computes on the GPU: every CPU it can spare beside itself decodes (an H100 takes ~2,300 samples/s
      of ViT-B/32 at 224 px; a core decodes ~250-300);
    - a CPU rank: one worker per CPU of the rank, at most MAX_CPU_RANK_WORKERS (the measurements above)."""
    if setting is not None:
        return LoaderPlan(max(setting, 1), setting, "data.workers")
    cpus, source = host.rank_cpus(procs_per_node, environ)
    why = f"data.workers=auto: {source}"
    most = spare_cpus(cpus) if device_type != "cpu" else min(cpus, MAX_CPU_RANK_WORKERS)
    if readers_per_rank is not None and readers_per_rank < most:
        most, why = max(1, readers_per_rank), why + f", {readers_per_rank} reader(s) per rank"
    if device_type != "cpu":
        return LoaderPlan(most, most, why + f", all but one for {device_type} ranks")
    return LoaderPlan(most, most, why + f", one per CPU of a CPU rank (at most {MAX_CPU_RANK_WORKERS})")


def spare_cpus(cpus: int) -> int:
    """The CPUs a rank of `cpus` can spare beside itself for loader workers (at least one)."""
    return max(1, cpus - 1)


def loader_priority(setting: str, loader_workers: int) -> tuple[str, str]:
    """How the loader workers are scheduled and why: "low" (SCHED_IDLE: they run in the time the ranks wait —
    collectives, an empty data queue; starved where the loader is what the rank waits for, or another process is
    busy on the node) or "normal" (the default)."""
    if loader_workers == 0:
        return "normal", "no loader workers"
    return str(setting), f"data.worker_priority={setting}"


def set_low_priority(pid: int) -> None:
    """Put every thread of process `pid` (0: this one) under SCHED_IDLE (nice 19 where there is none); a process
    may always lower its own priority."""
    pid = pid or os.getpid()
    if not hasattr(os, "SCHED_IDLE"):
        os.setpriority(os.PRIO_PROCESS, pid, 19)
        return
    threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")] if os.path.isdir(f"/proc/{pid}/task") else [pid]
    for tid in threads:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:  # a thread that has just ended
            pass
