"""Progressive resolution for fixed-size towers: the tower at another size is open_clip's tower resized as open_clip
resizes a checkpoint, at its own size open_clip's forward bit for bit; the schedule gives each batch its size."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fixtures import caption_shards
from helpers import train_stream
from PIL import Image

from clipdist.data.transforms import image_size_stages, image_transforms
from clipdist.model.factory import create_model, weights_for
from clipdist.model.flexible_grid import allow_other_sizes


def _tiny():
    torch.manual_seed(0)
    return create_model("clipdist-tiny").double().eval()


def test_the_tower_at_another_size_is_open_clips_tower_resized_as_a_checkpoint_is():
    model = _tiny()
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    own = model.encode_image(images)
    assert allow_other_sizes(model) and type(model.visual).__name__ == "FlexibleGridViT"
    assert torch.equal(model.encode_image(images), own)  # its own size: open_clip's forward, bit for bit
    small = torch.nn.functional.interpolate(images, size=16, mode="bilinear", antialias=True)
    built = create_model("clipdist-tiny", overrides={"force_image_size": 16}).double().eval()
    built.load_state_dict(weights_for(built, model.state_dict(), "the 32-px model"))  # open_clip's resize_pos_embed
    torch.testing.assert_close(model.encode_image(small), built.encode_image(small), rtol=0, atol=1e-10)
    model.train()
    model.encode_image(small).sum().backward()
    assert model.visual.positional_embedding.grad.abs().sum() > 0  # the one stored table learns from every size


def _data(**schedule):
    return SimpleNamespace(
        resolution_schedule={str(k): v for k, v in schedule.items()},
        augment=False,
        naflex_square_crop=False,
        seq_lens=None,
        patch_size=None,
    )


def test_a_schedule_gives_each_batch_its_size_and_evaluates_at_the_last():
    model = create_model("clipdist-tiny")
    train, evaluation = image_transforms(
        model, SimpleNamespace(**{**vars(_data()), "resolution_schedule": {"0": [16], "24": [32]}})
    )
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8))
    assert [train.size(k) for k in (0, 23, 24, 99)] == [16, 16, 32, 32]
    assert train.batcher_at(3).stack([train.batcher_at(3)(image)]).shape == (1, 3, 16, 16)
    assert train.batcher_at(30).stack([train.batcher_at(30)(image)]).shape == (1, 3, 32, 32)
    assert evaluation(image).shape == (3, 32, 32)
    assert train.switch_at(24) and not train.switch_at(0) and not train.switch_at(25)
    later = image_transforms(model, SimpleNamespace(**{**vars(_data()), "resolution_schedule": {"10": [16]}}))[0]
    assert [later.size(k) for k in (0, 9, 10)] == [32, 32, 16]  # before the first stage: the tower's own size


@pytest.mark.parametrize(
    "name, schedule, message",
    [
        ("clipdist-tiny", {"5": [12]}, "a multiple of its 8-px patch"),
        ("clipdist-tiny", {"5": [16, 24]}, "one image size a stage"),
        ("clipdist-timm-tiny", {"5": [120]}, "a multiple of its 16-px patch"),  # a timm ViT: its patch read
        ("resnet", {"5": [32]}, "its image tower is ModifiedResNet"),
    ],
)
def test_a_schedule_the_tower_cannot_take_is_refused(name, schedule, message):
    resnet = {"vision_cfg": {"layers": [1, 1, 1, 1], "width": 16}} if name == "resnet" else None
    model = create_model("clipdist-tiny" if resnet else name, device="meta", overrides=resnet)
    with pytest.raises(ValueError, match=message):
        image_size_stages(model, schedule)


def test_a_timm_vit_takes_a_schedule_and_is_itself_at_its_own_size():
    """A timm ViT trunk (SigLIP 2's towers) takes other sizes by timm's dynamic-size mode: at its own size its forward
    is the one it had, bit for bit; at a schedule's stage it takes that size."""
    torch.manual_seed(0)
    model = create_model("clipdist-maphead-tiny").double()
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    before = model.visual(images)
    assert image_size_stages(model, {"5": [16]}) == [(5, 16)] and allow_other_sizes(model)
    assert torch.equal(model.visual(images), before)
    assert model.visual(images[:, :, :16, :16]).shape == before.shape


def test_the_stream_makes_each_batch_at_its_scheduled_size(tmp_path):
    caption_shards(tmp_path, shards=1, per_shard=12)
    train, _ = image_transforms(create_model("clipdist-tiny"), _data(**{"2": [16]}))
    stream = train_stream([tmp_path / "0.tar"], 4, train)
    shapes = []
    for _ in range(4):
        shapes.append(tuple(next(stream)["image"].shape))
        stream.consumed()
    assert shapes == [(4, 3, 32, 32), (4, 3, 32, 32), (4, 3, 16, 16), (4, 3, 16, 16)]
    assert stream.switch_at(2) == "images now 16 px (data.resolution_schedule.2)"
    stream.close()
