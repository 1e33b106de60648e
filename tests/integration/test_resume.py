"""A stopped and resumed run is indistinguishable from one never stopped: the same batches, the same
per-step loss — through SIGTERM and kill -9, twice, with 0–2 loader workers, epoch and resampled
modes, 1 and 2 ranks; weighted sources mixed by weight; a changed layout restarts with a warning."""

from __future__ import annotations

import signal

import numpy as np
import pytest
from fixtures import flat, two_sources, weighted_stream
from helpers import read_jsonl, train, train_stream, train_until

STEPS = 16


def losses(run_dir):
    rows = read_jsonl(run_dir / "train_log.jsonl")
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # each step logged once
    return np.array([row["loss"] for row in rows])


def wandb_losses(run_dir):
    """train/loss as the run's local W&B files hold it, over every segment (one per start): (step, value)."""
    from clipdist.tracking import wandb_records

    rows = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.HasField("history"):
                values = {"/".join(item.nested_key) or item.key: item.value_json for item in record.history.item}
                rows.append((record.history.step.num, float(values["train/loss"])))
    return rows


def board_losses(run_dir):
    """train/loss as TensorBoard shows it: (step, value), the steps a resume re-logs shown once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars("train/loss")]


# Loader workers 2 (resampled) and 1 (epoch mode, 2 ranks); 0 workers resume in
# test_the_stream_resumes_from_any_batch_exactly.
@pytest.mark.parametrize("launch, workers, resampled", [("local", 2, True), ("cpu2", 1, False)])
def test_stopped_twice_and_resumed_equals_uninterrupted(tmp_path, cache_dir, launch, workers, resampled):
    overrides = [
        f"world={launch}",
        "world.batch_per_device=16",
        f"optim.max_steps={STEPS}",
        "eval_every=1000",
        "checkpoint_every=4",
        "keep_checkpoints=10",
        f"data.workers={workers}",
        f"data.resampled={resampled}",
        "logging.tensorboard=true",
        "logging.wandb=offline",
    ]
    whole = train(tmp_path / "whole", cache_dir, *overrides)
    assert whole.returncode == 0, whole.stderr[-3000:]
    run_dir = tmp_path / "stopped"
    train_until(run_dir, cache_dir, overrides, 5, signal.SIGTERM)  # a checkpoint at the step it stopped
    train_until(run_dir, cache_dir, overrides, 11, signal.SIGKILL)  # no checkpoint: back to step 8's
    resumed = train(run_dir, cache_dir, *overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count("resumed from") == 1 and "cannot continue sample for sample" not in resumed.stderr
    np.testing.assert_allclose(losses(run_dir), losses(tmp_path / "whole"), rtol=0, atol=1e-6)
    board = board_losses(run_dir)  # TensorBoard: the same curve, killed steps 9-11 hidden behind their re-run
    assert [step for step, _ in board] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([loss for _, loss in board], losses(run_dir), rtol=1e-6)
    # W&B (offline, read back from its files): the kills lost what W&B had not written; the resumed segments
    # filled the gaps from train_log.jsonl: every step once, in order, across the segments, the same losses.
    logged = wandb_losses(run_dir)
    assert [step for step, _ in logged] == list(range(1, STEPS + 1)), logged
    np.testing.assert_allclose([loss for _, loss in logged], losses(run_dir), rtol=1e-6)


def test_other_workers_continue_and_a_changed_layout_restarts_reshuffled_with_a_warning(tmp_path, cache_dir):
    overrides = ["world.batch_per_device=16", "eval_every=1000", "checkpoint_every=2"]
    assert train(tmp_path / "run", cache_dir, *overrides, "optim.max_steps=3").returncode == 0
    resumed = train(tmp_path / "run", cache_dir, *overrides, "optim.max_steps=5", "data.workers=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "the data stream continues at sample 48 of its order (4 reader(s); 1 rank(s) × 16)" in resumed.stdout
    assert "cannot continue" not in resumed.stderr
    resumed = train(tmp_path / "run", cache_dir, *overrides, "optim.max_steps=7", "data.shuffle_buffer=10")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        "warning: the data stream cannot continue sample for sample (changed since the checkpoint: shuffle_buffer "
        "1000 -> 10); it restarts reshuffled at sample 80"
    ) in resumed.stderr
    assert [row["step"] for row in read_jsonl(tmp_path / "run" / "train_log.jsonl")] == list(range(1, 8))


def test_checkpoint_every_minutes(tmp_path, cache_dir):
    result = train(
        tmp_path / "run",
        cache_dir,
        "world.batch_per_device=8",
        "optim.max_steps=40",
        "eval_every=1000",
        "checkpoint_every=1000",
        "checkpoint_every_minutes=0.005",
        "keep_checkpoints=100",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = sorted(int(path.stem.split("_")[1]) for path in (tmp_path / "run" / "checkpoints").glob("step_*.dcp"))
    assert steps[-1] == 40 and len(steps) >= 3, steps  # the end, and every ~0.3 s on the way


# --- the stream alone: resume from a batch's position, mixing --------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_the_stream_resumes_from_any_batch_exactly(tmp_path, workers):
    sources = two_sources(tmp_path)
    batches = weighted_stream(sources, workers)
    try:
        for _ in range(7):
            next(batches)
            batches.consumed()
        saved = batches.state_dict()
        next(batches)  # handed out but not consumed (a stop signal came): not part of the position
        expected = [next(batches)["image"].tolist() for _ in range(5)]
    finally:
        batches.close()
    resumed = weighted_stream(sources, workers)
    resumed.load_state_dict(saved)
    try:
        assert resumed.restart_reason is None
        next(resumed)
        assert [next(resumed)["image"].tolist() for _ in range(5)] == expected
    finally:
        resumed.close()


def test_pieces_and_workers_do_not_change_the_stream(tmp_path):
    """data.pieces and the worker count are how the rank's rows are carried, not which: 4 readers on 0-4
    workers, in 1, 2 or 4 pieces, resumed on another count or piece count — the same batches."""
    sources = two_sources(tmp_path)

    def run(workers, pieces=1, count=9, saved=None):
        batches = train_stream(
            sources,
            4,
            flat,
            resampled=True,
            shuffle_buffer=6,
            workers=workers,
            seed=3,
            weights=[3, 1],
            readers=4,
            pieces=pieces,
        )
        batches.load_state_dict(saved)
        try:
            seen = []
            for _ in range(count):
                batch = next(batches)
                assert batch.rows == 4 and sum(batch.counts[2:]) == 4
                seen.append(batch["image"].tolist())
                batches.consumed()
            return seen, batches.state_dict()
        finally:
            batches.close()

    def assembly(workers, pieces=1):
        return train_stream(sources, 4, flat, resampled=True, workers=workers, readers=4, pieces=pieces).assembly()

    # whole batches by worker in turn (2 and 4 workers), or every worker's rows of every batch (3 workers, pieces)
    assert assembly(2).startswith("the 2 loader workers make whole batches in turn")
    assert assembly(4).startswith("the 4 loader workers make whole batches in turn")
    assert assembly(3).startswith("each batch is assembled from the rows of all 3 loader workers (the order's cycle")
    assert assembly(2, 2) == "each batch is assembled from the rows of all 2 loader workers (data.pieces)"
    expected, _ = run(0)
    for workers, pieces in [(1, 1), (2, 1), (3, 1), (4, 1), (0, 2), (2, 2), (1, 4), (3, 4)]:
        assert run(workers, pieces)[0] == expected, (workers, pieces)
    head, saved = run(4, count=5)
    tail, _ = run(2, pieces=2, count=4, saved=saved)
    assert head + tail == expected
    with pytest.raises(ValueError, match="data.pieces=3 does not divide world.batch_per_device=4"):
        run(0, pieces=3)


def test_the_global_batches_are_the_same_on_any_world_size(tmp_path):
    """The ranks' rows of each global batch, put side by side, are one order whatever the world size: a stream
    started on 2 ranks (4 readers) continues on 1, 3 (its readers shared by two ranks), 4 and 6 ranks, with a
    larger or smaller global batch, in epoch mode and resampled, with workers and pieces."""
    sources = two_sources(tmp_path, shards=8, per_shard=5)

    def run(ranks, count, batch=12, saved=None, workers=0, pieces=1, resampled=False):
        streams = [
            train_stream(
                sources,
                batch // ranks,
                flat,
                rank=rank,
                world_size=ranks,
                resampled=resampled,
                shuffle_buffer=6,
                seed=3,
                readers=2,
                workers=workers,
                pieces=pieces,
            )
            for rank in range(ranks)
        ]
        try:
            for stream in streams:
                if saved is not None:
                    stream.load_state_dict(saved)
                    assert stream.restart_reason is None and stream.continued
            rows = []
            for _ in range(count):
                for stream in streams:
                    rows += next(stream)["image"].tolist()
                    stream.consumed()
            positions = {}  # what the collective state_dict gathers: every rank's readers
            for stream in streams:
                positions.update(stream.readers)
            return rows, {**streams[0].state_dict(), "readers": positions}
        finally:
            for stream in streams:
                stream.close()

    for resampled in (False, True):
        whole, _ = run(2, 10, resampled=resampled)
        _, saved = run(2, 4, resampled=resampled)
        for ranks, batch, workers, pieces in [
            (1, 12, 0, 1),
            (3, 12, 0, 1),
            (4, 12, 2, 1),
            (6, 12, 0, 2),
            (2, 24, 0, 1),
            (4, 8, 0, 1),
        ]:
            tail, _ = run(
                ranks, 72 // batch, batch=batch, saved=saved, workers=workers, pieces=pieces, resampled=resampled
            )
            assert tail == whole[48:120], (resampled, ranks, batch)
        assert run(1, 10, resampled=resampled)[0] != whole  # 2 readers (1 rank × 2) are another order than 4


def test_a_run_logs_the_samples_of_each_source(tmp_path, cache_dir):
    a, b = two_sources(tmp_path, shards=2, per_shard=8)
    result = train(
        tmp_path / "run",
        cache_dir,
        "data=webdataset",
        f"data.train_shards={a[0]}::{b[0]}",
        "data.resampled=true",
        "data.weights=[1,1]",
        "data.workers=0",
        "world.batch_per_device=8",
        "optim.max_steps=3",
        "eval_every=1000",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(tmp_path / "run" / "train_log.jsonl")
    assert [sum(row["source_samples"]) for row in rows] == [8, 16, 24]


def test_wandb_holds_every_step_once_after_a_kill_that_lost_its_buffer(tmp_path, cache_dir):
    """kill -9 before W&B wrote anything leaves a 7-byte run file (seen: W&B's service exits with the killed run,
    its buffer unwritten); made certain here by cutting the killed segment back to that header. The resumed run
    logs to W&B, from train_log.jsonl, the steps it lacks, then goes on: every step once, the same losses."""
    overrides = [
        "world.batch_per_device=16",
        "optim.max_steps=12",
        "eval_every=1000",
        "checkpoint_every=4",
        "logging.wandb=offline",
    ]
    run_dir = tmp_path / "run"
    train_until(run_dir, cache_dir, overrides, 10, signal.SIGKILL)  # the checkpoint at step 8 survives
    killed = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(killed) == 1
    killed[0].write_bytes(killed[0].read_bytes()[:7])
    resumed = train(run_dir, cache_dir, *overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = read_jsonl(run_dir / "train_log.jsonl")
    assert [row["step"] for row in rows] == list(range(1, 13))
    logged = wandb_losses(run_dir)
    assert [step for step, _ in logged] == list(range(1, 13)), logged
    np.testing.assert_allclose([loss for _, loss in logged], [row["loss"] for row in rows], rtol=1e-6)


def test_a_checkpoint_with_the_readers_and_generators_in_progress_pt_still_resumes_the_same(tmp_path, cache_dir):
    """Checkpoints of the days every reader's position and every rank's RNG were in progress.pt (before they went
    among the tensors) continue exactly as today's: the same next step."""
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp

    from clipdist.checkpoint.state import rng_state_of
    from clipdist.checkpoint.weights import PROGRESS, dcp_sizes, read_dcp, read_progress
    from clipdist.data.stream import unpack_position

    common = ["world.batch_per_device=16", "checkpoint_every=3", "eval_every=1000", "data.workers=1"]
    assert train(tmp_path / "today", cache_dir, "optim.max_steps=3", *common).returncode == 0
    shutil.copytree(tmp_path / "today", tmp_path / "then")
    checkpoint = tmp_path / "then" / "checkpoints" / "step_00000003.dcp"
    progress, tensors = read_progress(checkpoint), read_dcp(checkpoint, {"data", "rng"})
    progress["stream"]["readers"] = {
        int(key.removeprefix("reader_")): unpack_position(packed) for key, packed in tensors["data"].items()
    }
    progress["rng"] = [rng_state_of(tensors["rng"]["rank_00000"])]
    weights_alone = read_dcp(checkpoint, {"model", "optimizer"})  # the folder as then: no data.*, no rng.*
    shutil.rmtree(checkpoint)
    dcp.save(weights_alone, checkpoint_id=str(checkpoint), no_dist=True)
    torch.save(progress, checkpoint / PROGRESS)
    assert not [key for key in dcp_sizes(checkpoint) if key.startswith(("data.", "rng."))]
    losses = []
    for run in ("today", "then"):
        result = train(tmp_path / run, cache_dir, "optim.max_steps=5", *common)
        assert result.returncode == 0, result.stderr[-3000:]
        losses.append([row["loss"] for row in read_jsonl(tmp_path / run / "train_log.jsonl")][3:])
    assert len(losses[0]) == 2 and losses[0] == losses[1]
