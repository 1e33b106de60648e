"""FSDP2's host cost a step against DDP's at world 1 (a process group of one; `--world N`: N gloo ranks, one thread
each, rank 0's times): the run's own step
(`build_parts(...).step`) on a synthetic batch, DDP, FSDP2 and FSDP2 with world.reshard_after_forward=false ("fsdp
kept": every block's gathered weights kept from forward to backward) built in one process and stepped in interleaved
rounds, medians. A small batch keeps the compute small, so what differs is the host's work: FSDP2's hooks, the
optimizer on DTensor shards, the gradient norm. The process's malloc keeps freed memory, as a CPU rank's does
(host.keep_freed_memory): without it FSDP2's gathered parameters, freed at every reshard, come back as fresh pages
(~9,400 page faults a step for clipdist-tiny), a cost the trainer never pays.

    python scripts/bench_fsdp_host.py [--model clipdist-tiny] [--batch 4] [--rounds 7] [--steps 20] [--world 1]
        [--malloc-default] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import resource
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from clipdist.distributed import host
from clipdist.distributed.network import free_port
from clipdist.tools.gpu_battery import config, one_rank_group, synthetic_batch
from clipdist.train.parts import build_parts


def timed(step, batch, steps: int) -> tuple[float, float]:
    """(median seconds a step, page faults a step)."""
    times, faults = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        started = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - started)
    return statistics.median(times), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="clipdist-tiny")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--malloc-default", action="store_true", help="leave malloc as it is (what the trainer's CPU ranks do not)"
    )
    parser.add_argument("--profile", action="store_true", help="print FSDP2's step's slowest functions (cProfile)")
    parser.add_argument("--world", type=int, default=1, help="gloo ranks (each one thread); rank 0 reports")
    args = parser.parse_args()
    if args.world < 1:
        parser.error(f"--world {args.world}: give 1 rank or more")
    if args.world == 1:
        measure(0, args, None)
    else:
        torch.multiprocessing.spawn(measure, args=(args, free_port()), nprocs=args.world)


@contextlib.contextmanager
def ranks_group(rank: int, world: int, port: int):
    """A gloo group of `world` ranks on this machine, one thread each, torn down after."""
    torch.set_num_threads(1)
    address = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure(rank: int, args: argparse.Namespace, port: int | None) -> None:
    """The three steps built and timed in interleaved rounds (every rank in lockstep); rank 0 prints."""
    device = torch.device("cpu")
    if not args.malloc_default:
        host.keep_freed_memory()  # as the trainer's CPU ranks do (train.startup.configure_host)
    torch.manual_seed(0)
    group = one_rank_group(device) if port is None else ranks_group(rank, args.world, port)
    with tempfile.TemporaryDirectory() as work, group:
        steps = {}
        for name in ("ddp", "fsdp", "fsdp kept"):
            cfg = config(
                Path(work) / name.replace(" ", "_"),
                args.model,
                "fp32",
                args.batch,
                parallel="ddp" if name == "ddp" else "fsdp",
            )
            cfg.world.reshard_after_forward = name != "fsdp kept"
            parts = build_parts(cfg, device)
            steps[name] = (parts.step, synthetic_batch(parts.model, args.batch, device))
        for step, batch in steps.values():  # warm-up
            for _ in range(3):
                step(batch)
        rounds: dict[str, list[float]] = {parallel: [] for parallel in steps}
        faults: dict[str, list[float]] = {parallel: [] for parallel in steps}
        for _ in range(args.rounds):
            for parallel, (step, batch) in steps.items():
                seconds, faulted = timed(step, batch, args.steps)
                rounds[parallel].append(seconds)
                faults[parallel].append(faulted)
        if rank == 0:
            report(rounds, faults)
        if args.profile:  # every rank steps; rank 0 under the profiler
            step, batch = steps["fsdp"]
            profiler = cProfile.Profile()
            run = lambda: [step(batch) for _ in range(args.steps)]  # noqa: E731
            profiler.runcall(run) if rank == 0 else run()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
            print(out.getvalue()) if rank == 0 else None


def report(rounds: dict[str, list[float]], faults: dict[str, list[float]]) -> None:
    for parallel, times in rounds.items():
        each = ", ".join(f"{seconds * 1e3:.1f}" for seconds in times)
        print(
            f"{parallel}: {statistics.median(times) * 1e3:.2f} ms a step ({each}); "
            f"{statistics.median(faults[parallel]):.0f} page faults a step"
        )
    for name in ("fsdp", "fsdp kept"):
        ratios = [fsdp / ddp for ddp, fsdp in zip(rounds["ddp"], rounds[name])]
        each = ", ".join(f"{ratio:.2f}" for ratio in ratios)
        print(f"{name} / ddp: {statistics.median(ratios):.2f} (per round {each})")


if __name__ == "__main__":
    main()
