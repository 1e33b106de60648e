"""open_clip_train's recipes over real ranks: an fp16 overflow on one rank skips the update on every rank (DDP and
FSDP2), and a run with fp16, a locked tower, a timm optimizer and a cooldown schedule resumes exactly."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from helpers import read_jsonl, train, train_until

from clipdist.data.batch import Batch
from clipdist.distributed.launch import launch_local
from integration.test_elastic import global_batches

STEPS = 12


def _overflow_on_rank_1(parallel: str):
    """Two steps on this rank: the first with an inf put into rank 1's own gradients only (after the reduction,
    into its shard under FSDP), the second clean. (overflowed, parameters unchanged, scale) per step."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from clipdist.distributed.parallel import full_tensor, wrap_model
    from clipdist.losses import build
    from clipdist.model.factory import create_model_for_loss, random_tokens
    from clipdist.model.precision import autocast, gradient_scaler
    from clipdist.optim.optimizer import build_optimizer
    from clipdist.train.step import Step
    from tests.unit.test_recipes import _optim

    class PoisonedStep(Step):
        poison = True

        def backward(self, loss, outputs, replay):
            super().backward(loss, outputs, replay)
            if self.poison and dist.get_rank() == 1:
                grad = self.module.visual.proj.grad
                (grad._local_tensor if isinstance(grad, DTensor) else grad).view(-1)[0] = math.inf

    torch.manual_seed(0)
    loss_fn = build("disco")
    model = create_model_for_loss("clipdist-tiny", loss_fn)
    wrapped = wrap_model(model, parallel=parallel)
    optimizer, scheduler = build_optimizer(model, _optim(lr=1e-3, warmup_steps=1))
    device = torch.device("cpu")
    scaler = gradient_scaler("fp16", device)
    step = PoisonedStep(wrapped, loss_fn, optimizer, scheduler, autocast=autocast("fp16", device), scaler=scaler)
    generator = torch.Generator().manual_seed(dist.get_rank())
    images, tokens = torch.randn(4, 3, 32, 32, generator=generator), random_tokens(4, 16, generator)
    results = []
    for poison in (True, False):
        before = [full_tensor(param.detach()).clone() for param in model.parameters()]
        step.poison = poison
        step(Batch.of(images, tokens))
        after = [full_tensor(param.detach()) for param in model.parameters()]
        results.append((step.overflowed, all(torch.equal(a, b) for a, b in zip(after, before)), scaler.get_scale()))
    return results


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_an_fp16_overflow_on_one_rank_skips_the_update_on_every_rank(parallel):
    ranks = launch_local(_overflow_on_rank_1, 2, parallel, timeout_s=120)
    assert ranks[0] == ranks[1], ranks  # the same decision, the same scale, on both ranks
    (overflowed, unchanged, scale), (clean_overflowed, clean_unchanged, clean_scale) = ranks[0]
    assert overflowed and unchanged and scale == 2.0**15
    assert not clean_overflowed and not clean_unchanged and clean_scale == 2.0**15


def losses(run_dir):
    rows = read_jsonl(run_dir / "train_log.jsonl")
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    return np.array([row["loss"] for row in rows]), rows


