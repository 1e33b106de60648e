"""Gradient caching: the chunked step's gradients equal the whole step's, the scale counted once."""

from __future__ import annotations

import pytest
import torch
from open_clip.transformer import PatchDropout

from clipdist.data.batch import Batch
from clipdist.losses import build
from clipdist.model.factory import create_model_for_loss
from clipdist.tools.gradcheck import _random_batch
from clipdist.train.step import CachedStep, Step, _restored_rng, _rng_state

BATCH = 6


def tiny_model(dropout: bool, bias: bool):
    torch.manual_seed(0)
    model = create_model_for_loss("clipdist-tiny", build("siglip" if bias else "disco")).double()
    if dropout:  # open_clip's patch dropout draws from the RNG with the chunk's shape
        model.visual.patch_dropout = PatchDropout(0.5)
    return model.train()


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def run_step(step, images, tokens):
    torch.manual_seed(123)
    loss = step.gradients(Batch.of(images, tokens))
    return loss.item(), gradients(step.model)


class ChunksWithGraphs(Step):
    """The reference for dropout: forward the same chunks with their graphs kept, one global loss."""

    def __init__(self, model, loss_fn, chunks):
        super().__init__(model, loss_fn)
        self.chunks = chunks

    def forward(self, batch):
        outputs = [self.model(**piece) for piece in batch.split(self.chunks)]
        whole = (torch.cat([o[0] for o in outputs]), torch.cat([o[1] for o in outputs]), *outputs[0][2:])
        return self.objective.outputs(whole, dict(batch)), None


class ScaleInEveryChunk(CachedStep):
    """The accumulation bug: the scalars' cached gradient fed to every chunk's backward."""

    def backward(self, loss, outputs, replay):
        (image_features, text_features, *scalars), (pieces, rng_states) = outputs.features, replay
        loss.backward()
        sizes = [piece.rows for piece in pieces]
        for piece, rng, g_image, g_text in zip(
            pieces, rng_states, image_features.grad.split(sizes), text_features.grad.split(sizes)
        ):
            with _restored_rng(rng, self.rng_device):
                outputs = self.model(**piece)
            torch.autograd.backward(list(outputs), [g_image, g_text, *(s.grad for s in scalars)])


def max_rel_error(got, want):
    return max(((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-30)).item() for k in want)


@pytest.mark.parametrize("backend", ["disco", "siglip"])
@pytest.mark.parametrize("chunks", [2, 3])
def test_grad_cache_with_dropout_equals_the_step_that_keeps_every_graph(backend, chunks):
    loss_fn = build(backend)
    images, tokens = _random_batch(BATCH, "clipdist-tiny", 0, torch.float64).values()
    cached = run_step(CachedStep(tiny_model(True, loss_fn.uses_logit_bias), loss_fn, chunks=chunks), images, tokens)
    whole = run_step(ChunksWithGraphs(tiny_model(True, loss_fn.uses_logit_bias), loss_fn, chunks), images, tokens)
    assert cached[0] == pytest.approx(whole[0], rel=1e-12)
    assert max_rel_error(cached[1], whole[1]) < 1e-10
    model = tiny_model(True, loss_fn.uses_logit_bias)  # dropout really is on: other seeds, other features
    assert not torch.allclose(*(torch.manual_seed(seed) and model(images, tokens)[0] for seed in (1, 2)))


def test_grad_cache_without_dropout_equals_one_whole_batch_forward():
    loss_fn = build("tiled")
    images, tokens = _random_batch(BATCH, "clipdist-tiny", 0, torch.float64).values()
    cached = run_step(CachedStep(tiny_model(False, False), loss_fn, chunks=3), images, tokens)
    whole = run_step(Step(tiny_model(False, False), loss_fn), images, tokens)
    assert cached[0] == pytest.approx(whole[0], rel=1e-12)
    assert max_rel_error(cached[1], whole[1]) < 1e-10


def test_scale_counted_in_every_chunk_is_caught():
    loss_fn = build("disco")
    images, tokens = _random_batch(BATCH, "clipdist-tiny", 0, torch.float64).values()
    broken = run_step(ScaleInEveryChunk(tiny_model(False, False), loss_fn, chunks=3), images, tokens)[1]
    right = run_step(CachedStep(tiny_model(False, False), loss_fn, chunks=3), images, tokens)[1]
    assert broken["logit_scale"].item() == pytest.approx(3 * right["logit_scale"].item(), rel=1e-9)


def test_replayed_chunk_leaves_the_rng_where_it_was():
    state = _rng_state(torch.device("cpu"))
    first = torch.rand(3)
    after = torch.rand(3)
    with _restored_rng(state, torch.device("cpu")):
        assert torch.equal(torch.rand(3), first)
    assert not torch.equal(torch.rand(3), after)  # the stream went on from after `after`


def test_the_chunked_step_puts_one_chunk_at_a_time_on_the_device():
    """The loader's batch stays where it is (pinned host memory on CUDA); the step moves and normalises a
    chunk as it runs — in the forward and again in the re-forward — and the step equals the whole one whose
    batch is prepared at once."""
    loss_fn = build("tiled")
    pixels = torch.randint(0, 256, (BATCH, 32, 32, 3), dtype=torch.uint8)  # as the loader hands them over
    _, tokens = _random_batch(BATCH, "clipdist-tiny", 0, torch.float64).values()
    seen = []

    def normalize(images):
        seen.append(images.shape[0])
        return images.permute(0, 3, 1, 2).double().div(255)

    cached = run_step(CachedStep(tiny_model(False, False), loss_fn, chunks=3, normalize=normalize), pixels, tokens)
    assert seen == [2, 2, 2, 2, 2, 2]  # three chunks forward, the same three re-forwarded
    seen.clear()
    whole = run_step(Step(tiny_model(False, False), loss_fn, normalize=normalize), pixels, tokens)
    assert seen == [BATCH]
    assert cached[0] == pytest.approx(whole[0], rel=1e-12) and max_rel_error(cached[1], whole[1]) < 1e-10
