"""Model-level exactness under DDP, and proof that the harness catches the classic bugs."""

from __future__ import annotations

import json

import pytest

from clipdist.losses import BACKENDS
from clipdist.tools.gradcheck import run_gradchecks

PITFALLS = {
    "clipdist.tools.wrong_losses:rank_slice_gather": "1/N",
    "clipdist.tools.wrong_losses:overwrite_own_slice": "1/N",
    "clipdist.tools.wrong_losses:disco_average_backward": "1/N",
    "clipdist.tools.wrong_losses:local_loss_without_grad_gather": "wrong",
}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_backend_gives_ddp_the_single_process_gradients(world_size):
    reports = run_gradchecks(list(BACKENDS), world_size, local_batch=3)
    for report in reports:
        assert report.exact, (report.backend, report.max_rel_err, report.diagnosis)
        assert report.max_rel_err < 1e-9
        assert len(report.parameters) > 50  # every parameter of both towers and the logit scale


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_locked_towers_and_the_fp16_scaler_keep_every_backend_exact(parallel):
    """What precision=fp16 and model.lock_* change in the step (the loss scaled, the gradients unscaled once after
    the last chunk; locked parameters out of the graph), at unequal batches with gradient caching."""
    reports = run_gradchecks(
        list(BACKENDS), 3, local_batch=[4, 3, 5], chunks=2, parallel=parallel, lock_image=1, lock_text=0, scaler=True
    )
    for report in reports:
        assert report.exact, (report.backend, report.max_rel_err, report.diagnosis)
        locked = [check for check in report.parameters if check.name.startswith("visual.conv1")]
        assert report.locked_parameters > 30 and locked and report.scaler
    fully_locked = run_gradchecks(["disco"], 2, lock_image=0)[0]  # the whole image tower: no backward through it
    assert fully_locked.exact
    assert fully_locked.locked_parameters == sum(check.name.startswith("visual.") for check in fully_locked.parameters)


def test_unequal_local_batches_are_exact_under_ddp():
    for report in run_gradchecks(list(BACKENDS), 3, local_batch=[2, 5, 3]):
        assert report.exact, (report.backend, report.diagnosis)


@pytest.fixture(scope="module")
def pitfall_reports():
    specs = list(PITFALLS) + ["clipdist.tools.wrong_losses:loss_times_world_size"]
    return {r.backend: r for r in run_gradchecks(specs, 2, local_batch=3)}


@pytest.mark.parametrize("spec", list(PITFALLS))
def test_harness_reports_the_classic_bugs(pitfall_reports, spec):
    report = pitfall_reports[spec]
    assert not report.exact
    encoder_verdicts = {c.verdict for c in report.parameters if c.name != "logit_scale"}
    assert encoder_verdicts == {PITFALLS[spec]}, encoder_verdicts
    if PITFALLS[spec] == "1/N":
        ratios = [c.ratio for c in report.parameters if c.name != "logit_scale"]
        assert all(abs(r - 0.5) < 1e-9 for r in ratios)
        assert any("1/N" in note for note in report.diagnosis)
    else:
        assert any("terms are dropped" in note for note in report.diagnosis)


def test_cli_json_and_exit_codes(capsys):
    from clipdist.cli import main

    assert main(["gradcheck", "--backend", "gather_layer", "--world", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "gather_layer" and report["world_size"] == 2 and report["exact"] is True
    assert report["max_rel_err"] < 1e-9

    assert main(["gradcheck", "--loss", "clipdist.tools.wrong_losses:rank_slice_gather", "--world", "2"]) == 1
    out = capsys.readouterr().out
    assert "NOT EXACT" in out and "1/N" in out

    assert main(["gradcheck", "--backend", "nope"]) == 2
    assert "unknown loss backend 'nope'" in capsys.readouterr().err


def test_harness_reports_the_logit_scale_trap(pitfall_reports):
    report = pitfall_reports["clipdist.tools.wrong_losses:loss_times_world_size"]
    verdicts = {c.name: c.verdict for c in report.parameters}
    assert verdicts.pop("logit_scale") == "N×"
    assert set(verdicts.values()) == {"exact"}
    assert any("logit_scale: N×" in note for note in report.diagnosis)
