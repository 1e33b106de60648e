"""`clipdist bench limit`: how close a run comes to this machine's limit.

    clipdist bench limit --data digits web_photos --ranks 1 2

On the machine it runs on, one core at a time (one intra-op thread, CPU time of the process):
  loader   CPU seconds per sample to read, decode, augment, tokenize and collate — the run's own stream
           (data.TrainStream, no workers: the same work a loader worker does), over --batches batches;
  step     CPU seconds per sample of the run's own step (parts.build_parts: the pixels normalized where
           data.normalize_on puts them, forward, loss, backward, optimizer) on a batch the stream made.
Every sample costs L + S CPU-seconds wherever it is spent, so C cores give at most C / (L + S) samples/s with
perfect overlap: the pipelined bound. Then real runs (train.py, world=local and world=cpu2, the loader's automatic
workers) are reported as a fraction of it — their median samples/s over the second half of their steps, each
against the bound from costs measured just before and just after it (the step's costs with malloc keeping freed
memory, as a rank's). A run below the bound loses to overlap (a rank waiting for data, workers preempting ranks),
to parallel efficiency (two intra-op threads on a small model) or to the collectives of 2 ranks: the stream's and
the step's profiles (logging.profile_steps) say which. Each run with its costs is made --repeats times,
interleaved over the world sizes, and the medians are reported with every run's figures beside them: a shared
machine's speed moves between runs.

Workloads: digits (clipdist-tiny on the built-in digits, 32 px) and web_photos (224-px web JPEGs, the tiny model at
224 px in 32-px patches, docs/bench/clipdist-tiny-224-p32.json).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from clipdist.checkpoint.run_dir import jsonl_rows
from clipdist.data.images import normalize_on_device
from clipdist.distributed import host

REPO = Path(__file__).resolve().parents[2]
WORKLOADS = {"digits": [], "web_photos": [f"model.name={REPO / 'docs' / 'bench' / 'clipdist-tiny-224-p32.json'}"]}


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def workload_config(data: str, batch: int, work: Path, cache_dir: str):
    """The run's config for a workload, as `train.py data=<data> <its overrides>` composes it."""
    from omegaconf import OmegaConf

    from clipdist.config import preset, to_train_config

    preset_data = OmegaConf.to_container(preset("data", data))
    assert isinstance(preset_data, dict)
    settings: dict[str, Any] = {
        "name": "limit",
        "run_dir": str(work),
        "world": {"batch_per_device": batch},
        "data": {**preset_data, "cache_dir": cache_dir},
    }
    for override in WORKLOADS[data]:
        key, value = override.split("=", 1)
        group, name = key.split(".")
        settings.setdefault(group, {})[name] = value
    return to_train_config(settings)


