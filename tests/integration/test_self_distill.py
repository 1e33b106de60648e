"""loss.self_distill (SILC's local-to-global self-distillation, clipdist.objective.self_distill): exact against its
one-process definition at 1–4 ranks with and without gradient caching, started late in a run, resumed on another
world size as the run never stopped (the head, its centre and the EMA teacher with it), and left out of exports."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import read_jsonl, run_log

from clipdist.tools.gradcheck import run_gradchecks
from integration.test_elastic import assert_same_run, resume, stop_at


@pytest.mark.parametrize(
    ("sizes", "chunks"), [([5], 2), ([3, 2], 1), ([2, 2, 3], 2), ([2, 2, 1, 2], 1), ([2, 3, 2, 2], 2)]
)
def test_self_distillation_gives_ddp_the_single_process_loss_and_gradients(sizes, chunks):
    """Unequal local batches; the teacher another model's weights, the centre drawn at random, two 16 px views an
    image (the 32 px tower's position table resampled): the head, both towers and the scalars exact in fp64."""
    for report in run_gradchecks(["disco", "siglip"], len(sizes), local_batch=sizes, chunks=chunks, self_distill=True):
        assert report.exact, (report.backend, report.max_rel_err, report.diagnosis)
        head = [check for check in report.parameters if check.name.startswith("self_distill_head.")]
        assert len(head) == 5 and all(check.verdict == "exact" for check in head)
        assert report.loss_rel_err <= 1e-9


def test_gradcheck_refuses_self_distillation_under_fsdp():
    with pytest.raises(ValueError, match="DDP only"):
        run_gradchecks(["disco"], 2, parallel="fsdp", self_distill=True)


STEPS = 16
# SigLIP with an EMA teacher and the term from step 9 (start_at 0.5 of 16 steps): a stop before it on 2 ranks,
# resumed on 1 across it
RECIPE = (
    "loss=siglip",
    "optim.ema.decay=0.9",
    "loss.self_distill.crops=2",
    "loss.self_distill.crop_size=16",
    "loss.self_distill.start_at=0.5",
    "loss.self_distill.weight=0.5",
    "checkpoint_every=1000",
)


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, cache_dir):
    whole = tmp_path_factory.mktemp("self_distill") / "whole"
    result = resume(whole, cache_dir, "cpu2", *RECIPE, steps=STEPS)
    assert "self_distill_loss × 0.5 from step 9" in result
    return whole


def test_a_run_stopped_on_two_ranks_and_resumed_on_one_is_the_run_never_stopped(tmp_path, cache_dir, whole_run):
    run_dir = tmp_path / "run"
    step = stop_at(run_dir, cache_dir, "cpu2", 4, *RECIPE, steps=STEPS)
    assert 4 <= step < 9
    resume(run_dir, cache_dir, "local", *RECIPE, steps=STEPS)
    worst = assert_same_run(run_dir, whole_run, step, steps=STEPS)
    print(f"cpu2 -> local across the term's start: worst relative loss difference {worst:.2e}")
    log = read_jsonl(run_dir / "train_log.jsonl")
    assert all("self_distill_loss" not in row for row in log[:8])
    assert all(row["self_distill_loss"] > 0 for row in log[8:])
    assert any("step 9: self_distill_loss counts from this step on" in line for line in run_log(run_dir))
    # the model (the head and its centre included) and its average: the uninterrupted run's
    ours, theirs = _final_state(run_dir), _final_state(whole_run)
    assert ours.keys() == theirs.keys() and "model.self_distill_head.centre" in ours
    assert "ema.self_distill_head.prototypes.weight" in ours
    worst_state = max(float((ours[key] - theirs[key]).abs().max()) for key in ours)
    print(f"weights, centre and average: worst absolute difference {worst_state:.1e}")
    assert worst_state <= 1e-5
    assert float(ours["model.self_distill_head.centre"].abs().max()) > 0  # the centre moved from its zeros


def _final_state(run_dir) -> dict[str, torch.Tensor]:
    """The newest checkpoint's model and weight average, every tensor by "model.<name>" / "ema.<name>"."""
    from clipdist.checkpoint.weights import find_checkpoint, read_dcp

    checkpoint = find_checkpoint(run_dir)
    assert checkpoint.name == f"step_{STEPS:08d}.dcp"
    parts = read_dcp(checkpoint, {"model", "ema"})
    return {f"{part}.{name}": tensor for part in ("model", "ema") for name, tensor in parts[part].items()}


def test_exports_and_evaluation_leave_the_head_out(whole_run, tmp_path, cache_dir, capsys):
    """`clipdist export` (the weights or their average) writes exactly the model's keys, and `clipdist eval` scores
    the run as it scores its export."""
    from clipdist.checkpoint.weights import read_weights
    from clipdist.cli import main as cli
    from clipdist.losses import build
    from clipdist.model.factory import create_model_for_loss

    evalset = f"val={cache_dir / 'digits' / 'val-000000.tar'}"
    for ema in ([], ["--ema"]):
        out = tmp_path / f"export{len(ema)}"
        assert cli(["export", str(whole_run), *ema, "--out", str(out)]) == 0
        weights = read_weights(out)
        assert not any(name.startswith("self_distill_head") for name in weights)
        create_model_for_loss("clipdist-tiny", build("siglip")).load_state_dict(weights)  # strict: the model's keys
        capsys.readouterr()
        scores = []
        for target in (whole_run, out):
            assert cli(["eval", str(target), *(ema if target == whole_run else []), "--set", evalset, "--json"]) == 0
            scores.append(json.loads(capsys.readouterr().out))
        assert scores[0] == scores[1]
