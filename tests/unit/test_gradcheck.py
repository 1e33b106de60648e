"""Model-level exactness under DDP, and proof that the harness catches the classic bugs."""

from __future__ import annotations

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