def test_an_fp16_locked_tower_lion_cooldown_run_stopped_and_resumed_equals_uninterrupted(tmp_path, cache_dir):
    overrides = [
        "world=cpu2",
        "world.batch_per_device=16",
        f"optim.max_steps={STEPS}",
        "eval_every=1000",
        "checkpoint_every=4",
        "precision=fp16",
        "model.lock_image=true",
        "model.lock_image_unlocked_groups=1",
        "optim.name=lion",
        "optim.lr=1e-4",
        "optim.warmup_steps=2",
        "optim.schedule=const_cooldown",
        "optim.const_cooldown.steps=6",
        "data.augmentation.color_jitter=[0.4,0.4,0.4,0.1]",
        "data.augmentation.color_jitter_prob=0.5",
        "model.force_patch_dropout=0.25",
        "logging.sample_keys=true",  # a difference is then told apart: other data, or other state
    ]
    whole = train(tmp_path / "whole", cache_dir, *overrides)
    assert whole.returncode == 0, whole.stderr[-3000:]
    run_dir = tmp_path / "stopped"
    stopped_at = train_until(run_dir, cache_dir, overrides, 6)
    resumed = train(run_dir, cache_dir, *overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count("resumed from") == 1
    batches = global_batches(run_dir)
    assert batches == global_batches(tmp_path / "whole"), f"other batches after the stop at {stopped_at}"
    whole_losses, whole_rows = losses(tmp_path / "whole")
    resumed_losses, resumed_rows = losses(run_dir)
    np.testing.assert_array_equal(resumed_losses, whole_losses)
    assert [row["loss_scale"] for row in resumed_rows] == [row["loss_scale"] for row in whole_rows]
    assert [row["lr"] for row in resumed_rows] == [row["lr"] for row in whole_rows]
    # the lr each step applied: the last cooldown step runs at 1/6 of the lr (cooldown 6, linear), the next would be 0
    assert resumed_rows[-1]["lr"] == pytest.approx(1e-4 / 6)


def test_a_resume_that_unlocks_a_tower_is_refused_and_one_that_ends_patch_dropout_is_warned(tmp_path, cache_dir):
    overrides = [
        "world.batch_per_device=8",
        "optim.max_steps=2",
        "eval_every=1000",
        "checkpoint_every=2",
        "model.lock_image=true",
        "model.force_patch_dropout=0.5",
    ]
    assert train(tmp_path / "run", cache_dir, *overrides).returncode == 0
    unlocked = train(tmp_path / "run", cache_dir, *overrides[:-2], "optim.max_steps=3", "model.force_patch_dropout=0.5")
    assert (
        unlocked.returncode == 2
        and "was trained with model.lock_image=True, not model.lock_image=False" in unlocked.stderr
    ), unlocked.stderr[-2000:]
    flip = train(tmp_path / "run", cache_dir, *overrides[:-1], "optim.max_steps=3", "model.force_patch_dropout=0")
    assert flip.returncode == 0, flip.stderr[-3000:]
    assert "changed since step_00000002.dcp: model.force_patch_dropout 0.5 -> 0.0" in flip.stderr


def test_an_export_carries_the_runs_model_overrides_and_preprocessing(tmp_path, cache_dir):
    """open_clip alone loads the export of a run with force_* overrides and its own image mean as the run built it."""

    from clipdist.checkpoint.weights import find_checkpoint, read_run_checkpoint
    from clipdist.cli import main as cli
    from clipdist.model.factory import create_model, get_tokenizer, model_overrides
    from tests.integration.test_export import open_clip_features
    from tests.unit.test_recipes import _model_cfg

    overrides = {"force_image_size": 48, "force_quick_gelu": True, "image_mean": [0.5, 0.4, 0.3]}
    run = train(
        tmp_path / "run",
        cache_dir,
        "world.batch_per_device=8",
        "optim.max_steps=2",
        "eval_every=1000",
        "model.force_image_size=48",
        "model.force_quick_gelu=true",
        "model.image_mean=[0.5,0.4,0.3]",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert cli(["export", str(tmp_path / "run"), "--out", str(tmp_path / "model")]) == 0
    ours = create_model("clipdist-tiny", overrides=model_overrides(_model_cfg(**overrides)))
    ours.load_state_dict(read_run_checkpoint(find_checkpoint(tmp_path / "run"))[0])
    ours.eval()
    images, captions = torch.randn(2, 3, 48, 48), ["a photo of a 3.", "a seven"]
    theirs = open_clip_features(tmp_path / "model", images, captions, tmp_path)
    with torch.no_grad():
        assert torch.equal(theirs["image"], ours.encode_image(images))
        assert torch.equal(theirs["text"], ours.encode_text(get_tokenizer("clipdist-tiny")(captions)))
    assert theirs["image_size"] == [48, 48]
    exported = json.loads((tmp_path / "model" / "open_clip_config.json").read_text())
    assert exported["preprocess_cfg"]["mean"] == [0.5, 0.4, 0.3] and exported["model_cfg"]["quick_gelu"] is True


@pytest.mark.parametrize("precision", ["pure_bf16", "fp16"])
def test_two_steps_and_an_evaluation_in_each_precision(tmp_path, cache_dir, precision):
    from clipdist.checkpoint.weights import read_progress

    result = train(
        tmp_path / "run",
        cache_dir,
        f"precision={precision}",
        "world.batch_per_device=16",
        "optim.max_steps=2",
        "eval_every=2",
        "checkpoint_every=2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(tmp_path / "run" / "train_log.jsonl")
    assert [row["step"] for row in rows] == [1, 2] and all(math.isfinite(row["loss"]) for row in rows)
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]["zeroshot_samples"] > 0
    scaler = read_progress(tmp_path / "run" / "checkpoints" / "step_00000002.dcp")["scaler"]
    assert (scaler is not None) == (precision == "fp16")  # the scaler's state travels in the checkpoint
