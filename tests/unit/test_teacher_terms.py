"""The terms against the EMA teacher (loss.self_distill, loss.masked) on one process: their checks before any rank
starts, the head put on the model, the centre that moves only after an optimizer step, the zero touch that keeps
DDP's every-parameter rule before a term's start, and the masked student's mask token."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from clipdist.config import TrainConfig, validate
from clipdist.errors import ConfigError
from clipdist.losses import build
from clipdist.model.factory import create_model, create_model_for_loss
from clipdist.objective import Objective
from clipdist.objective.base import TermContext
from clipdist.objective.contrastive import ContrastiveTerm
from clipdist.objective.decoder import attach as attach_decoder
from clipdist.objective.self_distill import SelfDistillTerm, attach
from clipdist.objective.teacher import EmaTeacher
from clipdist.registry.terms import SelfDistillOptions, training_only

OPTIONS = SelfDistillOptions(crops=2, crop_size=16, hidden=16, bottleneck=8, prototypes=12)


def config() -> TrainConfig:
    cfg = TrainConfig()
    cfg.data.source = "digits"
    cfg.loss.self_distill.crops = 2
    cfg.optim.ema.decay = 0.99
    return cfg


def no_average(cfg):
    cfg.optim.ema.decay = 0.0


def upside_down(cfg):
    cfg.loss.self_distill.scale = [0.5, 0.1]


def frozen(cfg):
    cfg.loss.self_distill.teacher_temp = 0.0


def masked_alone(cfg):
    cfg.loss.self_distill.crops = 0
    cfg.loss.masked.ratio = 0.5
    cfg.optim.ema.decay = 0.0


def all_masked(cfg):
    cfg.loss.masked.ratio = 1.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (no_average, "needs a teacher: the weights' average, optim.ema.decay"),
        (upside_down, "loss.self_distill.scale=[0.5, 0.1]"),
        (frozen, "temperatures must be above 0"),
        (masked_alone, "loss.masked needs a teacher"),
        (all_masked, "loss.masked.ratio=1.0"),
    ],
)
def test_what_the_term_cannot_train_with_is_refused_by_the_config_checks(change, message):
    validate(config())  # the term with an average: accepted
    cfg = config()
    change(cfg)
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    assert message in str(refused.value)


def student(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = create_model_for_loss("clipdist-tiny", build("disco")).double()
    assert attach(OPTIONS, model)
    return model


def test_the_head_is_a_module_of_the_model_and_a_training_only_part():
    model = student()
    names = [name for name, _ in model.named_parameters() if name.startswith("self_distill_head.")]
    assert len(names) == 5 and all(training_only(name) for name in names)
    assert "self_distill_head.centre" in model.state_dict() and not training_only("visual.proj")
    assert not attach(SelfDistillOptions(), create_model("clipdist-tiny"))  # crops=0: off, nothing added
    bad = dataclasses.replace(OPTIONS, crop_size=24)
    with pytest.raises(ConfigError, match="crop_size=24: a NaFlex tower's views are grids of its 16-pixel patches"):
        attach(bad, create_model("clipdist-naflex-tiny"))
    assert attach(OPTIONS, create_model("clipdist-naflex-tiny"))  # a grid of one patch a view
    with pytest.raises(ConfigError, match="crop_size=40: local views larger than the 32-pixel images"):
        attach(dataclasses.replace(OPTIONS, crop_size=40), create_model("clipdist-tiny"))
    naflex = create_model("clipdist-naflex-tiny")
    assert attach(SelfDistillOptions(crops=2, hidden=16, bottleneck=8, prototypes=12), naflex)
    assert naflex.self_distill_head.mlp[0].in_features == 64


def batch_inputs(rows: int = 3) -> dict:
    generator = torch.Generator().manual_seed(5)
    return {"image": torch.randn(rows, 3, 32, 32, generator=generator, dtype=torch.float64)}


def test_the_centre_moves_by_its_momentum_after_a_step_only():
    model = student()
    teacher = {name: tensor.detach() + 0.01 for name, tensor in student(1).named_parameters()}
    term = SelfDistillTerm(model, EmaTeacher(model, lambda: teacher), OPTIONS)
    inputs = batch_inputs()
    part = term.merge([term.take(None, inputs)])
    assert torch.equal(model.self_distill_head.centre, torch.zeros(12, dtype=torch.float64))  # not in the forward
    mean = term.targets(inputs["image"]).mean(0)
    term.commit()
    torch.testing.assert_close(model.self_distill_head.centre, 0.1 * mean, rtol=1e-12, atol=1e-15)
    term.commit()  # nothing pending: unchanged
    torch.testing.assert_close(model.self_distill_head.centre, 0.1 * mean, rtol=1e-12, atol=1e-15)
    assert float(part.per_row) == 1 / 3


def test_before_its_start_the_head_gets_zero_gradients_and_the_loss_is_the_others():
    model = student()
    teacher = {name: tensor.detach() for name, tensor in model.named_parameters()}
    term = SelfDistillTerm(model, EmaTeacher(model, lambda: teacher), OPTIONS)
    objective = Objective([(ContrastiveTerm(build("naive")), 1.0), (term, 1.0)], starts={term.name: 3})
    inputs = {**batch_inputs(), "text": torch.randint(1, 100, (3, 16))}
    for step, counted in ((2, False), (3, True)):
        model.zero_grad(set_to_none=True)
        objective.at(step)
        loss, terms = objective(objective.outputs(model(**inputs), inputs))
        loss.backward()
        head = [p.grad for p in model.self_distill_head.parameters()]
        assert all(grad is not None for grad in head)
        assert any(bool(grad.abs().sum() > 0) for grad in head) == counted
        assert ("self_distill_loss" in terms) == counted


def test_the_masked_student_sees_the_mask_token_at_its_masked_patches_only():
    """tokens_out: the tower gives its per-patch tokens inside, its own output after; a masked patch's embedding is
    the token (so the image under it does not matter), an unmasked patch's is the image's."""
    from clipdist.objective.masked import MaskedHead, masked_tokens
    from clipdist.objective.teacher import tokens_out
    from clipdist.registry.terms import MaskedOptions

    model = create_model("clipdist-tiny").double()
    visual = model.visual
    images = batch_inputs(2)["image"]
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[:, :8] = True  # the top half of the 4×4 grid
    head = MaskedHead(64, MaskedOptions(ratio=0.5)).double()
    torch.nn.init.normal_(head.mask_token)
    changed = images.clone()
    changed[..., :16, :] = 0.0  # other pixels under the masked patches only
    with masked_tokens(visual, mask, head):
        first, second = visual(images)[1], visual(changed)[1]
    assert torch.equal(first, second)
    with tokens_out(visual):
        whole, other = visual(images)[1], visual(changed)[1]
    assert whole.shape == (2, 16, 64) and not torch.equal(whole, other)
    assert not visual.output_tokens and not visual.conv1._forward_hooks and visual(images).shape == (2, 64)


def decoded_model():
    from clipdist.registry.terms import DecoderOptions

    torch.manual_seed(0)
    model = create_model("clipdist-tiny").double()
    options = DecoderOptions(layers=2, width=32, heads=2, parallel=0.5)
    assert attach_decoder(options, model)
    return model, options


def test_the_decoder_reads_the_forwards_own_patch_tokens_and_ignores_padding():
    """The hook keeps the contrastive forward's patch tokens (not a later tower call's); a caption's logits do not
    change when the batch's padding is cut (data.trim_text), either way of predicting."""
    from clipdist.objective.teacher import tokens_out

    model, _ = decoded_model()
    images = batch_inputs(2)["image"]
    text = torch.zeros(2, 16, dtype=torch.long)
    text[0, :6], text[1, :4] = torch.arange(1, 7), torch.arange(9, 13)
    model(image=images, text=text)
    model.visual(images[:1])  # another call of the tower: not the forward's
    with tokens_out(model.visual):
        expected = model.visual(images)[1]
    patches = model.patch_tokens.take()
    assert torch.equal(patches, expected)
    for parallel in ([True, True], [False, False], [True, False]):
        ways = torch.tensor(parallel)
        whole = model.caption_decoder(patches, text, ways)
        cut = model.caption_decoder(patches, text[:, :7], ways)
        torch.testing.assert_close(cut[0, :5], whole[0, :5], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(cut[1, :3], whole[1, :3], rtol=1e-12, atol=1e-12)
        for row in range(2):  # each row as it would be alone: its own way, its own mask
            alone = model.caption_decoder(patches[row : row + 1], text[row : row + 1], ways[row : row + 1])
            torch.testing.assert_close(alone[0], whole[row], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(whole[0], model.caption_decoder(patches, text, ~ways)[0])  # the ways differ
    with pytest.raises(RuntimeError, match="no patch tokens"):
        model.patch_tokens.take()


def test_each_sample_is_predicted_one_way_drawn_by_its_pixels_and_the_step():
    from clipdist.objective.decoder import DecoderTerm

    model, options = decoded_model()
    term = DecoderTerm(model, options)
    images = batch_inputs(40)["image"]
    term.step = 7
    chosen = term.in_parallel(images)
    assert 8 < int(chosen.sum()) < 32  # about half
    assert torch.equal(term.in_parallel(images[10:]), chosen[10:])  # another rank's rows
    term.step = 8
    assert not torch.equal(term.in_parallel(images), chosen)


def test_a_run_with_every_term_builds_them_in_order_and_still_cuts_its_captions():
    """build_parts as a rank does: the three terms after the contrastive one, their modules on the model, the average
    kept; captions still cut to the batch's longest in fp32 (no term holds a teacher model whose text tower would
    have to take short text)."""
    from clipdist.train.parts import build_parts

    cfg = config()
    cfg.loss.masked.ratio, cfg.loss.decoder.layers = 0.5, 1
    parts = build_parts(cfg, torch.device("cpu"))
    names = [term.name for term, _ in parts.step.objective.terms]
    assert names == ["contrastive_loss", "self_distill_loss", "masked_loss", "decoder_loss"]
    assert parts.ema is not None and parts.step.trim_text
    assert all(hasattr(parts.model, part) for part in ("self_distill_head", "masked_head", "caption_decoder"))


def parts_and_stand_in(cfg) -> tuple:
    """The run's parts built from `cfg` on the CPU, and the stand-in batch a rank of two would step on."""
    from types import SimpleNamespace

    from clipdist.train.parts import build_parts
    from clipdist.train.startup import stand_in_batch

    parts = build_parts(cfg, torch.device("cpu"))
    trainer = SimpleNamespace(
        stream=SimpleNamespace(global_batch=6),
        env=SimpleNamespace(world_size=2),
        model=parts.model,
        tokenizer=parts.tokenizer,
        shards=SimpleNamespace(sources=[None]),
    )
    return parts, stand_in_batch(trainer)


def test_the_stand_in_batch_of_a_stop_while_waiting_for_data_goes_through_every_term():
    """A stop signal while a rank waits for data has it step on a stand-in batch (its agreement then stops every
    rank). Its captions are the tokenizer's empty caption, so a step that cuts captions to the batch's longest still
    leaves the decoder a token to predict (zeros, cut to one column, made the decoder fail on that rank)."""
    cfg = config()
    cfg.loss.masked.ratio, cfg.loss.decoder.layers = 0.5, 1
    parts, batch = parts_and_stand_in(cfg)
    assert batch["text"].shape == (3, parts.tokenizer.context_length) and not any(batch.counts)
    assert parts.step.trim_text and parts.step.inputs(batch)["text"].shape[1] == 2  # start and end of text
    terms = [term for term, _ in parts.step.objective.terms if hasattr(term, "ema_teacher")]
    teacher = terms[0].ema_teacher
    assert len(terms) == 2 and terms[1].ema_teacher is teacher  # one teacher for both terms
    calls = []
    teacher.plain.visual.register_forward_hook(lambda *_: calls.append(1))
    for step, forwards in ((1, 1), (2, 2)):
        parts.step.objective.at(step)
        loss = parts.step.gradients(batch)
        assert torch.isfinite(loss)
        assert len(calls) == forwards  # the teacher's image forward once a step for both terms
        assert teacher.last is None and teacher.view is None  # not held through backward


def test_the_teacher_and_the_masked_student_see_one_augmented_global_view_the_contrastive_term_does_not():
    """With augment (the default), the teacher's image forward and the masked student's take each image's global
    view (views.global_views: one for both terms, a crop resized back, flipped, colour-jittered, grayed, blurred),
    the model's own forward the images as they are; without, all three the images."""
    from clipdist.data.views import global_views

    for augment in (True, False):
        cfg = config()
        cfg.loss.masked.ratio, cfg.loss.self_distill.augment, cfg.loss.masked.augment = 0.5, augment, augment
        parts, batch = parts_and_stand_in(cfg)
        batch.inputs["image"] = torch.rand(batch["image"].shape, generator=torch.Generator().manual_seed(1))
        terms = [term for term, _ in parts.step.objective.terms if hasattr(term, "ema_teacher")]
        teacher_saw: list[torch.Tensor] = []
        student_saw: list[torch.Tensor] = []
        terms[0].ema_teacher.plain.visual.register_forward_pre_hook(lambda m, args, to=teacher_saw: to.append(args[0]))
        parts.model.visual.register_forward_pre_hook(lambda m, args, to=student_saw: to.append(args[0]))
        parts.step.objective.at(1)
        parts.step.gradients(batch)
        images = parts.step.inputs(batch)["image"]
        full = [view for view in student_saw if view.shape == images.shape]  # not the local views
        assert len(teacher_saw) == 1 and len(full) == 2  # the masked student's (own terms first), the model's
        how = terms[0].augmentation(images)
        expected = global_views(images, seed=cfg.seed, step=1, augmentation=how) if augment else images
        assert torch.equal(teacher_saw[0], expected)
        assert torch.equal(full[0], expected) and torch.equal(full[1], images)
        assert augment == (not torch.equal(expected, images))


def test_on_a_naflex_tower_the_teacher_and_the_masked_student_see_each_images_global_view():
    """With augment, a NaFlex batch's teacher and masked student see each image's global view in its own patches'
    places (views.global_patch_views: one for both), its padding as it was; without, the loader's patches."""
    from clipdist.data.views import global_patch_views
    from clipdist.model.timm_towers import naflex_patch_size, random_patches
    from clipdist.objective.masked import MaskedTerm
    from clipdist.objective.masked import attach as attach_masked
    from clipdist.registry.terms import MaskedOptions

    for augment in (True, False):
        torch.manual_seed(0)
        model = create_model("clipdist-naflex-tiny").double().eval()
        options = MaskedOptions(ratio=0.5, hidden=16, bottleneck=8, prototypes=12, augment=augment)
        assert attach_masked(options, model)
        weights = {name: tensor.detach() + 0.01 for name, tensor in model.named_parameters()}
        term = MaskedTerm(model, EmaTeacher(model, lambda weights=weights: weights), options, seed=7)
        term.step = 4
        images = random_patches(5, 16, 12, torch.Generator().manual_seed(2), torch.float64)
        teacher_saw: list[dict] = []
        student_saw: list[dict] = []
        term.ema_teacher.plain.visual.register_forward_pre_hook(lambda m, args, to=teacher_saw: to.append(args[0]))
        model.visual.register_forward_pre_hook(lambda m, args, to=student_saw: to.append(args[0]))
        term.rows(images)
        patch = naflex_patch_size(model)
        expected = (
            global_patch_views(images, patch_size=patch, seed=7, step=4, augmentation=term.augmentation(images))
            if augment
            else images
        )
        assert len(teacher_saw) == len(student_saw) == 1
        for saw in (teacher_saw[0], student_saw[0]):
            assert torch.equal(saw["patches"], expected["patches"])
            assert torch.equal(saw["patch_coord"], images["patch_coord"])
        valid = images["patch_valid"]
        assert augment == (not torch.equal(expected["patches"][valid], images["patches"][valid]))
        assert torch.equal(expected["patches"][~valid], images["patches"][~valid])


def naflex_padded(images: dict, extra: int) -> dict:
    """The same NaFlex batch with `extra` more padding patches a row."""
    rows = len(images["patches"])
    return {
        "patches": torch.cat(
            [images["patches"], images["patches"].new_zeros(rows, extra, images["patches"].shape[2])], 1
        ),
        "patch_coord": torch.cat([images["patch_coord"], torch.zeros(rows, extra, 2, dtype=torch.long)], 1),
        "patch_valid": torch.cat([images["patch_valid"], torch.zeros(rows, extra, dtype=torch.bool)], 1),
    }


def test_on_a_naflex_tower_masked_prediction_masks_each_rows_own_patches_whatever_the_padding():
    """loss.masked on a NaFlex tower: round(ratio · n) of a row's n patches masked (never its padding), the mask token
    put in after the patch projection; a row's loss and the teacher's outputs the centre averages do not depend on the
    padding its batch gave it."""
    from clipdist.model.timm_towers import random_patches
    from clipdist.objective.masked import MaskedTerm
    from clipdist.objective.masked import attach as attach_masked
    from clipdist.registry.terms import MaskedOptions

    torch.manual_seed(0)
    model = create_model("clipdist-naflex-tiny").double().eval()
    options = MaskedOptions(ratio=0.5, hidden=16, bottleneck=8, prototypes=12)
    assert attach_masked(options, model)
    torch.nn.init.normal_(model.masked_head.mask_token)
    weights = {name: tensor.detach() + 0.01 for name, tensor in model.named_parameters()}
    term = MaskedTerm(model, EmaTeacher(model, lambda: weights), options)
    term.step = 4
    images = random_patches(5, 16, 12, torch.Generator().manual_seed(2), torch.float64)
    _, _, mask, own = term.outputs(images)
    counts = images["patch_valid"].sum(1)
    assert torch.equal(own, images["patch_valid"]) and not (mask & ~own).any()
    assert mask.sum(1).tolist() == [max(1, round(0.5 * int(n))) for n in counts]
    losses, teacher, _ = term.rows(images)
    padded_losses, padded_teacher, _ = term.rows(naflex_padded(images, 4))
    assert len(teacher) == int(counts.sum())
    torch.testing.assert_close(padded_losses, losses, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(padded_teacher, teacher, rtol=1e-10, atol=1e-12)


def test_on_a_naflex_tower_a_captions_logits_do_not_depend_on_its_batchs_padding():
    """loss.decoder on a NaFlex tower: the trunk's patch tokens (its prefix tokens dropped), the batch's padding
    patches masked out of the cross-attention; the same sample padded further gets the same logits and the same way
    of being predicted (its key: the padding adds nothing)."""
    from clipdist.model.timm_towers import random_patches
    from clipdist.objective.decoder import DecoderTerm
    from clipdist.registry.terms import DecoderOptions

    torch.manual_seed(0)
    model = create_model("clipdist-naflex-tiny").double().eval()
    options = DecoderOptions(layers=1, width=32, heads=2, parallel=0.5)
    assert attach_decoder(options, model)
    term = DecoderTerm(model, options)
    term.step = 3
    generator = torch.Generator().manual_seed(1)
    images = random_patches(4, 16, 12, generator, torch.float64)
    text = torch.zeros(4, model.context_length, dtype=torch.long)
    text[:, :10] = torch.randint(1, 100, (4, 10), generator=generator)

    def logits(images):
        model(image=images, text=text)
        return term.logits_and_labels({"image": images, "text": text})[0]

    padded = naflex_padded(images, 5)
    assert not images["patch_valid"].all()  # rows of other lengths: padded already
    assert torch.equal(term.in_parallel(padded), term.in_parallel(images))
    torch.testing.assert_close(logits(padded), logits(images), rtol=1e-10, atol=1e-10)


def test_a_narrow_cone_of_embeddings_still_gives_each_image_a_target_of_its_own():
    """A contrastive tower's embeddings share one direction (cosine 0.996 between the tiny model's images): through
    the head as they are, every image gets the same output, and the centring turns that one target into the
    uniform one (entropy ln P: the collapse the logs showed). Once the head's input moments follow the teacher's
    embeddings (Head.follow, after a step), each image has a sharp target of its own."""
    from clipdist.objective.teacher import Head, entropy

    torch.manual_seed(0)
    options = SelfDistillOptions(crops=2, hidden=32, bottleneck=16, prototypes=64)
    head = Head(8, options).double()
    cone = 10 * torch.randn(8, dtype=torch.float64) + 0.05 * torch.randn(256, 8, dtype=torch.float64)
    assert F.cosine_similarity(cone[:128], cone[128:]).min() > 0.99

    def target_entropy() -> float:
        with torch.no_grad():
            outputs = head(cone)
            targets = torch.softmax((outputs - outputs.mean(0)) / options.teacher_temp, dim=-1)
        return entropy(targets).mean().item()

    uniform = math.log(options.prototypes)
    assert target_entropy() > 0.99 * uniform  # one target for all, centred away
    head.follow(torch.cat([cone.new_tensor([len(cone)]), cone.sum(0), (cone * cone).sum(0)]), 0.9)
    assert target_entropy() < 0.75 * uniform


def test_the_decoders_cross_entropy_in_chunks_equals_the_whole_logits(monkeypatch):
    """CaptionDecoder.cross_entropy makes the vocabulary's logits a few rows at a time, and again in backward: its sum
    and every gradient equal the cross-entropy over the whole (b, L−1, vocab) logits."""
    from clipdist.objective import decoder as decoder_module
    from clipdist.registry.terms import DecoderOptions

    torch.manual_seed(0)
    decoder = decoder_module.CaptionDecoder(8, 50, 7, DecoderOptions(layers=1, width=8, heads=2)).double()
    patches = torch.randn(3, 4, 8, dtype=torch.float64)
    text = torch.tensor([[1, 5, 6, 7, 0, 0, 0], [1, 9, 8, 0, 0, 0, 0], [1, 3, 4, 5, 6, 7, 8]])
    parallel = torch.tensor([False, True, False])

    def gradients(loss):
        decoder.zero_grad()
        loss.backward()
        return [parameter.grad.clone() for parameter in decoder.parameters()]

    logits = decoder(patches, text, parallel)
    whole = F.cross_entropy(logits.flatten(0, 1), text[:, 1:].flatten(), ignore_index=0, reduction="sum")
    want = gradients(whole)
    monkeypatch.setattr(decoder_module, "CHUNK_LOGITS", 50 * 2)  # two rows of logits at a time: 6 chunks
    total, count = decoder.cross_entropy(patches, text, parallel)
    assert count == 11 and torch.allclose(total, whole, rtol=1e-12)
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-14) for a, b in zip(gradients(total), want))


def test_the_teacher_terms_weights_follow_the_papers_size_factor_where_asked():
    """SigLIP 2 weighs its teacher terms by model size (B 0.25, L 0.5, So400m 1, g 0.5): `by_size` reads it from the
    image tower's width; off, the weight is as given."""
    from clipdist.registry.terms import size_factor

    assert [size_factor(width) for width in (64, 768, 1024, 1152, 1536, 2048)] == [0.25, 0.25, 0.5, 1.0, 0.5, 0.5]
    assert OPTIONS.factor(1024) == 1.0
    assert SelfDistillOptions(crops=2, by_size=True).factor(1024) == 0.5


@pytest.mark.parametrize("term", ["self_distill", "masked"])
def test_a_tower_the_teacher_terms_cannot_take_is_refused_in_one_line(term):
    """A tower that is no ViT (open_clip's ResNet) cannot take the teacher terms: refused before any rank starts, in
    one line that names the tower, never a traceback."""
    from clipdist.objective.weighted_sum import attach_parts

    cfg = TrainConfig()
    cfg.loss.self_distill.crops, cfg.loss.masked.ratio = (2, 0.0) if term == "self_distill" else (0, 0.5)
    resnet = create_model("clipdist-tiny", overrides={"vision_cfg": {"layers": [1, 1, 1, 1], "width": 16}})
    with pytest.raises(ConfigError, match=f"loss.{term} needs .*ViT.*this model's is ModifiedResNet"):
        attach_parts(cfg.loss, resnet)


def test_a_map_head_tower_takes_the_teacher_terms_on_its_tokens_before_the_pooling_head():
    """SigLIP 2's own tower (a timm ViT whose pooling is an attention head): self-distillation's head reads its pooled
    output, masked prediction its tokens before the pooling head, the mask token at the patch embedding's output;
    its local views at SILC's size go through timm's dynamic size mode (test_flexible_grid)."""
    from clipdist.objective.masked import masked_tokens
    from clipdist.objective.teacher import tokens_out
    from clipdist.objective.weighted_sum import attach_parts

    torch.manual_seed(0)
    model = create_model("clipdist-maphead-tiny").double()
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    before = model.visual(images)
    cfg = TrainConfig()
    cfg.loss.self_distill.crops, cfg.loss.masked.ratio = 2, 0.5
    attach_parts(cfg.loss, model)
    assert model.visual(images[:, :, :16, :16]).shape == before.shape  # a 16-pixel view: 2 × 2 patches
    assert model.self_distill_head.mlp[0].in_features == before.shape[1]
    with tokens_out(model.visual):
        pooled, tokens = model.visual(images)
    assert torch.equal(pooled, before) and tokens.shape == (2, 16, 64)  # 4 × 4 patches, no class token
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[:, :3] = True
    with masked_tokens(model.visual, mask, model.masked_head):
        _, masked = model.visual(images)
    other = images.clone()
    other[:, :, :8, :24] = 0  # the three masked patches' pixels: not seen
    with masked_tokens(model.visual, mask, model.masked_head):
        _, again = model.visual(other)
    assert torch.equal(masked, again) and not torch.equal(masked, tokens)


def test_at_its_start_a_terms_own_modules_get_fresh_optimizer_state():
    """SigLIP 2 §2.3: the heads are fresh when the teacher terms start. At that step (Objective.at) the head's Adam
    step count and moments are zero again, as a new optimizer's; every other parameter's state is left alone."""
    from clipdist.train.step import Step

    model = student()
    teacher = {name: tensor.detach() for name, tensor in model.named_parameters()}
    term = SelfDistillTerm(model, EmaTeacher(model, lambda: teacher), OPTIONS)
    objective = Objective([(ContrastiveTerm(build("naive")), 1.0), (term, 1.0)], starts={term.name: 3})
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    step = Step(model, objective, optimizer)
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    optimizer.step()
    step.start_terms(objective.at(2))  # nothing starts at step 2
    step.start_terms(objective.at(3))
    head = {id(parameter) for parameter in model.self_distill_head.parameters()}
    for parameter in model.parameters():
        state = optimizer.state[parameter]
        fresh = id(parameter) in head
        assert float(state["step"]) == (0 if fresh else 2)
        assert bool(state["exp_avg"].abs().sum() == 0) == fresh and bool(state["exp_avg_sq"].abs().sum() == 0) == fresh


def test_the_heads_start_as_dinos_and_learn_at_head_lr_times_the_runs_rate_layer_decay_and_all():
    """The recipe's heads (loss.<term>.head_lr): their parameters' lr is head_lr × the run's, through the schedule
    and beside the towers' layer decay; the MLP starts as DINO's (σ 0.02, zero biases)."""
    from clipdist.objective.masked import attach as attach_masked
    from clipdist.optim.optimizer import build_optimizer
    from clipdist.registry.terms import part_lr_scales

    cfg = config()
    cfg.loss.self_distill.head_lr, cfg.loss.masked.ratio, cfg.loss.masked.head_lr = 10.0, 0.5, 3.0
    cfg.optim.lr, cfg.optim.image_layer_decay, cfg.optim.warmup_steps = 1e-3, 0.5, 0
    torch.manual_seed(0)
    model = create_model("clipdist-tiny")
    assert attach(cfg.loss.self_distill, model) and attach_masked(cfg.loss.masked, model)
    head = model.self_distill_head
    for layer in (head.mlp[0], head.mlp[2]):
        assert layer.weight.std().item() == pytest.approx(0.02, rel=0.1) and not layer.bias.any()
    assert part_lr_scales(cfg.loss) == {"self_distill_head": 10.0, "masked_head": 3.0}
    optimizer, scheduler = build_optimizer(model, cfg.optim, part_lr_scales(cfg.loss))
    base = {id(param): group["initial_lr"] for group in optimizer.param_groups for param in group["params"]}
    for name, param in model.named_parameters():
        part = name.split(".", 1)[0]
        expected = {"self_distill_head": 1e-2, "masked_head": 3e-3}.get(part)
        if expected is not None:
            assert base[id(param)] == pytest.approx(expected), name
    assert base[id(model.text_projection)] == pytest.approx(1e-3)
    assert base[id(model.visual.transformer.resblocks[-1].mlp.c_fc.weight)] == pytest.approx(5e-4)  # the decay's
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    rates = {id(param): group["lr"] for group in optimizer.param_groups for param in group["params"]}
    factor = rates[id(model.text_projection)] / 1e-3
    assert 0 < factor < 1 and rates[id(head.prototypes.weight)] == pytest.approx(1e-2 * factor)


def test_a_timm_vit_that_cannot_take_other_sizes_is_told_its_crop_size(tmp_path):
    """A timm ViT trunk other than timm's VisionTransformer (Eva) takes the terms at its own size: its patch is read
    from its trunk, and views of another size are refused in one line that says which crop_size it takes."""
    import json

    import clipdist

    cfg = json.loads((Path(clipdist.__file__).parent / "model_configs" / "clipdist-maphead-tiny.json").read_text())
    cfg["vision_cfg"].update(timm_model_name="eva02_tiny_patch14_224", timm_pool="avg")
    cfg["vision_cfg"]["timm_model_kwargs"]["depth"] = 1
    (tmp_path / "eva-tiny.json").write_text(json.dumps(cfg))
    model = create_model(str(tmp_path / "eva-tiny.json"))
    assert type(model.visual.trunk).__name__ == "Eva"
    with pytest.raises(ConfigError, match="its views are 16 pixels.*set loss.self_distill.crop_size=32"):
        attach(SelfDistillOptions(crops=2), model)
    assert attach(SelfDistillOptions(crops=2, crop_size=32), model)


def test_the_decoder_is_the_text_towers_shape_with_half_its_layers_unless_told(monkeypatch):
    """SigLIP 2's decoder (§2.2): the text encoder's width and heads, half its layers (depth=0.5, one at least);
    `layers`, `width` and `heads` override; a text tower that is not open_clip's needs `layers` in one line."""
    from clipdist.objective import decoder as decoder_module
    from clipdist.registry.terms import DecoderOptions

    tiny = create_model("clipdist-tiny")  # text: 2 layers, width 64, 2 heads
    shape = decoder_module.decoder_shape(DecoderOptions(depth=0.5), tiny, 64)
    assert (shape.layers, shape.width, shape.heads) == (1, 64, 2)
    told = decoder_module.decoder_shape(DecoderOptions(depth=0.5, layers=3, width=32, heads=4), tiny, 64)
    assert (told.layers, told.width, told.heads) == (3, 32, 4)
    assert decoder_module.attach(DecoderOptions(depth=1.0), tiny)
    assert len(tiny.caption_decoder.blocks) == 2 and tiny.caption_decoder.logits.in_features == 64
    term = decoder_module.build(DecoderOptions(depth=1.0), TermContext(tiny))
    assert term is not None and term.shape == "2 layer(s), width 64, 2 heads"  # what the banner says
    monkeypatch.setattr(decoder_module, "text_shape", lambda model: None)
    with pytest.raises(ConfigError, match=r"depth=0.5 takes a fraction.*give loss.decoder.layers"):
        decoder_module.decoder_shape(DecoderOptions(depth=0.5), tiny, 64)
    other = decoder_module.decoder_shape(DecoderOptions(layers=2), tiny, 48)
    assert (other.layers, other.width, other.heads) == (2, 48, 8)  # the image tower's width, 8 heads
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=f"depth={bad}: give a fraction"):
            DecoderOptions(depth=bad).check("decoder", None)


def test_the_signal_watch_warns_once_for_each_term_whose_targets_fall_below_a_floor():
    from clipdist.objective.signal import ENTROPY_FLOOR, INFORMATION_FLOOR, SignalWatch

    watch = SignalWatch()
    healthy = {"self_distill_target_information": 2.3, "self_distill_target_entropy": 3.6, "contrastive_loss": 3.0}
    assert watch.check(1, healthy) == []
    one_target = {**healthy, "self_distill_target_information": INFORMATION_FLOOR / 2}
    sharp = {"masked_target_information": 1.0, "masked_target_entropy": ENTROPY_FLOOR - 0.1}
    warned = watch.check(7, {**one_target, **sharp})
    assert len(warned) == 2 and warned[0].startswith("step 7: self_distill's teacher targets have collapsed (0.05 nat")
    assert "each image's target is one or two prototypes" in warned[1] and "loss.masked.head_lr" in warned[1]
    assert watch.check(8, {**one_target, **sharp}) == []  # once a run