def one_core_costs(data: str, batch: int, batches: int, cache_dir: str) -> dict:
    """(loader, step) CPU seconds per sample on one core, this process."""
    from clipdist.data.builtin import builtin_shards
    from clipdist.data.sources import expand_shards
    from clipdist.data.stream import TrainStream
    from clipdist.train.parts import build_parts

    host.keep_freed_memory()  # as the trainer's ranks do (this process's malloc: kept for the rest of the command)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as work:
            cfg = workload_config(data, batch, Path(work), cache_dir)
            parts = build_parts(cfg, torch.device("cpu"))
            train, _ = builtin_shards(data, str(Path(cache_dir).expanduser()))
            stream = TrainStream(
                [expand_shards(train)],
                cfg.data,
                batch_size=batch,
                image_transform=parts.train_transform,
                tokenizer=parts.tokenizer,
                seed=cfg.seed,
                workers=0,
                pixels=normalize_on_device(cfg.data.normalize_on)[0],
            )
            try:
                next(stream)  # the stream's start (readers placed, first shards opened) is not a per-sample cost
                loader = []
                for _ in range(batches):
                    started = time.process_time()
                    batch_read = next(stream)
                    loader.append(time.process_time() - started)
                    stream.consumed()
            finally:
                stream.close()
            parts.step(batch_read)  # warm-up
            step = []
            for _ in range(max(batches // 2, 3)):
                started = time.process_time()
                parts.step(batch_read)
                step.append(time.process_time() - started)
    finally:
        torch.set_num_threads(threads)
    return {"loader_s": statistics.median(loader) / batch, "step_s": statistics.median(step) / batch}


def run_train(run_dir: str | Path, overrides: list[str], steps: int, timeout_s: float = 1800) -> str:
    """`train.py` in a fresh interpreter on `run_dir` for `steps` steps (no evaluation or checkpoint on the way but at
    its end); its standard output, or a RuntimeError with its last line if it fails."""
    command = [
        sys.executable,
        str(REPO / "train.py"),
        f"run_dir={run_dir}",
        f"optim.max_steps={steps}",
        f"eval_every={steps * 10}",
        f"checkpoint_every={steps * 10}",
        "logging.wandb=disabled",
        "logging.progress=false",
        "logging.report=false",
        "logging.log_every=1",
        *overrides,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    if result.returncode:
        said = [line for line in result.stderr.splitlines() if line.strip() and "HYDRA_FULL_ERROR" not in line]
        raise RuntimeError(f"train.py {' '.join(overrides)}: {said[-1] if said else result.returncode}")
    return result.stdout


def real_run(overrides: list[str], steps: int, timeout_s: float = 1800, skip: int | None = None) -> float:
    """Median samples/s of a real run (run_train) over its steps after `skip` (the second half where None), from its
    train_log.jsonl."""
    with tempfile.TemporaryDirectory() as work:
        run_train(Path(work, "run"), overrides, steps, timeout_s)
        rows = jsonl_rows(Path(work, "run", "train_log.jsonl"))[0]
    return statistics.median(row["samples_per_s"] for row in rows[len(rows) // 2 if skip is None else skip :])


def end_to_end(data: str, ranks: int, batch: int, steps: int, cache_dir: str) -> float:
    """Median samples/s of a real run of the workload on `ranks` local ranks."""
    return real_run(
        [
            f"data={data}",
            f"data.cache_dir={Path(cache_dir).expanduser()}",
            f"world={'local' if ranks == 1 else f'cpu{ranks}'}",
            f"world.batch_per_device={batch}",
            *WORKLOADS[data],
        ],
        steps,
    )


def measure(
    workloads=("digits", "web_photos"),
    ranks=(1, 2),
    batch: int = 128,
    batches: int = 12,
    steps: int = 60,
    cache_dir: str = "~/.cache/clipdist",
    repeats: int = 3,
) -> list[dict]:
    """A row per workload and world size: one-core costs, the bound for this machine's cores, the runs, the fraction.

    Each real run is measured against the bound from costs measured just before and just after it (their mean),
    and `repeats` such runs — interleaved over the world sizes — give the medians: a shared machine moves between
    steady states from one minute to the next (this one: one-core costs ~25% apart), so costs from one state and a
    run from another would make a fraction off by as much (seen: 1.13 of a bound measured minutes earlier). Every
    run's figures stay in the row."""
    pairs: dict[tuple[str, int], list[tuple[dict, float]]] = {
        (data, count): [] for data in workloads for count in ranks
    }
    for _ in range(repeats):
        for data in workloads:
            for count in ranks:
                before = one_core_costs(data, batch, batches, cache_dir)
                run = end_to_end(data, count, batch // count, steps, cache_dir)
                after = one_core_costs(data, batch, batches, cache_dir)
                pairs[data, count].append(({key: (before[key] + after[key]) / 2 for key in before}, run))
    rows = []
    for (data, count), measured in pairs.items():
        costs, runs = [cost for cost, _ in measured], [run for _, run in measured]
        bounds = [cores() / (cost["loader_s"] + cost["step_s"]) for cost in costs]
        fractions = [run / bound for run, bound in zip(runs, bounds)]
        rows.append(
            {
                "data": data,
                "ranks": count,
                "cores": cores(),
                "loader_ms": statistics.median(cost["loader_s"] for cost in costs) * 1e3,
                "step_ms": statistics.median(cost["step_s"] for cost in costs) * 1e3,
                "bound": statistics.median(bounds),
                "bounds": bounds,
                "samples_per_s": statistics.median(runs),
                "runs": runs,
                "fraction": statistics.median(fractions),
                "fractions": fractions,
                "global_batch": batch // count * count,
                "cost_rounds": [{key: value * 1e3 for key, value in cost.items()} for cost in costs],
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| data | ranks | loader ms/sample (1 core) | step ms/sample (1 core) | bound on "
        f"{rows[0]['cores']} cores (around each run) | run samples/s (each run) | fraction of the bound (each run) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        bounds, each = (", ".join(f"{value:,.0f}" for value in row[key]) for key in ("bounds", "runs"))
        fractions = ", ".join(f"{fraction:.2f}" for fraction in row["fractions"])
        lines.append(
            f"| {row['data']} | {row['ranks']} | {row['loader_ms']:.3f} | {row['step_ms']:.3f} | "
            f"{row['bound']:,.0f} ({bounds}) | {row['samples_per_s']:,.0f} ({each}) | **{row['fraction']:.2f}** "
            f"({fractions}) |"
        )
    return "\n".join(lines)
