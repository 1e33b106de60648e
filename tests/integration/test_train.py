"""`python train.py` end to end: it learns, N ranks equal one, gradient caching equals the whole step (resume and
determinism: test_resume.py, where a stopped run equals one never stopped; bad input: test_config.py)."""

from __future__ import annotations

import re

import pytest
from helpers import read_jsonl, run_log, train

from clipdist.losses import build

# Two ranks × 4 == one rank × 8, and the same samples in the same order without augmentation.
SAME_GLOBAL_BATCH = ["data.split=replicated", "data.augment=false", "logging.log_every=1", "eval_every=1000"]


def test_default_run_learns_digits(tmp_path, cache_dir):
    result = train(tmp_path / "run", cache_dir, "optim.max_steps=150", "eval_every=150", "optim.warmup_steps=20")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert metrics[-1]["step"] == 150
    assert metrics[-1]["zeroshot_top1"] > 0.5, metrics[-1]  # chance is 0.1
    last = metrics[-1]  # recall@k grows with k, top-5 holds top-1, and a model that learnt retrieves above chance
    assert last["zeroshot_top5"] >= last["zeroshot_top1"]
    for direction in ("i2t", "t2i"):
        assert last[f"{direction}_r1"] <= last[f"{direction}_r5"] <= last[f"{direction}_r10"], last
        assert last[f"{direction}_r10"] > 10 / last["val_samples"], last
    log = read_jsonl(tmp_path / "run" / "train_log.jsonl")
    assert log[-1]["loss"] < log[0]["loss"]
    assert (tmp_path / "run" / "checkpoints" / "step_00000150.dcp").is_dir()


@pytest.fixture(scope="module")
def local_losses(tmp_path_factory, cache_dir):
    """One-rank losses of the first two steps, per loss definition (softmax backends share one)."""
    runs = {}

    def losses_of(backend: str) -> list[float]:
        definition = "siglip" if build(backend).uses_logit_bias else "disco"
        if definition not in runs:
            run_dir = tmp_path_factory.mktemp("local")
            result = train(
                run_dir,
                cache_dir,
                f"loss={definition}",
                "world=local",
                "world.batch_per_device=8",
                "optim.max_steps=2",
                *SAME_GLOBAL_BATCH,
            )
            assert result.returncode == 0, result.stderr[-3000:]
            runs[definition] = [row["loss"] for row in read_jsonl(run_dir / "train_log.jsonl")]
        return runs[definition]

    return losses_of


