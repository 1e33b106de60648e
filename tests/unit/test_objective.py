"""The step's objective on one process: the contrastive backend plus CoCa's caption term, equal to open_clip's
CoCaLoss from the installed wheel (value and gradients); the loss weights checked before any rank starts."""

from __future__ import annotations

import pytest
import torch
from open_clip.loss import CoCaLoss

from clipdist.config import LossConfig
from clipdist.losses import build
from clipdist.model.factory import check_loss_weights
from clipdist.objective import build_objective


def coca_outputs(seed: int = 0, batch: int = 5, length: int = 7, vocab: int = 11):
    generator = torch.Generator().manual_seed(seed)
    features = [
        torch.nn.functional.normalize(torch.randn(batch, 8, generator=generator, dtype=torch.float64), dim=-1)
        for _ in range(2)
    ]
    labels = torch.randint(1, vocab, (batch, length), generator=generator)
    labels[:, 4:] = 0  # padding
    labels[0, 2:] = 0
    return {
        "image_features": features[0].requires_grad_(),
        "text_features": features[1].requires_grad_(),
        "logit_scale": torch.tensor(14.0, dtype=torch.float64, requires_grad=True),
        "logits": torch.randn(batch, length, vocab, generator=generator, dtype=torch.float64).requires_grad_(),
        "labels": labels,
    }


@pytest.mark.parametrize("weights", [(1.0, 2.0), (0.5, 1.0), (0.0, 2.0)])
def test_objective_equals_open_clip_coca_loss(weights):
    contrastive_weight, caption_weight = weights
    ours, theirs = coca_outputs(), coca_outputs()
    objective = build_objective(build("disco"), contrastive_weight=contrastive_weight, caption_weight=caption_weight)
    loss, terms = objective(objective.outputs(ours, {}))
    clip_part, caption_part = CoCaLoss(caption_loss_weight=caption_weight, clip_loss_weight=contrastive_weight)(
        theirs["image_features"], theirs["text_features"], theirs["logits"], theirs["labels"], theirs["logit_scale"]
    )
    reference = clip_part + caption_part
    assert loss.item() == pytest.approx(reference.item(), rel=1e-12)
    loss.backward()
    reference.backward()
    for key in ("image_features", "text_features", "logits"):
        want = theirs[key].grad if theirs[key].grad is not None else torch.zeros_like(ours[key])  # weight 0: none
        assert torch.allclose(ours[key].grad, want, rtol=1e-10, atol=1e-14), key
    if contrastive_weight:
        assert ours["logit_scale"].grad.item() == pytest.approx(theirs["logit_scale"].grad.item(), rel=1e-10)
    assert terms["caption_loss"].item() == pytest.approx(caption_part.item() / caption_weight, rel=1e-12)
    ours, theirs = coca_outputs(), coca_outputs()
    reference = objective.reference(ours, {})  # each term's own single-process definition
    assert reference.item() == pytest.approx(loss.item(), rel=1e-12)


def test_a_clip_model_output_is_the_backend_alone():
    features = coca_outputs()
    objective = build_objective(build("disco"))
    parts = objective.outputs((features["image_features"], features["text_features"], features["logit_scale"]), {})
    assert list(parts.parts) == ["contrastive_loss"]
    loss, terms = objective(parts)
    assert loss.item() == build("disco")(*parts.features).item() and terms == {}


@pytest.mark.parametrize(
    "model, weights, message",
    [
        ("clipdist-tiny", {"caption_weight": 1.0}, "has no text decoder"),
        ("clipdist-coca-tiny", {"contrastive_weight": -1.0}, "must be 0 or more"),
        ("clipdist-coca-tiny", {"contrastive_weight": 0.0, "caption_weight": 0.0}, "nothing to train"),
    ],
)
def test_bad_loss_weights_are_refused(model, weights, message):
    with pytest.raises(ValueError, match=message):
        check_loss_weights(LossConfig(**weights), model)
    check_loss_weights(LossConfig(), model)  # the defaults are fine for either


def test_a_coca_model_from_scratch_is_initialised_the_same_on_every_rank():
    """open_clip 3.3 leaves CoCa's decoder projection as torch.empty's memory; clipdist initialises it."""
    from clipdist.model.factory import create_model

    def built():
        torch.manual_seed(0)
        return create_model("clipdist-coca-tiny")

    first, second = built(), built()
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    projection = first.text_decoder.text_projection
    assert 0.05 < projection.std().item() < 0.2  # width 64: std 64^-0.5 = 0.125


@pytest.mark.parametrize(
    "teacher, message",
    [
        (
            "clipdist-timm-tiny",
            "loss.distill.model=clipdist-timm-tiny: its image size is (224, 224), the student's (32, 32)",
        ),
        ("no-such-model", "no-such-model"),
    ],
)
def test_a_teacher_that_cannot_see_the_students_inputs_is_refused_before_any_rank(
    tmp_path, capsys, monkeypatch, teacher, message
):
    from tests.helpers import refusal

    code, lines = refusal(capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", f"loss.distill.model={teacher}")
    assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_a_term_with_a_start_counts_from_its_step_on():
    """starts={name: s}: before step s the objective is the other terms alone (value and gradient), from s on the
    term is added; `at` names it once, at s, and depends on the step alone (a resume lands on the same sum)."""
    from clipdist.objective import Objective
    from clipdist.objective.caption import CaptionTerm
    from clipdist.objective.contrastive import ContrastiveTerm
    from clipdist.registry.terms import TermOptions, start_step

    raw = coca_outputs()
    terms = [(ContrastiveTerm(build("naive")), 1.0), (CaptionTerm(0), 2.0)]
    objective = Objective(terms, starts={"caption_loss": 3})
    contrastive_only = build_objective(build("naive"))
    full = build_objective(build("naive"), caption_weight=2.0)
    said = [objective.at(step) for step in range(1, 6)]
    assert said == [[], [], ["caption_loss"], [], []]
    for step, reference in [(2, contrastive_only), (3, full), (5, full), (1, contrastive_only)]:
        objective.at(step)
        loss, _ = objective(objective.outputs(raw, {}))
        expected, _ = reference(reference.outputs(raw, {}))
        assert torch.equal(loss, expected), step
    assert [start_step(TermOptions(start_at=fraction), 100) for fraction in (0.0, 0.8, 0.005, 0.999)] == [1, 81, 2, 101]
