"""`clipdist plan`: memory predicted from small measurements matches a real step's, within 20%."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from clipdist.data.batch import Batch
from clipdist.distributed.launch import launch_local
from clipdist.losses import build
from clipdist.model.factory import create_model_for_loss
from clipdist.tools import plan
from clipdist.tools.gradcheck import _random_batch
from clipdist.tools.memory import LOSS_TERMS, SavedTensorMeter, loss_kept_bytes
from clipdist.train.step import build_step

BACKENDS = ["disco", "tiled", "siglip"]


@pytest.fixture(scope="module")
def measured():
    return plan.measure("clipdist-tiny", BACKENDS, precision="fp32", progress=lambda _: None)


def coefficient(fit, term):
    return fit.coefficients[LOSS_TERMS.index(term)]


def test_loss_fits_are_exact_and_tiled_keeps_no_b_by_B_block(measured):
    for fit in measured.losses.values():
        assert fit.max_residual_bytes < 1.0  # byte counts: the monomials describe them exactly
    tiled, disco = measured.losses["tiled"], measured.losses["disco"]
    assert abs(coefficient(tiled, "b·B")) < 1e-6 and abs(coefficient(tiled, "B·B")) < 1e-6
    assert coefficient(disco, "b·B") == pytest.approx(8.0)  # two b×B float32 blocks kept


def loss_bytes_on_two_ranks(local_sizes, dim):
    kept = {name: loss_kept_bytes(build(name), local_sizes[dist.get_rank()], dim) for name in BACKENDS}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, kept)
    return gathered


def test_loss_fit_predicts_a_layout_it_was_not_fitted_on(measured):
    sizes, dim = [40, 24], 32
    per_rank = launch_local(loss_bytes_on_two_ranks, 2, sizes, dim, timeout_s=120)[0]
    for rank, kept in enumerate(per_rank):
        for name, got in kept.items():
            assert measured.losses[name].bytes(sizes[rank], sum(sizes), dim) == pytest.approx(got, rel=0.01)


def step_kept_bytes(backend, chunks, local_batch):
    """Peak bytes autograd keeps during one real DDP step of the tiny model on this rank."""
    loss_fn = build(backend)
    torch.manual_seed(0)
    model = create_model_for_loss("clipdist-tiny", loss_fn)
    ddp = DistributedDataParallel(model)
    images, tokens = _random_batch(local_batch, "clipdist-tiny", dist.get_rank(), torch.float32).values()
    step = build_step(ddp, loss_fn, chunks=chunks)
    with SavedTensorMeter(exclude=list(model.parameters())) as meter:
        step.gradients(Batch.of(images, tokens))
    return meter.peak


def kept_bytes_of_configs(configs, local_batch):
    return [step_kept_bytes(backend, chunks, local_batch) for backend, chunks in configs]


def test_plan_predicts_the_memory_a_real_step_keeps(measured):
    configs, local_batch, world_size = [("disco", 1), ("tiled", 1), ("siglip", 1), ("disco", 4)], 32, 2
    real = launch_local(kept_bytes_of_configs, world_size, configs, local_batch, timeout_s=300)[0]
    for (backend, chunks), got in zip(configs, real):
        predicted = plan.breakdown(measured, backend, world_size, local_batch, -(-local_batch // chunks))[
            "kept_for_backward"
        ]
        assert predicted == pytest.approx(got, rel=0.2), (backend, chunks, predicted, got)


def test_cli_plan_json():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "clipdist.cli",
            "plan",
            "--model",
            "tiny",
            "--world",
            "cpu2",
            "--global-batch",
            "64",
            "--backend",
            "disco,tiled",
            "--chunks",
            "1,2",
            "--memory",
            "1GB",
            "--precision",
            "fp32",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )  # two threads: the towers run multi-threaded here, as for a user (the suite's default is one)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["model"] == "clipdist-tiny" and report["world_size"] == 2
    assert [(r["backend"], r["chunks"]) for r in report["rows"]] == [
        ("disco", 1),
        ("disco", 2),
        ("tiled", 1),
        ("tiled", 2),
    ]
    assert all(r["fits"] and r["max_global_batch"] >= 64 for r in report["rows"])


def test_largest_batch_is_the_boundary(measured):
    device = 200e6
    b, limit = plan.largest_local_batch(measured, "disco", 4, 1, device)
    assert b > 0 and limit.startswith("device: ")
    assert (
        plan.breakdown(measured, "disco", 4, b, b)["peak"]
        <= device
        < plan.breakdown(measured, "disco", 4, b + 1, b + 1)["peak"]
    )
    cached, _ = plan.largest_local_batch(measured, "disco", 4, 8, device)
    assert cached > b  # gradient caching trades activations for re-computation


def test_inputs_are_counted_on_the_device_and_on_the_host(measured):
    """The batch's inputs: all of it on the device without chunks, one chunk with them; the host holds the
    batch and what the loader reads ahead (2 per worker: whole batches, or chunks read as pieces)."""
    assert measured.input_bytes == 3 * 32 * 32 + 8 * 16  # clipdist-tiny: 32-px images, 16 tokens
    host = plan.Host(ranks_per_node=4, loader_workers=3, memory=10**12)
    whole = plan.breakdown(measured, "tiled", 4, 64, 64, host=host)
    chunked = plan.breakdown(measured, "tiled", 4, 64, 8, host=host)
    assert whole["inputs"] == 64 * measured.input_bytes and chunked["inputs"] == 8 * measured.input_bytes
    assert whole["host_per_node"] == 4 * (64 + 2 * 3 * 64) * measured.input_bytes
    assert chunked["host_per_node"] == 4 * (64 + 2 * 3 * 8) * measured.input_bytes
    assert chunked["cached_features"] == 4 * 64 * measured.activations.feature_dim * 4


def test_host_memory_can_be_what_limits_the_batch(measured):
    device = 10**12
    roomy, _ = plan.largest_local_batch(measured, "tiled", 4, None, device, host=plan.Host(4, 1, 10**12), micro_batch=8)
    tight, limit = plan.largest_local_batch(
        measured, "tiled", 4, None, device, host=plan.Host(4, 1, 10**8), micro_batch=8
    )
    assert tight < roomy and limit == "host: inputs"
    assert plan.breakdown(measured, "tiled", 4, tight, 8, host=plan.Host(4, 1, 10**8))["host_per_node"] <= 10**8
    assert plan.breakdown(measured, "tiled", 4, tight + 1, 8, host=plan.Host(4, 1, 10**8))["host_per_node"] > 10**8


def test_automatic_chunks_reach_nearly_the_largest_batch_with_the_largest_chunk(measured):
    host, device = plan.Host(4, 2, 10**12), 300e6
    micro, batch, _ = plan.auto_micro_batch(measured, "tiled", 4, device, "ddp", host)
    best = max(
        plan.largest_local_batch(measured, "tiled", 4, None, device, host=host, micro_batch=size)[0]
        for size in (1, 2, 4)
    )
    assert batch >= plan.AUTO_CHUNK_SHARE * best
    bigger, _ = plan.largest_local_batch(measured, "tiled", 4, None, device, host=host, micro_batch=2 * micro)
    assert bigger < plan.AUTO_CHUNK_SHARE * best  # a larger chunk would give up more than 5%


@pytest.mark.parametrize(("name", "seq_len"), [("clipdist-tiny", None), ("clipdist-naflex-tiny", 36)])
def test_a_recipes_terms_add_their_modules_the_activations_of_their_forwards_and_an_average(name, seq_len):
    """--recipe siglip2: the heads and decoder are parameters the plan counts, and the fit of what the step keeps
    for backward at its peak (the towers' forward with the decoder's logits, or one own-forward term's: local views,
    a masked image) predicts the real step's peak at a batch of 4 within 20% — on a fixed-size tower and on a NaFlex
    one (its views: boxes of the patch grid). That peak is below what one backward of every term would keep."""
    import torch

    from clipdist.losses import build
    from clipdist.model.factory import create_model
    from clipdist.objective.weighted_sum import build_objective
    from clipdist.tools.memory import SavedTensorMeter, measure_activations, model_inputs
    from clipdist.train.step import build_step

    torch.manual_seed(0)
    plain, model = create_model(name), create_model(name)
    terms, ema = plan.recipe_terms("siglip2", model)
    assert ema and [term.name for term in terms] == ["self_distill_loss", "masked_loss", "decoder_loss"]
    assert sum(p.numel() for p in model.parameters()) > sum(p.numel() for p in plain.parameters())
    context = model.context_length
    alone = measure_activations(plain, context, seq_len=seq_len)
    fit = measure_activations(model, context, seq_len=seq_len, terms=terms)
    assert fit.per_sample > 1.1 * alone.per_sample  # the decoder's logits, or 8 local views
    objective = build_objective(build("naive"))
    objective.terms += [(term, 1.0) for term in terms]
    objective.at(1)
    inputs = model_inputs(model, 4, context, seq_len)
    with SavedTensorMeter(exclude=list(model.parameters())) as meter:
        build_step(model, objective).gradients(inputs)
    assert abs(fit.bytes(4) - meter.peak) / meter.peak < 0.2, (fit.bytes(4), meter.peak)
    with SavedTensorMeter(exclude=list(model.parameters())) as together:  # every term's graph alive at once
        objective(objective.outputs(model(**inputs), inputs))[0].backward()
    assert meter.peak < 0.8 * together.peak, (meter.peak, together.peak)
    with pytest.raises(ValueError, match="siglip2"):
        plan.recipe_terms("nope", create_model("clipdist-tiny"))
