"""A run resumed on another number of ranks is the run never stopped: the same global batches in the same
order — so, with exact losses, the same loss at every step — stopped mid-epoch on 2 ranks and continued on 1,
on 4, and on 4 (FSDP) then 1; on the digits (at 16 px, then 32 after a resolution schedule's switch that every
resume crosses) and on weighted, resampled webdataset sources with 2 loader workers and a bad sample in every
shard; the weight average (optim.ema) resumed with them."""

from __future__ import annotations

import collections
import shutil

import numpy as np
import pytest
from fixtures import caption_shards
from helpers import read_jsonl, train, train_until

STEPS = 30  # the digits' epoch is 22 global batches of 64: the stops fall in the first, the runs end in the second
# progressive resolution (a fixed-size tower's data.resolution_schedule): 16 px, then the tower's 32 px from the 25th
# step — after every stop, so each resume crosses the switch
# and a weight average (optim.ema) that starts at step 12, after every stop: each resume crosses its start
DIGITS = (
    "data.workers=2",
    "+data.resolution_schedule.0=[16]",
    "+data.resolution_schedule.24=[32]",
    "optim.ema.decay=0.8",
    "optim.ema.start_step=12",
)
GLOBAL_BATCH = 64
WORLDS = {"cpu2": 2, "local": 1, "cpu4": 4}


def overrides(world: str, *more: str, steps: int = STEPS) -> list[str]:
    return [
        f"world={world}",
        f"world.batch_per_device={GLOBAL_BATCH // WORLDS[world]}",
        f"optim.max_steps={steps}",
        "eval_every=1000",
        "checkpoint_every=1000",
        "logging.log_every=1",
        "logging.sample_keys=true",
        *more,
    ]


def stop_at(run_dir, cache_dir, world: str, step: int, *more: str, steps: int = STEPS) -> int:
    """Train on `world` until `step` steps are logged, then SIGTERM (a checkpoint at the step it stopped)."""
    return train_until(run_dir, cache_dir, overrides(world, *more, steps=steps), step)


def resume(run_dir, cache_dir, world: str, *more: str, steps: int = STEPS) -> str:
    result = train(run_dir, cache_dir, *overrides(world, *more, steps=steps))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cannot continue sample for sample" not in result.stderr
    return result.stdout


def global_batches(run_dir) -> dict[int, list[str]]:
    """Each step's global batch as logging.sample_keys has it: the ranks' rows, in rank order."""
    ranks = sorted((run_dir / "samples").glob("rank_*.jsonl"), key=lambda path: int(path.stem.split("_")[1]))
    steps: dict[int, dict[int, list[str]]] = collections.defaultdict(dict)
    for path in ranks:
        for row in read_jsonl(path):
            steps[row["step"]][int(path.stem.split("_")[1])] = row["keys"]
    return {step: [key for rank in sorted(rows) for key in rows[rank]] for step, rows in steps.items()}


def assert_same_run(
    run_dir, whole_dir, since: int, steps: int = STEPS, epoch: int | None = None, tolerances=((STEPS, 1e-5),)
) -> float:
    """Every step's global batch equal to the uninterrupted run's, and its loss within 1e-5 (relative) after
    `since` (before it: the same run, bit for bit) — `tolerances`: (up to step, relative) —; the samples of the first
    `epoch` steps the same, each once (an epoch is every row once: data/epochs.py).
    Returns the worst relative difference."""
    batches, expected = global_batches(run_dir), global_batches(whole_dir)
    assert sorted(batches) == list(range(1, steps + 1))
    assert all(len(batches[step]) == GLOBAL_BATCH and "" not in batches[step] for step in batches)
    assert batches == expected
    if epoch:
        seen = collections.Counter(key for step in range(1, epoch + 1) for key in batches[step])
        assert seen == collections.Counter(key for step in range(1, epoch + 1) for key in expected[step])
        assert max(seen.values()) == 1, seen.most_common(3)
    losses = np.array([row["loss"] for row in read_jsonl(run_dir / "train_log.jsonl")])
    whole = np.array([row["loss"] for row in read_jsonl(whole_dir / "train_log.jsonl")])
    assert len(losses) == steps
    np.testing.assert_array_equal(losses[:since], whole[:since])
    differences = np.abs(losses - whole) / np.abs(whole)
    for upto, tolerance in tolerances:
        assert float(differences[:upto].max()) <= tolerance, (upto, differences.tolist())
    return float(differences.max())


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory, cache_dir):
    """The uninterrupted run on 2 ranks, and one stopped mid-epoch on 2 ranks (copied for each resume)."""
    root = tmp_path_factory.mktemp("elastic")
    whole = root / "whole"
    result = train(whole, cache_dir, *overrides("cpu2", *DIGITS))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "after step 24: images now 32 px (data.resolution_schedule.24)" in result.stdout
    stopped = root / "stopped"
    step = stop_at(stopped, cache_dir, "cpu2", 9, *DIGITS)
    assert 9 <= step < 22
    return whole, stopped, step


