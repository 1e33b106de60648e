"""NaFlex pieces without a process: the token budget's draws, the order's cycles, patches in timm's layout, a tower
whose features ignore padding, and the checks that refuse what a token budget cannot do."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.naflex_transforms import Patchify

from clipdist.config import DataConfig, LossConfig
from clipdist.data.naflex import PatchImages, TokenBudget, eval_seq_len, resolve_seq_lens
from clipdist.data.order import BudgetOrder
from clipdist.distributed.launch import _openmp_runtime
from clipdist.model.factory import blank_images, create_model, lock_towers
from clipdist.model.timm_towers import check_image_tower, float32_parameters, random_patches
from clipdist.optim.optimizer import layer_scales
from clipdist.preflight import check_naflex

NAFLEX = "clipdist-naflex-tiny"


def test_a_batchs_sequence_length_is_drawn_from_the_seed_and_its_index_alone():
    budget = TokenBudget([16, 36, 64], [1, 2, 1], 1024, seed=5)
    lengths = budget.seq_lens_of(np.arange(20_000))
    assert [budget.seq_len(k) for k in (17, 3, 17)] == [lengths[17], lengths[3], lengths[17]]  # any order, same draw
    shares = [float(np.mean(lengths == length)) for length in (16, 36, 64)]
    assert shares == pytest.approx([0.25, 0.5, 0.25], abs=0.02)
    assert not np.array_equal(
        lengths[:50], TokenBudget([16, 36, 64], [1, 2, 1], 1024, seed=6).seq_lens_of(np.arange(50))
    )
    assert [budget.size(k) for k in range(5)] == [1024 // length for length in lengths[:5]]
    assert budget.start(5) == sum(1024 // length for length in lengths[:5])
    assert budget.batch_at(budget.start(5)) == 5 and budget.batch_at(budget.start(5) - 1) == 4
    assert budget.sizes() == [16, 28, 64]


def test_a_resolution_schedule_changes_the_lengths_drawn_after_its_step():
    budget = TokenBudget([16, 36], None, 1024, seed=0, schedule={"100": [64, 144], "300": [256]})
    lengths = budget.seq_lens_of(np.arange(400))
    assert set(lengths[:100]) == {16, 36} and set(lengths[100:300]) == {64, 144} and set(lengths[300:]) == {256}
    assert budget.seq_lens == [16, 36, 64, 144, 256] and budget.final == [256] and budget.sizes() == [4, 7, 16, 28, 64]
    assert budget.switch_at(100) and budget.switch_at(300) and not budget.switch_at(0) and not budget.switch_at(101)
    assert [stage["from"] for stage in budget.layout()["stages"]] == [0, 100, 300]
    assert eval_seq_len(SimpleNamespace(resolution_schedule={"100": [64, 144], "20": [16]}), [36]) == 144
    with pytest.raises(ValueError, match="not a global batch number"):
        TokenBudget([16], None, 64, seed=0, schedule={"soon": [32]})


@pytest.mark.parametrize(
    "message, args",
    [
        ("data.seq_lens", ([], None, 64)),
        ("data.seq_len_probs", ([16, 32], [1.0], 64)),
        ("data.seq_len_probs", ([16, 32], [0, 0], 64)),
        ("data.max_tokens_per_batch=8", ([16], None, 8)),
    ],
)
def test_a_budget_that_cannot_be_drawn_is_refused_in_one_line(message, args):
    with pytest.raises(ValueError, match=message):
        TokenBudget(*args, seed=0)


def test_every_batch_is_one_cycle_whose_chunks_are_the_ranks_rows():
    budget = TokenBudget([16, 36, 64], None, 1024, seed=0)
    order = BudgetOrder(8, budget)  # 2 ranks × 4 readers
    seen = []
    for reader in range(8):
        positions = [order.position(reader, n) for n in range(200)]
        assert positions == sorted(positions)
        assert [order.taken_before(reader, position) for position in positions] == list(range(200))
        seen += positions
    end = min(max(seen), budget.start(10))
    assert sorted(position for position in seen if position < end) == list(range(end))  # each sample once
    for k in range(10):
        start, size = order.span(k)
        for rank in range(2):  # rank r's rows are its own readers' chunks
            low, high = start + rank * size // 2, start + (rank + 1) * size // 2
            readers = {j for j in range(8) for n in range(200) if low <= order.position(j, n) < high}
            assert readers <= set(range(4 * rank, 4 * rank + 4))
    assert order.rank_readers(1, 2) == [4, 5, 6, 7]
    assert order.rank_readers(0, 3) == [0, 1, 2]  # 8 readers on 3 ranks: rank 0 shares reader 2 with rank 1
    assert order.rank_readers(1, 3) == [2, 3, 4, 5]


def test_an_order_restarted_at_a_later_batch_keeps_that_batchs_lengths():
    budget = TokenBudget([16, 36], None, 1024, seed=0, schedule={"6": [64]})
    later = budget.from_batch(5)  # a reshuffled restart after 5 batches: its sample 0 is batch 5's first
    assert later.start(5) == 0 and later.batch_at(0) == 5 and later.start(7) == later.size(5) + later.size(6)
    assert [later.seq_len(k) for k in range(5, 12)] == [budget.seq_len(k) for k in range(5, 12)]
    assert {later.seq_len(k) for k in range(6, 12)} == {64}  # the schedule goes on, not from its start
    order = BudgetOrder(4, later)
    end = later.start(9)
    positions = sorted(order.position(j, n) for j in range(4) for n in range(60) if order.position(j, n) < end)
    assert positions == list(range(end))
    assert all(order.taken_before(j, order.position(j, 7)) == 7 for j in range(4))


def test_patches_are_timms_layout_at_the_aspect_ratio_of_the_image():
    images = PatchImages(16, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    batcher = images.batcher(36)
    wide = Image.fromarray(np.random.default_rng(0).integers(0, 256, (120, 400, 3), dtype=np.uint8))
    pixels = batcher(wide)
    rows, columns = pixels.shape[0] // 16, pixels.shape[1] // 16
    assert rows * columns <= 36 and columns > 2 * rows  # wide stays wide
    batch = batcher.stack([pixels, batcher(wide.rotate(90, expand=True))])
    assert batch["patches"].shape == (2, 36, 16 * 16 * 3)
    expected = Patchify(16)(
        ((pixels.permute(2, 0, 1).float() / 255) - torch.tensor([0.5, 0.4, 0.3])[:, None, None])
        / torch.tensor([0.2, 0.25, 0.3])[:, None, None]
    )
    count = rows * columns
    assert torch.allclose(batch["patches"][0, :count], expected["patches"], atol=1e-6)
    assert torch.equal(batch["patch_coord"][0, :count], expected["patch_coord"])
    assert batch["patch_valid"][0].sum() == count and not batch["patch_valid"][0, count:].any()
    assert (batch["patch_coord"][1, :count].amax(0) + 1).tolist() == [columns, rows]  # the rotated one, tall
    assert batcher.empty()["patches"].shape == (0, 36, 768)
    square = PatchImages(16, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3), square=True).batcher(40)
    assert square(wide).shape == (96, 96, 3)  # ⌊√40⌋ = 6 patches a side, the middle of the wide image
    assert square.stack([square(wide)])["patch_valid"].sum() == 36


def test_a_naflex_towers_features_do_not_depend_on_its_batchs_padding():
    torch.manual_seed(0)
    model = create_model(NAFLEX).double().eval()
    inputs = random_patches(4, 16, 20, torch.Generator().manual_seed(1), torch.float64)
    longest = int(inputs["patch_valid"].sum(1).max())
    features = model.encode_image(inputs)
    trimmed = model.encode_image({name: value[:, :longest] for name, value in inputs.items()})
    alone = torch.cat(
        [model.encode_image({name: value[row : row + 1] for name, value in inputs.items()}) for row in range(4)]
    )
    assert torch.allclose(features, trimmed, rtol=0, atol=1e-12) and torch.allclose(features, alone, atol=1e-12)
    assert float32_parameters(model) == {"visual.trunk.embeds.pos_embed"}
    assert float32_parameters(create_model("clipdist-tiny", device="meta")) == set()


def _cfg(**data):
    return SimpleNamespace(
        data=DataConfig(**data),
        world=SimpleNamespace(world_size=2, batch_per_device=8),
        grad_cache=SimpleNamespace(chunks_for=lambda rows: 1),
        model=SimpleNamespace(name=NAFLEX),
        loss=LossConfig(),  # no terms
        seed=0,
    )


def test_a_stopped_steps_stand_in_batch_draws_nothing_from_the_rng():
    """The zeros a rank trains on nothing with when a stop signal comes while it waits for data leave torch's RNG
    as it was (a resume must find the generators the uninterrupted run would have had), and a NaFlex tower takes
    them."""
    model, plain = create_model(NAFLEX).eval(), create_model("clipdist-tiny")
    before = torch.get_rng_state()
    blank, images = blank_images(model, 3), blank_images(plain, 3)
    assert torch.equal(torch.get_rng_state(), before)
    assert images.shape == (3, 3, 32, 32) and not images.any()
    assert blank["patch_valid"].all() and not blank["patches"].any()
    assert model.encode_image(blank).shape[0] == 3


@pytest.mark.parametrize(
    "data, message",
    [
        ({"max_tokens_per_batch": 64}, "holds 1 image"),
        ({"patch_size": 8}, "patch embedding takes 16-px patches"),
        ({"normalize_on": "device"}, "normalized by the loader"),
        ({"pieces": 2}, "data.pieces=2 with a token budget"),
    ],
)
def test_a_token_budget_the_run_cannot_use_is_refused_before_the_ranks(data, message):
    model = create_model(NAFLEX, device="meta")
    with pytest.raises(ValueError, match=message):
        check_naflex(_cfg(**data), model, readers=2, resuming=None)
    check_naflex(_cfg(), model, readers=2, resuming=None)  # the default: the global batch at the tower's grid


@pytest.mark.parametrize(
    "data, source",
    [
        ({"seq_lens": [64]}, "seq_lens"),
        ({"seq_lens": [16], "resolution_schedule": {"10": [64]}}, "resolution_schedule"),
    ],
)
def test_local_views_longer_than_every_image_name_the_setting_that_makes_the_longest(data, source):
    cfg = _cfg(**data)
    cfg.loss = SimpleNamespace(self_distill=SimpleNamespace(on=True, crop_size=144))
    with pytest.raises(ValueError, match=rf"81 patches, more than the longest image's 64 \(data\.{source}\)"):
        check_naflex(cfg, create_model(NAFLEX, device="meta"), readers=2, resuming=None)


def test_naflex_settings_for_another_tower_and_unknown_image_towers_are_refused():
    fixed = create_model("clipdist-tiny", device="meta")
    with pytest.raises(ValueError, match="data.seq_lens applies to NaFlex image towers"):
        check_naflex(_cfg(seq_lens=[16]), fixed, readers=2, resuming=None)
    with pytest.raises(ValueError, match="data.naflex_square_crop applies to NaFlex image towers"):
        check_naflex(_cfg(naflex_square_crop=True), fixed, readers=2, resuming=None)
    with pytest.raises(ValueError, match="a fixed-size tower takes one image size a stage"):
        check_naflex(_cfg(resolution_schedule={"10": [64, 144]}), fixed, readers=2, resuming=None)
    check_naflex(_cfg(resolution_schedule={"10": [16]}), fixed, readers=2, resuming=None)  # a size a stage: taken
    check_naflex(_cfg(), fixed, readers=2, resuming=None)
    with pytest.raises(ValueError, match="not a timm model name"):
        check_image_tower("naflexvit_nonexistent", NAFLEX, None)
    with pytest.raises(ValueError, match="image tower is open_clip's own"):
        check_image_tower("naflexvit_base_patch16_gap", "clipdist-tiny", {"vision_cfg": {"layers": 2}})
    assert resolve_seq_lens(DataConfig(), (128, 128), 16) == [64]  # the tower's grid where none is given


def test_torchs_openmp_runtime_can_be_released_before_a_fork():
    from clipdist.compat import release

    if release("torch") < (2, 8):  # torch 2.6's libgomp (GCC 8) has no omp_pause_resource_all: nothing to call
        pytest.skip("this torch's libgomp predates omp_pause_resource_all")
    assert _openmp_runtime() is not None  # else launch_local's forks after a parallel op would hang again


def test_layer_decay_and_locks_reach_a_naflex_towers_blocks():
    model = create_model(NAFLEX, device="meta")
    scales = layer_scales(model, {"image": 0.5})
    assert scales["visual.trunk.embeds.proj.weight"] == 0.5**3  # the stem, then 2 blocks, then the head
    assert scales["visual.trunk.blocks.0.attn.qkv.weight"] == 0.5**2
    assert scales["visual.trunk.blocks.1.mlp.fc1.weight"] == 0.5
    assert scales["visual.head.proj.weight"] == 1.0 and scales["token_embedding.weight"] == 1.0
    lock_towers(
        model,
        SimpleNamespace(
            lock_image=True, lock_image_unlocked_groups=2, lock_image_freeze_bn_stats=False, lock_text=False
        ),
    )
    trainable = [name for name, p in model.named_parameters() if name.startswith("visual.") and p.requires_grad]
    assert trainable and all("blocks.0" not in name and "embeds" not in name for name in trainable)
    lock_towers(
        model,
        SimpleNamespace(
            lock_image=True, lock_image_unlocked_groups=1, lock_image_freeze_bn_stats=False, lock_text=False
        ),
    )
    with pytest.raises(ValueError, match="among its trainable parameters .* unlock more of them or drop the decay"):
        layer_scales(model, {"image": 0.5})
