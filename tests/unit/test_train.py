"""The training loop in the fast loop: train.py's own entry point in this process (no rank, no loader worker
started) trains the embedded default for three steps, checkpoints, and a second start continues from it."""

from __future__ import annotations

import math

import pytest
from helpers import read_jsonl, train

from clipdist.checkpoint.weights import read_progress


def test_three_steps_of_the_default_run_then_a_resume_in_process(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    common = [
        "world.batch_per_device=16",
        "checkpoint_every=3",
        "eval_every=3",
        "optim.warmup_steps=2",
        "logging.report=true",
    ]
    first = train(run_dir, cache_dir, "optim.max_steps=3", *common)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = read_jsonl(run_dir / "train_log.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(math.isfinite(row["loss"]) and row["grad_norm"] > 0 for row in rows)
    base = 2e-3  # optim=tiny's lr (the schema's default)
    # the lr each step applied (warmup 1/2, 2/2, then cosine from its top), not the next step's
    assert [row["lr"] for row in rows] == pytest.approx([base / 2, base, base])
    assert [row["step"] for row in read_jsonl(run_dir / "metrics.jsonl")] == [3]
    checkpoint = run_dir / "checkpoints" / "step_00000003.dcp"
    assert checkpoint.is_dir()
    banner = [
        "model clipdist-tiny: 3.4M parameters, 3.4M trained",  # the recipe said back (clipdist/train/recipe.py)
        "optimizer adamw (lr 0.002, weight decay 0.1, betas [0.9, 0.98], eps 1e-06, grad clip 1); cosine "
        "schedule, warmup 2 of 3 steps; precision fp32",
        "loss disco: contrastive_loss × 1; global batch 16 (1 rank(s) × 16); ddp",
        "data: 4 train shard(s) in 1 source(s); evaluation: val; captions padded to the batch's longest",
    ]
    lines = first.stdout.splitlines()
    assert all(line in lines for line in banner), first.stdout
    assert all(line in (run_dir / "train.log").read_text() for line in banner)
    assert (run_dir / "report.png").is_file()  # written at the end of every run (clipdist report)
    assert (run_dir / "report.txt").read_text().startswith("run run: not running, step 3, 48 samples seen")

    resumed = train(run_dir, cache_dir, "optim.max_steps=4", *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoint} at step 3" in resumed.stdout
    assert "warning: changed since step_00000003.dcp: optim.max_steps 3 -> 4" in resumed.stderr  # the cosine reshapes
    assert [row["step"] for row in read_jsonl(run_dir / "train_log.jsonl")] == [1, 2, 3, 4]
    saved = read_progress(run_dir / "checkpoints" / "step_00000004.dcp")
    assert saved["step"] == 4 and saved["samples_seen"] == 4 * 16


def test_the_log_cadence_is_open_clip_trains():
    """--log-every-n-steps 3 over 10 steps logs 1, 4, 7, 10 there; every step at 1; the last step always."""
    from clipdist.tracking import logs_step

    assert [step for step in range(1, 11) if logs_step(step, 3, 10)] == [1, 4, 7, 10]
    assert [step for step in range(1, 12) if logs_step(step, 5, 11)] == [1, 6, 11]
    assert [step for step in range(1, 10) if logs_step(step, 4, 9)] == [1, 5, 9]
    assert all(logs_step(step, 1, 4) for step in range(1, 5))
    assert [step for step in range(1, 8) if logs_step(step, 3, 7)] == [1, 4, 7]
    assert [step for step in range(1, 9) if logs_step(step, 3, 8)] == [1, 4, 7, 8]
    assert [step for step in range(1, 9) if logs_step(step, 3, 8, epoch_steps=4)] == [1, 4, 5, 8]
    assert [step for step in range(1, 13) if logs_step(step, 3, 12, epoch_steps=6)] == [1, 4, 6, 7, 10, 12]
