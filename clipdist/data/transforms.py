"""The images a tower sees: open_clip's own training and evaluation transforms, built from the tower's preprocessing
(size, mean, std, interpolation, resize mode) and data.augmentation (open_clip's AugmentationCfg, field for field)."""
from __future__ import annotations

import warnings

from open_clip.transform import AugmentationCfg, PreprocessCfg, image_transform_v2

from clipdist.config import as_dict
from clipdist.data.naflex import PatchImages, eval_seq_len, resolve_seq_lens
from clipdist.models import image_size
from clipdist.timm_towers import naflex_patch_size, naflex_trunk


def image_transforms(model, data) -> tuple:
    """(training transform, evaluation transform) for a model's image tower: open_clip's own, from the tower's
    preprocessing (size, mean, std, interpolation, resize mode) and data.augmentation (open_clip's
    AugmentationCfg); data.augment=false trains on the evaluation transform. A NaFlex tower: naflex.PatchImages,
    and its transform at the longest sequence length for evaluation (each image at its own aspect ratio)."""
    preprocess_cfg = model.visual.preprocess_cfg
    if naflex_trunk(model) is not None:
        seq_lens = resolve_seq_lens(data, image_size(model), naflex_patch_size(model))
        images = PatchImages(naflex_patch_size(model), preprocess_cfg["mean"], preprocess_cfg["std"],
                             preprocess_cfg.get("interpolation", "bicubic"), seq_lens, data.naflex_square_crop)
        return images, images.batcher(eval_seq_len(data, seq_lens)).one
    preprocess = PreprocessCfg(**preprocess_cfg)
    evaluation = image_transform_v2(preprocess, is_train=False)
    if not data.augment:
        return evaluation, evaluation
    with warnings.catch_warnings():  # open_clip 3.3 names color_jitter(_prob) and gray_scale_prob unused, and uses them
        warnings.filterwarnings("ignore", "Unused augmentation cfg items")
        train = image_transform_v2(preprocess, is_train=True, aug_cfg=AugmentationCfg(**augmentation_cfg(data)))
    return train, evaluation


def augmentation_cfg(data) -> dict:
    """data.augmentation as open_clip's AugmentationCfg takes it; a ValueError for a setting open_clip's pipeline
    would leave unused (without use_timm it applies scale, and color jitter / grayscale with a probability)."""
    augmentation = {key: tuple(value) if isinstance(value, list) and len(value) > 1 else
                    value[0] if isinstance(value, list) else value
                    for key, value in as_dict(data)["augmentation"].items() if value is not None}
    if not augmentation.get("use_timm"):
        unused = [key for key in ("ratio", "re_prob", "re_count") if key in augmentation]
        if "color_jitter" in augmentation and not augmentation.get("color_jitter_prob"):
            unused.append("color_jitter")
        if unused:
            raise ValueError(f"data.augmentation.{unused[0]}: open_clip's own pipeline does not use it (it applies "
                             "scale, and color_jitter with color_jitter_prob, gray_scale_prob); set "
                             "data.augmentation.use_timm=true for timm's pipeline, which takes it")
        jitter = augmentation.get("color_jitter")
        if augmentation.get("color_jitter_prob") and (not isinstance(jitter, tuple) or len(jitter) != 4):
            raise ValueError("data.augmentation.color_jitter_prob needs color_jitter as four values (brightness, "
                             "contrast, saturation, hue), e.g. data.augmentation.color_jitter=[0.4,0.4,0.4,0.1]")
    return augmentation
