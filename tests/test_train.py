"""`python train.py` end to end: it learns, N ranks equal one, resume continues, bad input is refused."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from clipdist.losses import build
from helpers import REPO, read_jsonl, train, train_command

# Two ranks × 4 == one rank × 8, and the same samples in the same order without augmentation.
SAME_GLOBAL_BATCH = ["data.split=replicated", "data.augment=false", "logging.log_every=1", "eval_every=1000"]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


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
    process = subprocess.Popen(train_command(run_dir, cache_dir, *overrides), cwd=REPO, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (run_dir / "checkpoints" / "step_00000020.pt").exists():
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.time() < deadline, "no checkpoint at step 20 in time"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
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


def test_bad_config_key_is_a_clear_error(tmp_path, cache_dir):
    result = train(tmp_path / "run", cache_dir, "optim.lrr=0.1", timeout=60)
    assert result.returncode != 0
    assert "Key 'lrr' not in 'OptimConfig'" in result.stderr


def test_unknown_backend_is_a_clear_error(tmp_path, cache_dir):
    result = train(tmp_path / "run", cache_dir, "loss.name=nope", timeout=60)
    assert result.returncode != 0
    assert "unknown loss backend 'nope'" in result.stderr


def test_missing_shard_directory_is_a_clear_error(tmp_path, cache_dir):
    result = train(tmp_path / "run", cache_dir, "data=webdataset", f"data.train_shards='{tmp_path}/nope/{{000..003}}.tar'",
                   timeout=60)
    assert result.returncode != 0
    assert "4 of 4 shards not found" in result.stderr


def test_world_preset_that_does_not_match_the_launch_is_a_clear_error(tmp_path, cache_dir):
    alone = train(tmp_path / "a", cache_dir, "world=8gpu", timeout=60)
    assert alone.returncode != 0 and "expects 8 processes" in alone.stderr and "torchrun" in alone.stderr
    torchrun_env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}
    mismatch = train(tmp_path / "b", cache_dir, "world=cpu2", env=torchrun_env, timeout=60)
    assert mismatch.returncode != 0 and "expects 2 processes" in mismatch.stderr and "started 3" in mismatch.stderr


def test_siglip_with_grad_cache_trains_on_two_ranks(tmp_path, cache_dir):
    result = train(tmp_path / "run", cache_dir, "loss=siglip", "grad_cache.chunks=2", "world=cpu2",
                   "world.batch_per_device=8", "optim.max_steps=4", "logging.log_every=1", "eval_every=1000")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(tmp_path / "run" / "train_log.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert rows[0]["logit_scale"] == pytest.approx(10.0, rel=0.01)  # SigLIP's init: log-scale log(10), bias −10
    assert rows[0]["logit_bias"] == pytest.approx(-10.0, abs=0.01)


def test_bad_loss_options_and_chunks_are_clear_errors(tmp_path, cache_dir):
    options = train(tmp_path / "a", cache_dir, "loss=tiled", "loss.tyle=4", timeout=60)
    assert options.returncode != 0 and "Key 'tyle' not in 'TiledLossConfig'" in options.stderr
    chunks = train(tmp_path / "b", cache_dir, "grad_cache.chunks=100", "world.batch_per_device=8", timeout=60)
    assert chunks.returncode != 0 and "grad_cache.chunks=100 is more than world.batch_per_device=8" in chunks.stderr
    both = train(tmp_path / "c", cache_dir, "grad_cache.chunks=2", "grad_cache.micro_batch=4", timeout=60)
    assert both.returncode != 0 and "give one of them" in both.stderr


@pytest.mark.parametrize("chunking", ["grad_cache.chunks=4", "grad_cache.micro_batch=3"])
def test_grad_cached_run_follows_the_unchunked_run(tmp_path, cache_dir, local_losses, chunking):
    expected = local_losses("disco")
    result = train(tmp_path / "run", cache_dir, chunking, "world=local", "world.batch_per_device=8",
                   "optim.max_steps=2", *SAME_GLOBAL_BATCH)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [row["loss"] for row in read_jsonl(tmp_path / "run" / "train_log.jsonl")]
    assert losses[0] == pytest.approx(expected[0], rel=1e-6)
    assert losses[1] == pytest.approx(expected[1], rel=1e-4)  # the chunked update equals the whole-batch one


def test_micro_batch_sets_the_number_of_chunks():
    from clipdist.config import GradCacheConfig

    assert GradCacheConfig(micro_batch=3).chunks_for(8) == 3
    assert GradCacheConfig(micro_batch=8).chunks_for(8) == 1
    assert GradCacheConfig(chunks=4).chunks_for(8) == 4