# The middle leg of cpu2 -> cpu4 -> local runs under FSDP: its checkpoint (sharded over 4) continues on one DDP rank.
@pytest.mark.parametrize("worlds", [["local"], ["cpu4"], ["cpu4", "local"]])
def test_digits_resumed_on_other_world_sizes_is_the_uninterrupted_run(tmp_path, cache_dir, digits_runs, worlds):
    whole, stopped, step = digits_runs
    run_dir = tmp_path / "run"
    shutil.copytree(stopped, run_dir)
    for world in worlds[:-1]:
        assert stop_at(run_dir, cache_dir, world, step + 6, *DIGITS, "world.parallel=fsdp") > step
    stdout = resume(run_dir, cache_dir, worlds[-1], *DIGITS)
    assert "the data stream continues at sample" in stdout
    worst = assert_same_run(run_dir, whole, step, epoch=22)
    print(f"{' -> '.join(['cpu2', *worlds])}: worst relative loss difference {worst:.2e}")
    assert_same_average(run_dir, whole)


def assert_same_average(run_dir, whole_dir) -> None:
    """The newest checkpoints' weight averages (optim.ema) equal within 1e-5 (absolute: the weights are O(1e-2 … 1),
    and a resume on another world size moves them by ~1e-6 through the reductions' order, as it moves the losses),
    and not the weights (the average moved)."""
    import torch

    from clipdist.checkpoint.weights import find_checkpoint, read_run_checkpoint

    ours, theirs = find_checkpoint(run_dir), find_checkpoint(whole_dir)
    assert ours.name == theirs.name == f"step_{STEPS:08d}.dcp"
    average, expected = read_run_checkpoint(ours, ema=True)[0], read_run_checkpoint(theirs, ema=True)[0]
    weights = read_run_checkpoint(ours)[0]
    assert average.keys() == expected.keys()
    worst = max(float((average[name] - expected[name]).abs().max()) for name in average)
    print(f"weight average: worst absolute difference {worst:.1e}")
    assert worst <= 1e-5, worst
    assert any(not torch.equal(average[name], weights[name]) for name in average)


def test_weighted_resampled_webdataset_with_two_workers_resumes_on_other_world_sizes(tmp_path, cache_dir):
    """Two sources mixed 3:1, drawn with replacement, a bad sample opening every shard (skipped by every rank
    that reads it, counted once): cpu2 stopped, continued on cpu4, stopped, finished on one process."""
    a, b = (
        caption_shards(
            tmp_path / name,
            shards=4,
            per_shard=40,
            bad_first=True,
            pixel=lambda shard, i, base=base: (base + 37 * shard + 11 * i) % 256,
        )
        for name, base in [("a", 0), ("b", 128)]
    )
    data = [
        "data=webdataset",
        f"data.train_shards={a}::{b}",
        "data.resampled=true",
        "data.weights=[3,1]",
        "data.workers=2",
        "data.shuffle_buffer=20",
    ]
    steps, whole, run_dir = 12, tmp_path / "whole", tmp_path / "run"
    result = train(whole, cache_dir, *overrides("cpu2", *data, steps=steps))
    assert result.returncode == 0, result.stderr[-3000:]
    first = stop_at(run_dir, cache_dir, "cpu2", 3, *data, steps=steps)
    assert first < steps - 4
    stop_at(run_dir, cache_dir, "cpu4", first + 3, *data, steps=steps)
    resume(run_dir, cache_dir, "local", *data, steps=steps)
    worst = assert_same_run(run_dir, whole, first, steps=steps)
    print(f"cpu2 -> cpu4 -> local, webdataset: worst relative loss difference {worst:.2e}")
    logged, expected = (read_jsonl(path / "train_log.jsonl") for path in (run_dir, whole))
    assert [row["source_samples"] for row in logged] == [row["source_samples"] for row in expected]
    assert [row["skipped_samples"] for row in logged] == [row["skipped_samples"] for row in expected]
    assert logged[-1]["skipped_samples"] > 0


@pytest.mark.parametrize("world, workers", [("local", 2), ("cpu2", 1), ("cpu4", 2)])
def test_a_fresh_run_reads_the_same_batches_however_launched(tmp_path, cache_dir, fresh_local_run, world, workers):
    """A fresh run's order is its global batch's (order.run_layout), not its launch's: 1 × 64, 2 × 32 and 4 × 16
    ranks, with 1 or 2 loader workers, read the same global batches for 50 steps (the first epoch's rows each once)
    and log the same losses — so a one-process debug run reproduces a larger launch's first steps. The losses agree
    to reduction order: within 1e-5 (relative) for 30 steps, as a resume's do; training then amplifies that rounding
    (measured 7.2e-5 at step 49 of 2 × 32 against 1 × 64), so the rest is held to 1e-4."""
    run_dir = tmp_path / "run"
    result = train(run_dir, cache_dir, *overrides(world, f"data.workers={workers}", steps=FRESH_STEPS))
    assert result.returncode == 0, result.stderr[-3000:]
    worst = assert_same_run(
        run_dir, fresh_local_run, 0, steps=FRESH_STEPS, epoch=22, tolerances=((30, 1e-5), (50, 1e-4))
    )
    print(f"local × 1 worker vs {world} × {workers} worker(s): worst relative loss difference {worst:.2e}")


FRESH_STEPS = 50


@pytest.fixture(scope="module")
def fresh_local_run(tmp_path_factory, cache_dir):
    """A fresh 1 × 64 run with one loader worker: what every other launch of the run must read."""
    run_dir = tmp_path_factory.mktemp("fresh") / "local"
    result = train(run_dir, cache_dir, *overrides("local", "data.workers=1", steps=FRESH_STEPS))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir
