"""The images a tower sees: open_clip's own training and evaluation transforms, built from the tower's preprocessing
(size, mean, std, interpolation, resize mode) and data.augmentation (open_clip's AugmentationCfg, field for field)."""

from __future__ import annotations

import functools
import math
import warnings

from open_clip.transform import AugmentationCfg, PreprocessCfg, image_transform_v2

from clipdist.config import as_dict
from clipdist.data.images import ImageBatcher
from clipdist.data.naflex import PatchImages, eval_seq_len, resolve_seq_lens
from clipdist.data.schedule import resolution_stages
from clipdist.model.factory import image_size
from clipdist.model.flexible_grid import patch_side, resizes_exactly
from clipdist.model.timm_towers import naflex_patch_size, naflex_trunk


def image_transforms(model, data) -> tuple:
    """(training transform, evaluation transform) for a model's image tower: open_clip's own, from the tower's
    preprocessing (size, mean, std, interpolation, resize mode) and data.augmentation (open_clip's
    AugmentationCfg); data.augment=false trains on the evaluation transform. A NaFlex tower: naflex.PatchImages,
    and its transform at the longest sequence length for evaluation (each image at its own aspect ratio)."""
    preprocess_cfg = model.visual.preprocess_cfg
    if naflex_trunk(model) is not None:
        seq_lens = resolve_seq_lens(data, image_size(model), naflex_patch_size(model))
        images = PatchImages(
            naflex_patch_size(model),
            preprocess_cfg["mean"],
            preprocess_cfg["std"],
            preprocess_cfg.get("interpolation", "bicubic"),
            seq_lens,
            data.naflex_square_crop,
        )
        return images, images.batcher(eval_seq_len(data, seq_lens)).one
    stages = image_size_stages(model, getattr(data, "resolution_schedule", None))
    train, evaluation = _fixed_size_transforms(preprocess_cfg, data, stages[-1][1] if stages else None)
    if stages:
        return ScheduledSizes(
            lambda size: _fixed_size_transforms(preprocess_cfg, data, size)[0], image_size(model)[0], stages
        ), evaluation
    return train, evaluation


def _fixed_size_transforms(preprocess_cfg: dict, data, size: int | None = None) -> tuple:
    """open_clip's (training, evaluation) transforms, at `size` px where given."""
    preprocess = PreprocessCfg(**{**preprocess_cfg, **({"size": size} if size else {})})
    evaluation = image_transform_v2(preprocess, is_train=False)
    if not data.augment:
        return evaluation, evaluation
    with warnings.catch_warnings():  # open_clip 3.3 names color_jitter(_prob) and gray_scale_prob unused, and uses them
        warnings.filterwarnings("ignore", "Unused augmentation cfg items")
        train = image_transform_v2(preprocess, is_train=True, aug_cfg=AugmentationCfg(**augmentation_cfg(data)))
    return train, evaluation


def image_size_stages(model, schedule) -> list[tuple[int, int]]:
    """data.resolution_schedule for a fixed-size tower: [(first batch, image size in px), ...]; a ValueError for a
    stage that is not one size, a size that is not a multiple of the tower's patch, or a tower that cannot take
    other sizes (flexible_grid.resizes_exactly)."""
    stages = resolution_stages(schedule)
    if not stages:
        return []
    why = resizes_exactly(model)
    if why is not None:
        raise ValueError(
            f"data.resolution_schedule: {why}; a fixed-size tower's schedule needs a ViT with a learned position "
            "table (open_clip's: model=tiny, vit_b32, vit_b16, vit_l14; a timm ViT), or a NaFlex tower (docs/naflex.md)"
        )
    patch = patch_side(model)
    for first, sizes in stages:
        if len(sizes) != 1 or sizes[0] < patch or sizes[0] % patch:
            raise ValueError(
                f"data.resolution_schedule.{first}={sizes}: a fixed-size tower takes one image size a "
                f"stage, a multiple of its {patch}-px patch (e.g. [{patch * 4}])"
            )
    return [(first, sizes[0]) for first, sizes in stages]


class ScheduledSizes:
    """A fixed-size tower's training images under data.resolution_schedule: open_clip's training transform at
    `base` px until the first stage, then at each stage's size from that many global batches on. `batcher_at(k)`
    is global batch k's ImageBatcher (one per size); the tower resamples its position table to the size
    (flexible_grid.FlexibleGridViT)."""

    def __init__(self, make, base: int, stages: list[tuple[int, int]]):
        self.make, self.stages = make, [(0, base)] + [stage for stage in stages if stage[0] > 0]
        if stages and stages[0][0] == 0:
            self.stages[0] = stages[0]
        self.final = self.stages[-1][1]

    def size(self, k: int) -> int:
        return next(size for first, size in reversed(self.stages) if first <= k)

    @functools.cache  # noqa: B019
    def _batcher(self, size: int) -> ImageBatcher:
        return ImageBatcher(self.make(size))

    def batcher_at(self, k: int) -> ImageBatcher:
        return self._batcher(self.size(k))

    def switch_at(self, k: int) -> str | None:
        """A line for the log where batch k begins a stage (None elsewhere)."""
        size = next((size for first, size in self.stages[1:] if first == k), None)
        return None if size is None else f"images now {size} px (data.resolution_schedule.{k})"


def _check_ranges(augmentation: dict) -> None:
    """The crop's area range within (0, 1] and its aspect range above 0, each (low, high) with low ≤ high, and every
    probability in [0, 1]: torchvision falls back to a centre crop where no box fits (scale [0, 0]) and only warns of
    a reversed range. A ValueError naming the key."""
    for key, top in (("scale", 1.0), ("ratio", math.inf)):
        value = augmentation.get(key)
        if value is None:
            continue
        if not (isinstance(value, tuple) and len(value) == 2 and 0 < value[0] <= value[1] <= top):
            within = "0 < low ≤ high ≤ 1 (fractions of the image's area)" if top == 1 else "0 < low ≤ high"
            raise ValueError(
                f"data.augmentation.{key}={list(value) if isinstance(value, tuple) else value}: "
                f"give [low, high] with {within}"
            )
    for key in ("color_jitter_prob", "gray_scale_prob", "re_prob"):
        if key in augmentation and not 0 <= augmentation[key] <= 1:
            raise ValueError(f"data.augmentation.{key}={augmentation[key]}: a probability, from 0 to 1")


def augmentation_cfg(data) -> dict:
    """data.augmentation as open_clip's AugmentationCfg takes it; a ValueError for a setting open_clip's pipeline
    would leave unused (without use_timm it applies scale, and color jitter / grayscale with a probability)."""
    augmentation = {
        key: tuple(value)
        if isinstance(value, list) and len(value) > 1
        else value[0]
        if isinstance(value, list)
        else value
        for key, value in as_dict(data)["augmentation"].items()
        if value is not None
    }
    _check_ranges(augmentation)
    if not augmentation.get("use_timm"):
        unused = [key for key in ("ratio", "re_prob", "re_count") if key in augmentation]
        if "color_jitter" in augmentation and not augmentation.get("color_jitter_prob"):
            unused.append("color_jitter")
        if unused:
            raise ValueError(
                f"data.augmentation.{unused[0]}: open_clip's own pipeline does not use it (it applies "
                "scale, and color_jitter with color_jitter_prob, gray_scale_prob); set "
                "data.augmentation.use_timm=true for timm's pipeline, which takes it"
            )
        jitter = augmentation.get("color_jitter")
        if augmentation.get("color_jitter_prob") and (not isinstance(jitter, tuple) or len(jitter) != 4):
            raise ValueError(
                "data.augmentation.color_jitter_prob needs color_jitter as four values (brightness, "
                "contrast, saturation, hue), e.g. data.augmentation.color_jitter=[0.4,0.4,0.4,0.1]"
            )
    return augmentation
