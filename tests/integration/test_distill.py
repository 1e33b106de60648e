"""Distillation over the global batch: the ring term equals open_clip's DistillClipLoss on one process (value and
gradients, N = 1..4, unequal local batches, tiles smaller than the batch), end to end, and refused where it cannot
run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fixtures import max_error
from helpers import read_jsonl, train
from open_clip.loss import DistillClipLoss

from clipdist.distributed.launch import launch_local
from clipdist.losses.distill import DistillationLoss
from clipdist.losses.reference import distill_loss_reference
from clipdist.tools.gradcheck import run_gradchecks

TEACHER_DIM = 6  # the teacher's feature dim differs from the student's (8), as a bigger teacher's would


def features(sizes, seed):
    generator = torch.Generator().manual_seed(seed)
    student = [
        F.normalize(torch.randn(sum(sizes), 8, generator=generator, dtype=torch.float64), dim=-1) for _ in range(2)
    ]
    teacher = [
        F.normalize(torch.randn(sum(sizes), TEACHER_DIM, generator=generator, dtype=torch.float64), dim=-1)
        for _ in range(2)
    ]
    return student, teacher


def one_process(sizes, seed, scale, teacher_scale, definition):
    (image, text), (teacher_image, teacher_text) = features(sizes, seed)
    image.requires_grad_(), text.requires_grad_()
    logit_scale = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
    loss = definition(image, text, logit_scale, teacher_image, teacher_text, torch.tensor(teacher_scale))
    loss.backward()
    return loss.detach(), image.grad, text.grad, logit_scale.grad


def open_clip_distill(image, text, scale, teacher_image, teacher_text, teacher_scale):
    return DistillClipLoss()(image, text, scale, teacher_image, teacher_text, teacher_scale)[1]


CASES = [([4], 10.0, 30.0, 1024), ([3], 50.0, 100.0, 2), ([2], 100.0, 14.0, 1)]


def distributed_errors():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    errors = []
    for seed, (base, scale, teacher_scale, tile) in enumerate(CASES):
        sizes = [base[0] + r for r in range(world_size)]
        rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        (image, text), (teacher_image, teacher_text) = features(sizes, seed)
        local_image, local_text = image[rows].clone().requires_grad_(), text[rows].clone().requires_grad_()
        logit_scale = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
        loss = DistillationLoss(tile=tile)(
            local_image, local_text, logit_scale, teacher_image[rows], teacher_text[rows], torch.tensor(teacher_scale)
        )
        loss.backward()
        image_grad, text_grad = torch.zeros_like(image), torch.zeros_like(text)
        image_grad[rows], text_grad[rows] = local_image.grad, local_text.grad
        values = torch.stack([loss.detach(), logit_scale.grad])
        for tensor in (image_grad, text_grad, values):  # what DDP's average leaves
            dist.all_reduce(tensor)
            tensor /= world_size
        got = (values[0], image_grad, text_grad, values[1])
        errors.append(
            (
                max_error(got, one_process(sizes, seed, scale, teacher_scale, distill_loss_reference)),
                max_error(got, one_process(sizes, seed, scale, teacher_scale, open_clip_distill)),
            )
        )
    return errors if rank == 0 else None


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_distillation_on_the_ring_matches_open_clip_over_the_global_batch(world_size):
    errors = launch_local(distributed_errors, world_size, timeout_s=120)[0]
    assert len(errors) == len(CASES)
    assert max(max(pair) for pair in errors) < 1e-12, errors


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_a_distilled_step_gives_ddp_the_single_process_gradients(world_size):
    """The model level: student towers under DDP with the teacher's term, against one process with open_clip's
    DistillClipLoss; unequal local batches."""
    sizes = [2 + rank for rank in range(world_size)]
    for report in run_gradchecks(["disco", "tiled", "siglip"], world_size, local_batch=sizes, distill=True):
        assert report.exact, (report.backend, report.max_rel_err, report.diagnosis)


def test_distillation_with_gradient_caching_under_fsdp_is_exact():
    for report in run_gradchecks(["tiled"], 3, local_batch=[4, 2, 5], chunks=2, parallel="fsdp", distill=True):
        assert report.exact, (report.backend, report.max_rel_err, report.diagnosis)


def test_a_distilled_run_trains_three_steps_on_two_ranks(tmp_path, cache_dir):
    """The term counted from step 3 (loss.distill.start_at=0.5 of 3 steps), said in the banner, the log and the
    report; from there the logged loss is the weighted sum of the logged terms."""
    teacher = tmp_path / "teacher"
    result = train(teacher, cache_dir, "optim.max_steps=2", "eval_every=1000")
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "run"
    result = train(
        run,
        cache_dir,
        f"loss.distill.model={teacher}",
        "loss.distill.weight=0.5",
        "loss.distill.start_at=0.5",
        "world=cpu2",
        "grad_cache.chunks=2",
        "loss=tiled",
        "optim.max_steps=3",
        "eval_every=1000",
        "logging.log_every=1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = read_jsonl(run / "train_log.jsonl")
    assert [row["step"] for row in log] == [1, 2, 3]
    assert all("distill_loss" not in row for row in log[:2])
    assert log[2]["distill_loss"] > 0
    assert log[2]["loss"] == pytest.approx(log[2]["contrastive_loss"] + 0.5 * log[2]["distill_loss"], rel=1e-5)
    said = (run / "train.log").read_text()
    assert "distill_loss × 0.5 from step 3" in said and "step 3: distill_loss counts from this step on" in said
    from clipdist.tools.report import read_run, summary

    assert "distill_loss counted from step 3 on" in summary(read_run(run), "run")
