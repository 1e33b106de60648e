"""`clipdist plan`: memory predicted from small measurements matches a real step's, within 20%."""

from __future__ import annotations

import pytest

from clipdist.tools import plan

BACKENDS = ["disco", "tiled", "siglip"]


def test_parse_bytes_and_presets():
    assert plan.parse_bytes("40GB") == 40 * 10**9
    assert plan.parse_bytes("80GiB") == 80 * 2**30
    assert plan.parse_bytes("512M") == 512 * 10**6
    assert plan.parse_bytes("A100-40GB") == 40 * 10**9
    with pytest.raises(ValueError, match="40GB"):
        plan.parse_bytes("lots")
    for nothing in ("0", "0GB", "0.0000000001GB"):  # a plan for a device of no memory fits nothing: refused
        with pytest.raises(ValueError, match=f"--memory '{nothing}': must be at least 1 byte"):
            plan.parse_bytes(nothing, "--memory")
    with pytest.raises(ValueError, match="--host-memory '1.2.3GB': write it like 40GB"):
        plan.parse_bytes("1.2.3GB", "--host-memory")  # was float()'s own error
    assert plan.resolve_world("64gpu") == (64, 8) and plan.resolve_world("3") == (3, 3)
    # without --global-batch, the preset's own (it planned 32768 = 4096 per device for 8gpu's 256)
    assert plan.preset_global_batch("8gpu") == 8 * 256 and plan.preset_global_batch("64gpu") == 64 * 512
    assert plan.preset_global_batch("3") == plan.DEFAULT_GLOBAL_BATCH
    assert plan.resolve_model("vit_b32") == ("ViT-B-32", False)
    with pytest.raises(ValueError, match="64gpu"):
        plan.resolve_world("65gpu")


def test_a_distillation_teacher_adds_its_weights_features_and_ring_buffers_to_the_peak():
    from clipdist.tools.memory import LOSS_TERMS, ActivationFit, LossFit

    fit = LossFit("tiled", tuple([0.0] * len(LOSS_TERMS)), 0.0)
    measured = plan.Measurements(ActivationFit(1000.0, 0.0, 64, 10**6), {"tiled": fit}, 4, [(10**6,)], [])
    alone = plan.breakdown(measured, "tiled", 4, 32, 32)
    measured.teacher_parameters, measured.teacher_dim = 5 * 10**6, 128
    taught = plan.breakdown(measured, "tiled", 4, 32, 32)
    expected = 4 * 5 * 10**6 + 2 * 32 * 128 * 4 + 7 * 32 * (64 + 128) * 4
    assert taught["teacher"] == expected and taught["peak"] - alone["peak"] == expected
    assert (
        plan.largest_local_batch(measured, "tiled", 4, 1, 10**8)[0]
        < plan.largest_local_batch(
            plan.Measurements(ActivationFit(1000.0, 0.0, 64, 10**6), {"tiled": fit}, 4, [(10**6,)], []),
            "tiled",
            4,
            1,
            10**8,
        )[0]
    )


@pytest.mark.parametrize("parallel, held", [("ddp", 10**6), ("fsdp", 10**6 // 4)])
def test_a_weight_average_adds_an_fp32_copy_of_the_weights_a_rank_holds(parallel, held):
    """--ema (optim.ema): 4 bytes more per parameter a rank holds (all of them under DDP, its shard under FSDP2)."""
    from clipdist.tools.memory import LOSS_TERMS, ActivationFit, LossFit

    fit = LossFit("tiled", tuple([0.0] * len(LOSS_TERMS)), 0.0)
    measured = plan.Measurements(ActivationFit(1000.0, 0.0, 64, 10**6), {"tiled": fit}, 4, [(10**6,)], [])
    alone = plan.breakdown(measured, "tiled", 4, 32, 32, parallel)
    measured.ema = True
    averaged = plan.breakdown(measured, "tiled", 4, 32, 32, parallel)
    assert averaged["peak"] - alone["peak"] == plan.EMA_BYTES_PER_PARAMETER * held


@pytest.mark.parametrize("global_batch", [4 * 8, 4 * 4096])
def test_the_auto_row_is_the_chunk_size_it_chose_for_the_request_and_the_largest_batch(global_batch):
    """--chunks auto: the row's micro_batch is the chosen chunk size, its largest batch is that chunk size's (one of
    the candidates it chose from, within 5% of the best), and its chunks are that size's for the requested batch —
    even where the requested batch is smaller than one chunk (was: chunks 1 at the local batch, beside the largest
    batch of another chunk size)."""
    from clipdist.tools.memory import LOSS_TERMS, ActivationFit, LossFit

    fit = LossFit("tiled", tuple([0.0] * len(LOSS_TERMS)), 0.0)
    measured = plan.Measurements(ActivationFit(10_000.0, 0.0, 64, 10**6), {"tiled": fit}, 4, [(10**6,)], [])
    host, device = plan.Host(4, 1, 10**15), 10**9
    (row,) = plan.plan(measured, ["tiled"], [plan.AUTO], 4, global_batch, device, host=host)
    local = global_batch // 4
    candidates = {
        size: plan.largest_local_batch(measured, "tiled", 4, None, device, host=host, micro_batch=size)[0]
        for size in (2**k for k in range(20))
    }
    assert row.micro_batch in candidates and row.max_global_batch == 4 * candidates[row.micro_batch]
    assert candidates[row.micro_batch] >= plan.AUTO_CHUNK_SHARE * max(candidates.values())
    assert row.chunks == -(-local // row.micro_batch)