# The trainer's path differs by backend only through the loss's scalars (siglip's bias) and options
# (tiled's tile); naive and gather_layer take disco's path and are proven exact by test_gradcheck / test_losses.
@pytest.mark.parametrize("backend", ["disco", "tiled", "siglip"])
def test_cpu2_first_step_loss_equals_local(tmp_path, cache_dir, local_losses, backend):
    expected = local_losses(backend)
    result = train(
        tmp_path / "run",
        cache_dir,
        f"loss={backend}",
        "world=cpu2",
        "world.batch_per_device=4",
        "optim.max_steps=2",
        *SAME_GLOBAL_BATCH,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [row["loss"] for row in read_jsonl(tmp_path / "run" / "train_log.jsonl")]
    assert losses[0] == pytest.approx(expected[0], rel=1e-6)
    assert losses[1] == pytest.approx(expected[1], rel=1e-4)  # after one identical update


def test_siglip_with_grad_cache_trains_on_two_ranks(tmp_path, cache_dir):
    result = train(
        tmp_path / "run",
        cache_dir,
        "loss=siglip",
        "grad_cache.chunks=2",
        "world=cpu2",
        "world.batch_per_device=8",
        "optim.max_steps=4",
        "logging.log_every=1",
        "eval_every=1000",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(tmp_path / "run" / "train_log.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert rows[0]["logit_scale"] == pytest.approx(10.0, rel=0.01)  # SigLIP's init: log-scale log(10), bias −10
    assert rows[0]["logit_bias"] == pytest.approx(-10.0, abs=0.01)


@pytest.mark.parametrize(
    "chunking", [("grad_cache.chunks=4",), ("grad_cache.micro_batch=3",), ("grad_cache.chunks=4", "data.pieces=4")]
)
def test_grad_cached_run_follows_the_unchunked_run(tmp_path, cache_dir, local_losses, chunking):
    """Gradient caching changes no loss; nor does the loader reading the batch in pieces into host memory
    while the step moves one chunk at a time to the device (the last case: inputs off the device)."""
    expected = local_losses("disco")
    result = train(
        tmp_path / "run",
        cache_dir,
        *chunking,
        "world=local",
        "world.batch_per_device=8",
        "optim.max_steps=2",
        *SAME_GLOBAL_BATCH,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [row["loss"] for row in read_jsonl(tmp_path / "run" / "train_log.jsonl")]
    assert losses[0] == pytest.approx(expected[0], rel=1e-6)
    assert losses[1] == pytest.approx(expected[1], rel=1e-4)  # the chunked update equals the whole-batch one


def test_float_batches_normalized_by_the_loader_train_exactly_as_uint8_batches(tmp_path, cache_dir, local_losses):
    """data.normalize_on=loader: the workers make the normalized float32 batch instead of handing over uint8
    pixels for the rank to normalize after the copy (the default, auto); on the CPU the losses are the same,
    bit for bit."""
    expected = local_losses("disco")
    result = train(
        tmp_path / "run",
        cache_dir,
        "data.normalize_on=loader",
        "world=local",
        "world.batch_per_device=8",
        "optim.max_steps=2",
        *SAME_GLOBAL_BATCH,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [row["loss"] for row in read_jsonl(tmp_path / "run" / "train_log.jsonl")] == expected
    assert "images normalized by the loader (data.normalize_on=loader)" in run_log(tmp_path / "run")  # a line


@pytest.mark.parametrize("idle_below, decision", [(1.01, "to idle"), (0.0, "stay at normal")])
def test_loader_workers_priority_follows_what_the_run_measures(tmp_path, cache_dir, monkeypatch, idle_below, decision):
    """Where a CPU rank cannot spare its worker a core, the worker starts at normal priority and the run's own
    wait for data decides at step 30 (warm-up 10 + a 20-step window), in the log: idle priority where the rank
    waited less than `idle_below` of its time (made certain either way here: every share is below 1.01 and none
    below 0)."""
    from clipdist.data import workers
    from clipdist.distributed import host

    monkeypatch.setattr(host, "rank_cpus", lambda procs_per_node, environ=None: (1, "1 CPU (test)"))
    monkeypatch.setattr(workers.MeasuredPriority.__init__, "__defaults__", (10, 20, idle_below, 1.01))
    result = train(
        tmp_path / "run", cache_dir, "data.workers=1", "optim.max_steps=31", "eval_every=1000", "checkpoint_every=1000"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = "\n".join(run_log(tmp_path / "run"))
    assert (
        "loader workers at normal priority (data.worker_priority=auto: 1 CPU (test), fewer than the rank + 1 "
        "worker(s); idle priority once the run shows the loader keeps up)"
    ) in log
    assert re.search(
        rf"step 30: loader workers {decision} priority: over steps 11-30 the rank waited "
        r"[0-9.]+% of its time for data",
        log,
    ), log


def test_the_loader_worker_count_the_run_measures_changes_no_sample(tmp_path, cache_dir, monkeypatch):
    """data.workers=auto on a CPU rank with 4 CPUs: 4 readers, 2 workers at the start; at step 30 the run moves to
    the count its measurements favour (made to move here: no minimum gain; a digits step outweighs its loading,
    so one worker keeps up), restarting the workers mid-run — and every loss equals a run on 4 fixed workers (4
    readers)."""
    from clipdist.data import workers
    from clipdist.distributed import host

    monkeypatch.setattr(host, "rank_cpus", lambda procs_per_node, environ=None: (4, "4 CPUs (test)"))
    monkeypatch.setattr(workers.MeasuredWorkers.__init__, "__defaults__", (10, 20, 0.0))
    common = [
        "data.resampled=true",
        "world.batch_per_device=16",
        "optim.max_steps=36",
        "eval_every=1000",
        "checkpoint_every=1000",
    ]
    measured = train(tmp_path / "measured", cache_dir, "data.workers=null", *common)
    assert measured.returncode == 0, measured.stderr[-3000:]
    log = "\n".join(run_log(tmp_path / "measured"))
    assert "2 loader worker(s) per rank (data.workers=auto: 4 CPUs (test), CPU ranks start with up to 4" in log, log
    assert re.search(
        r"step 30: 2 -> 1 loader worker\(s\): over steps 11-30 a batch took [0-9]+ ms of a loader "
        r"worker's CPU and the step [0-9]+ ms",
        log,
    ), log
    fixed = train(tmp_path / "fixed", cache_dir, "data.workers=4", *common)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    rows = [[row["loss"] for row in read_jsonl(tmp_path / name / "train_log.jsonl")] for name in ("measured", "fixed")]
    assert len(rows[0]) == 36 and rows[0] == rows[1]
