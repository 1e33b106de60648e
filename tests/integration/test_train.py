"""`python train.py` end to end: it learns, N ranks equal one, gradient caching equals the whole step (resume and
determinism: test_resume.py, where a stopped run equals one never stopped; bad input: test_config.py)."""

from __future__ import annotations

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


def test_a_redirected_console_gets_a_plain_line_a_log_step_and_no_bar(tmp_path, cache_dir):
    """Redirected to a file (not a terminal), the console has no progress bar — no copy of it before each line —
    and a plain line for each logged step."""
    result = train(tmp_path / "run", cache_dir, "optim.max_steps=3", "logging.progress=true", "eval_every=3")
    assert result.returncode == 0, result.stderr[-3000:]
    console = result.stdout + result.stderr
    assert "it/s" not in console and "\r" not in console and "%|" not in console, console[-2000:]
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ") and "/3: loss " in line]
    assert [line.split(":")[0] for line in steps] == ["step 1/3", "step 2/3", "step 3/3"], result.stdout[-2000:]


def test_a_run_leaves_no_multiprocessing_folder_behind(tmp_path, cache_dir):
    """Loader workers and forked ranks are stopped with SIGKILL, past multiprocessing's own clean-up: each one that
    had shared a tensor left its pymp-* folder (a socket in it) in the temporary folder, two a run. The launching
    process's one folder is shared with them (launch.share_temp_dir) and removed at its exit."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    result = train(
        tmp_path / "run",
        cache_dir,
        "world=cpu2",
        "data.workers=2",
        "optim.max_steps=2",
        "eval_every=2",
        env={"TMPDIR": str(temporary)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert not list(temporary.glob("pymp-*")), sorted(p.name for p in temporary.iterdir())
