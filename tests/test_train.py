"""`python train.py` end to end: it learns, N ranks equal one, gradient caching equals the whole step, resume continues
(bad input is refused before the ranks: test_config.py)."""
from __future__ import annotations

import signal

import pytest

from clipdist.losses import build
from helpers import Run, read_jsonl, train

pytestmark = pytest.mark.e2e

# Two ranks × 4 == one rank × 8, and the same samples in the same order without augmentation.
SAME_GLOBAL_BATCH = ["data.split=replicated", "data.augment=false", "logging.log_every=1", "eval_every=1000"]


def test_default_run_learns_digits(tmp_path, cache_dir):
    result = train(tmp_path / "run", cache_dir, "optim.max_steps=150", "eval_every=150", "optim.warmup_steps=20")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert metrics[-1]["step"] == 150
    assert metrics[-1]["zeroshot_top1"] > 0.5, metrics[-1]  # chance is 0.1
    for key in ("zeroshot_top1", "i2t_r1", "t2i_r1", "i2t_r5", "t2i_r10"):
        assert 0.0 <= metrics[-1][key] <= 1.0
    log = read_jsonl(tmp_path / "run" / "train_log.jsonl")
    assert log[-1]["loss"] < log[0]["loss"]
    assert (tmp_path / "run" / "checkpoints" / "step_00000150.pt").is_file()


@pytest.fixture(scope="module")
def local_losses(tmp_path_factory, cache_dir):
    """One-rank losses of the first two steps, per loss definition (softmax backends share one)."""
    runs = {}

    def losses_of(backend: str) -> list[float]:
        definition = "siglip" if build(backend).uses_logit_bias else "disco"
        if definition not in runs:
            run_dir = tmp_path_factory.mktemp("local")
            result = train(run_dir, cache_dir, f"loss={definition}", "world=local", "world.batch_per_device=8",
                           "optim.max_steps=2", *SAME_GLOBAL_BATCH)
            assert result.returncode == 0, result.stderr[-3000:]
            runs[definition] = [row["loss"] for row in read_jsonl(run_dir / "train_log.jsonl")]
        return runs[definition]

    return losses_of


# The trainer's path differs by backend only through the loss's scalars (siglip's bias) and options
# (tiled's tile); naive and gather_layer take disco's path and are proven exact by test_gradcheck / test_losses.
@pytest.mark.parametrize("backend", ["disco", "tiled", "siglip"])
def test_cpu2_first_step_loss_equals_local(tmp_path, cache_dir, local_losses, backend):
    expected = local_losses(backend)
    result = train(tmp_path / "run", cache_dir, f"loss={backend}", "world=cpu2", "world.batch_per_device=4",
                   "optim.max_steps=2", *SAME_GLOBAL_BATCH)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [row["loss"] for row in read_jsonl(tmp_path / "run" / "train_log.jsonl")]
    assert losses[0] == pytest.approx(expected[0], rel=1e-6)
    assert losses[1] == pytest.approx(expected[1], rel=1e-4)  # after one identical update


def test_same_seed_same_loss_curve(tmp_path, cache_dir):
    curves = []
    for attempt in range(2):
        result = train(tmp_path / f"run{attempt}", cache_dir, "optim.max_steps=5", "logging.log_every=1", "eval_every=1000")
        assert result.returncode == 0, result.stderr[-3000:]
        curves.append([row["loss"] for row in read_jsonl(tmp_path / f"run{attempt}" / "train_log.jsonl")])
    assert curves[0] == curves[1]


def test_kill_and_resume_continues_from_the_checkpoint(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    overrides = ["optim.max_steps=40", "optim.warmup_steps=5", "checkpoint_every=10", "keep_checkpoints=10",
                 "logging.log_every=1", "eval_every=1000"]
    with Run.train(run_dir, cache_dir, *overrides) as run:
        run.wait_for(lambda: (run_dir / "checkpoints" / "step_00000020.pt").exists(), what="a checkpoint at step 20")
        run.signal_group(signal.SIGKILL)
        run.finish(timeout=30)
    killed_log = read_jsonl(run_dir / "train_log.jsonl")
    killed_at = killed_log[-1]["step"]
    assert killed_at < 40

    resumed = train(run_dir, cache_dir, *overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    checkpoint_step = int(resumed.stdout.split("at step ")[1].split()[0])
    assert checkpoint_step in (20, 30) and checkpoint_step <= killed_at
    log = read_jsonl(run_dir / "train_log.jsonl")
    # Each step once: the killed run's steps after the checkpoint were dropped and trained again.
    assert [row["step"] for row in log] == list(range(1, 41))
    # The schedule goes on where it was: the resumed steps' learning rates equal the killed run's.
    killed_lr = {row["step"]: row["lr"] for row in killed_log}
    for row in log[checkpoint_step:]:
        if row["step"] in killed_lr:
            assert row["lr"] == pytest.approx(killed_lr[row["step"]], rel=1e-12)
    assert {p.name for p in (run_dir / "checkpoints").glob("*.pt")} >= {f"step_{s:08d}.pt" for s in (10, 20, 40)}


def test_siglip_with_grad_cache_trains_on_two_ranks(tmp_path, cache_dir):
    result = train(tmp_path / "run", cache_dir, "loss=siglip", "grad_cache.chunks=2", "world=cpu2",
                   "world.batch_per_device=8", "optim.max_steps=4", "logging.log_every=1", "eval_every=1000")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(tmp_path / "run" / "train_log.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert rows[0]["logit_scale"] == pytest.approx(10.0, rel=0.01)  # SigLIP's init: log-scale log(10), bias −10
    assert rows[0]["logit_bias"] == pytest.approx(-10.0, abs=0.01)


@pytest.mark.parametrize("chunking", ["grad_cache.chunks=4", "grad_cache.micro_batch=3"])
def test_grad_cached_run_follows_the_unchunked_run(tmp_path, cache_dir, local_losses, chunking):
    expected = local_losses("disco")
    result = train(tmp_path / "run", cache_dir, chunking, "world=local", "world.batch_per_device=8",
                   "optim.max_steps=2", *SAME_GLOBAL_BATCH)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [row["loss"] for row in read_jsonl(tmp_path / "run" / "train_log.jsonl")]
    assert losses[0] == pytest.approx(expected[0], rel=1e-6)
    assert losses[1] == pytest.approx(expected[1], rel=1e-4)  # the chunked update equals the whole-batch one
