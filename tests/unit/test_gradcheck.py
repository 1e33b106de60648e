"""Model-level exactness under DDP, and proof that the harness catches the classic bugs."""

from __future__ import annotations

import pytest

from clipdist.tools.gradcheck import classify

PITFALLS = {
    "clipdist.tools.wrong_losses:rank_slice_gather": "1/N",
    "clipdist.tools.wrong_losses:overwrite_own_slice": "1/N",
    "clipdist.tools.wrong_losses:disco_average_backward": "1/N",
    "clipdist.tools.wrong_losses:local_loss_without_grad_gather": "wrong",
}


def test_classify_labels():
    import torch

    reference = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    assert classify(reference.clone(), reference, 4, 1e-9)[2] == "exact"
    assert classify(reference / 4, reference, 4, 1e-9)[2] == "1/N"
    assert classify(reference * 4, reference, 4, 1e-9)[2] == "N×"
    assert classify(reference * 3, reference, 4, 1e-9)[2] == "×3"
    assert classify(None, reference, 4, 1e-9)[2] == "missing"
    assert classify(torch.tensor([1.0, 0.0, 3.0], dtype=torch.float64), reference, 4, 1e-9)[2] == "wrong"


def test_a_model_with_a_logit_bias_and_a_softmax_backend_is_one_line_before_any_rank(capsys):
    """clipdist-maphead-tiny's config gives it SigLIP's logit bias: under --backend disco the check stops before
    spawning a rank, in one line naming both (it was a bug report from inside a rank)."""
    from clipdist.cli import main

    code = main(["gradcheck", "--model", "clipdist-maphead-tiny", "--backend", "disco", "--world", "2"])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(error) == 1, error
    assert "--backend disco: model clipdist-maphead-tiny has a logit bias" in error[0], error


ALIAS_BOMB = (
    "[&a0 [x, x, x, x, x, x, x, x, x, x]"
    + "".join(f", &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 8))
    + "]"
)
BAD_OPTIONS = [
    (["--backend", "tiled", "--option", "tile=abc"], "--option tile: Value 'abc'"),
    (["--backend", "tiled", "--option", "tile=true"], "--option tile: Value 'True' of type 'bool'"),
    (["--backend", "disco", "--option", "tile=3"], "loss.tile: an option of loss=tiled, loss=siglip, not of the"),
    (["--term", "self_distill", "--option", "self_distill.crops=-3"], "loss.self_distill.crops=-3: must be 0"),
    (["--term", "masked", "--option", "masked.ratio=5"], "loss.masked.ratio=5.0"),
    (["--term", "self_distill", "--option", "self_distill.crops=abc"], "--option self_distill.crops: Value"),
    (["--distill", "--option", "distill.weight=2"], "--option distill.…: the check's teacher is its own"),
    # ten aliases of ten aliases ...: 10^8 values once OmegaConf copies them out (a hang, then the memory)
    (["--backend", "tiled", "--option", "tile=" + ALIAS_BOMB], "expands to 123,456,789 values through its aliases"),
]


@pytest.mark.parametrize("argv, said", BAD_OPTIONS, ids=[" ".join(argv[-2:])[:40] for argv, _ in BAD_OPTIONS])
def test_options_are_read_as_train_reads_them_before_any_rank(capsys, monkeypatch, argv, said):
    """--option values typed and bounded by the run's own schema and checks (a string tile reached the backend's
    comparison as a traceback, a negative crop count a rank's bug report, a bool ran as 1): one line, no rank."""
    from clipdist.cli import main
    from clipdist.tools import gradcheck

    monkeypatch.setattr(gradcheck, "launch_local", lambda *a, **k: pytest.fail("a rank started"))
    code = main(["gradcheck", "--world", "2", *argv])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(error) == 1 and said in error[0], error


def test_options_reach_the_check_typed():
    from clipdist.tools.gradcheck import Terms, resolve_loss

    assert resolve_loss("tiled", {"tile": 3}).tile == 3
    (name, options), *_ = Terms.named(["self_distill"], {"self_distill.crops": 3}).own
    assert name == "self_distill" and options.crops == 3 and options.crop_size == 16  # the probe's, kept
