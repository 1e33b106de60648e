"""Local views (clipdist.data.views): torchvision's crop boxes, seeded by the sample alone, resampled in one call."""

from __future__ import annotations

import math

import pytest
import torch

from clipdist.data.views import TRIES, crop_boxes, key_tensor, local_views, patch_masks


def sample_keys(images: torch.Tensor) -> list[int]:
    return key_tensor(images).tolist()


def _images(rows: int = 6, size: int = 16) -> torch.Tensor:
    return torch.randn(rows, 3, size, size, generator=torch.Generator().manual_seed(rows))


class _Drawn:
    """torch as torchvision's transforms module sees it, its draws given: try t's area fraction and aspect are
    drawn[t][0:2], and top and left, where the try fits, drawn[t][2:4] (its uniform_(a, b) of u: a + (b − a)·u, its
    randint(low, high) of u: low + ⌊u·(high − low)⌋)."""

    def __init__(self, drawn: list[list[float]]):
        self.drawn, self.uniforms, self.ints = drawn, 0, 0

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *size):
        tried, which = divmod(self.uniforms, 2)
        self.uniforms += 1
        return torch.empty(*size).fill_(self.drawn[tried][which])  # uniform_, patched, maps it into [a, b)

    def randint(self, low, high, size):
        self.ints += 1
        return torch.tensor([low + int(self.drawn[(self.uniforms - 1) // 2][1 + self.ints] * (high - low))])


def test_a_box_is_drawn_as_torchvisions_random_resized_crop_draws_it(monkeypatch):
    """crop_boxes, all boxes at once from given uniforms, is torchvision's RandomResizedCrop.get_params run with the
    same numbers in place of its draws (_Drawn), tries that do not fit and the fallback to the whole image
    included."""
    import torchvision.transforms.transforms as tv

    cases = [(16, 16, (0.05, 0.4)), (24, 40, (0.3, 1.0)), (40, 24, (0.9, 1.0)), (8, 64, (0.9, 1.0))]
    uniforms = torch.rand(200, len(cases), TRIES, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for index, (height, width, scale) in enumerate(cases):
        ours = crop_boxes(uniforms[:, index], height, width, scale, (3 / 4, 4 / 3))
        for box in range(len(uniforms)):
            monkeypatch.setattr(tv, "torch", _Drawn(uniforms[box, index].tolist()))
            monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, a, b: self.mul_(b - a).add_(a))
            theirs = tv.RandomResizedCrop.get_params(torch.empty(3, height, width), list(scale), [3 / 4, 4 / 3])
            monkeypatch.undo()
            assert tuple(int(part[box]) for part in ours) == tuple(theirs), (box, height, width)


def test_a_samples_views_do_not_depend_on_its_row_its_companions_or_the_chunk():
    images = _images()
    views = local_views(images, crops=3, size=(8, 8), seed=1, step=5)
    assert views.shape == (6, 3, 3, 8, 8)
    order = torch.tensor([4, 0, 5, 2, 1, 3])
    assert torch.equal(local_views(images[order], crops=3, size=(8, 8), seed=1, step=5), views[order])
    assert torch.equal(local_views(images[4:], crops=3, size=(8, 8), seed=1, step=5), views[4:])  # another rank


def test_views_change_with_the_step_and_the_seed_and_with_the_sample():
    images = _images()
    views = local_views(images, crops=2, size=(8, 8), seed=0, step=1)
    assert not torch.equal(views, local_views(images, crops=2, size=(8, 8), seed=0, step=2))
    assert not torch.equal(views, local_views(images, crops=2, size=(8, 8), seed=1, step=1))
    assert len(set(sample_keys(images))) == 6
    nudged = images.clone()
    nudged[0, 0, 0, 0] += 1 / 256
    assert sample_keys(nudged)[0] != sample_keys(images)[0] and sample_keys(nudged)[1:] == sample_keys(images)[1:]
    before = sample_keys(images)  # kept for this tensor (the step's terms ask in turn) — until it changes in place
    images[1] += 1 / 256
    after = sample_keys(images)
    assert after[1] != before[1] and after[0] == before[0] and after[2:] == before[2:]


def test_a_box_the_size_of_its_output_is_the_image_or_its_mirror_exactly():
    images = _images(rows=16)
    views = local_views(images, crops=2, size=(16, 16), scale=(1.0, 1.0), ratio=(1.0, 1.0), step=3)
    flipped = [torch.equal(view, image.flip(-1)) for image, pair in zip(images, views) for view in pair]
    kept = [torch.equal(view, image) for image, pair in zip(images, views) for view in pair]
    assert all(a or b for a, b in zip(flipped, kept)) and any(flipped) and any(kept)


def test_a_smaller_crop_is_resampled_from_inside_its_box():
    image = torch.zeros(1, 1, 16, 16)
    image[..., 4:12, 4:12] = 1.0  # a bright square in the middle
    views = local_views(image, crops=32, size=(4, 4), scale=(0.05, 0.2), step=0)
    assert views.min() >= 0 and views.max() <= 1 and 0 < views.mean() < 1  # some crops inside it, some outside


def test_a_samples_patch_mask_is_its_own_wherever_it_is_and_masks_its_share():
    images = _images()
    masks = patch_masks(images, patches=16, ratio=0.5, seed=1, step=5)
    assert masks.shape == (6, 16) and masks.dtype == torch.bool and masks.sum(1).tolist() == [8] * 6
    order = torch.tensor([4, 0, 5, 2, 1, 3])
    assert torch.equal(patch_masks(images[order], 16, 0.5, seed=1, step=5), masks[order])
    assert torch.equal(patch_masks(images[4:], 16, 0.5, seed=1, step=5), masks[4:])
    assert not torch.equal(patch_masks(images, 16, 0.5, seed=1, step=6), masks)
    assert len({tuple(row) for row in masks.tolist()}) == 6
    assert patch_masks(images, 16, 0.01).sum(1).tolist() == [1] * 6  # at least one patch


def _naflex_rows(rows: int, patch: int = 4, max_patches: int = 64) -> dict:
    from clipdist.model.timm_towers import random_patches

    return random_patches(rows, patch, max_patches, torch.Generator().manual_seed(rows))


def _as_patches(image: torch.Tensor, patch: int) -> torch.Tensor:
    """(C, h·P, w·P) pixels as a NaFlex row's (h·w, P·P·C) patches in raster order, channels last (timm's layout)."""
    channels, height, width = image.shape
    cells = image.view(channels, height // patch, patch, width // patch, patch).permute(1, 3, 2, 4, 0)
    return cells.reshape(-1, patch * patch * channels)


def _naflex_batch(images: list[torch.Tensor], patch: int, length: int) -> dict:
    rows = []
    for image in images:
        grid_h, grid_w = image.shape[1] // patch, image.shape[2] // patch
        yx = torch.stack(torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij"), -1).reshape(-1, 2)
        rows.append((_as_patches(image, patch), yx))
    patches = torch.zeros(len(images), length, patch * patch * 3, dtype=images[0].dtype)
    coord = torch.zeros(len(images), length, 2, dtype=torch.long)
    valid = torch.zeros(len(images), length, dtype=torch.bool)
    for row, (cells, yx) in enumerate(rows):
        patches[row, : len(cells)], coord[row, : len(cells)], valid[row, : len(cells)] = cells, yx, True
    return {"patches": patches, "patch_coord": coord, "patch_valid": valid}


def test_a_naflex_images_views_are_the_views_of_its_pixels_whatever_its_batch_row_padding_or_orientation(
    monkeypatch,
):
    """local_patch_views: each image put back together from its patches (tall, wide and square ones in one batch,
    on one canvas), its boxes drawn in its own pixels, resampled, augmented and cut into a full grid of patches, is
    what resampled_views gives on that image's pixels alone with the same draws, to float32's round-off (a box at
    the image's edge samples no padding); with the real draws, a sample's views do not depend on its row, its
    batch or the batch's padding."""
    from clipdist.data import views as module

    patch, crops, grid, length = 4, 3, 3, 40
    generator = torch.Generator().manual_seed(0)
    shapes = [(5, 8), (8, 5), (6, 6), (2, 20), (4, 3)]  # (h, w) in patches: wide, tall, square, a strip
    images = [torch.rand(3, h * patch, w * patch, generator=generator) for h, w in shapes]
    batch = _naflex_batch(images, patch, length)
    normalised = ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    options = {"crops": crops, "patch_size": patch, "grid": grid, "scale": (0.05, 1.0), "augmentation": normalised}
    fixed = torch.rand(len(images), crops, module.BOX_DRAWS + 13, generator=generator, dtype=torch.float64)
    with monkeypatch.context() as patched:
        patched.setattr(module, "view_uniforms", lambda keys, *_: fixed[: len(keys)])
        views = module.local_patch_views(batch, seed=1, step=9, **options)
    side = grid * patch
    assert views["patches"].shape == (len(images) * crops, grid * grid, patch * patch * 3)
    assert bool(views["patch_valid"].all()) and views["patch_coord"][0].tolist() == [
        [y, x] for y in range(grid) for x in range(grid)
    ]
    for row, image in enumerate(images):
        own = math.sqrt(image.shape[1] * image.shape[2]) / 224  # the blur's scale: the image's own side
        alone = module.resampled_views(
            image[None],
            image.shape[1],
            image.shape[2],
            fixed[row : row + 1],
            (side, side),
            (0.05, 1.0),
            (3 / 4, 4 / 3),
            (*normalised, own),
        )
        expected = torch.stack([_as_patches(view, patch) for view in alone])
        torch.testing.assert_close(views["patches"][row * crops : (row + 1) * crops], expected, rtol=0, atol=2e-6)
    drawn = module.local_patch_views(batch, seed=1, step=9, **options)
    order = [3, 1, 4]  # rows 3, 1, 4 of another batch, with more padding
    again = module.local_patch_views(
        _naflex_batch([images[i] for i in order], patch, length + 7), seed=1, step=9, **options
    )
    for at, row in enumerate(order):
        torch.testing.assert_close(
            again["patches"][at * crops : (at + 1) * crops], drawn["patches"][row * crops : (row + 1) * crops]
        )
    other = module.local_patch_views(batch, seed=1, step=10, **options)
    assert not torch.equal(other["patches"], drawn["patches"])


@pytest.mark.parametrize("augmented", [False, True])
def test_a_naflex_images_global_view_is_the_global_view_of_its_pixels_in_its_own_patches(monkeypatch, augmented):
    """global_patch_views: each image's global view (a box of 40-100% resized back to the image's size, flipped,
    colour-jittered, grayed, blurred) cut into its own patches' places, is what resampled_views makes of that image
    alone with the same draws — the contrast's mean and the blur's reflection the image's own, not the canvas's — for
    tall, wide, square images and a strip, to float64's round-off; padding stays as it was; with the real draws a
    sample's view does not depend on its row or the batch's padding."""
    from clipdist.data import views as module

    patch, length = 16, 44  # images of 16 to 320 px: the blur's σ up to 1.8 px (its scale the image's own side)
    generator = torch.Generator().manual_seed(1)
    shapes = [(5, 8), (8, 5), (6, 6), (2, 20), (4, 3), (1, 1)]  # (h, w) in patches
    images = [torch.rand(3, h * patch, w * patch, generator=generator, dtype=torch.float64) for h, w in shapes]
    batch = _naflex_batch(images, patch, length)
    normalised = ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3)) if augmented else None
    count = module.BOX_DRAWS + (13 if augmented else 0)
    fixed = torch.rand(len(images), 1, count, generator=generator, dtype=torch.float64)
    if augmented:
        fixed[:3, 0, module.BOX_DRAWS + 10] = 0.1  # these three blurred, whatever else was drawn
    with monkeypatch.context() as patched:
        patched.setattr(module, "view_uniforms", lambda keys, *_: fixed[: len(keys)])
        viewed = module.global_patch_views(batch, patch_size=patch, seed=3, step=5, augmentation=normalised)
    assert torch.equal(viewed["patch_coord"], batch["patch_coord"]) and viewed["patch_valid"] is batch["patch_valid"]
    for row, image in enumerate(images):
        height, width = image.shape[1:]
        own = (*normalised, math.sqrt(height * width) / 224) if normalised else None
        alone = module.resampled_views(
            image[None],
            height,
            width,
            fixed[row : row + 1],
            (height, width),
            module.GLOBAL_SCALE,
            (3 / 4, 4 / 3),
            own,
        )[0]
        cells = len(_as_patches(image, patch))
        torch.testing.assert_close(viewed["patches"][row, :cells], _as_patches(alone, patch), rtol=0, atol=1e-12)
        assert torch.equal(viewed["patches"][row, cells:], batch["patches"][row, cells:])
    drawn = module.global_patch_views(batch, patch_size=patch, seed=3, step=5, augmentation=normalised)
    order = [3, 0, 5]
    again = module.global_patch_views(
        _naflex_batch([images[i] for i in order], patch, length + 9),
        patch_size=patch,
        seed=3,
        step=5,
        augmentation=normalised,
    )
    for at, row in enumerate(order):
        cells = len(_as_patches(images[row], patch))
        torch.testing.assert_close(again["patches"][at, :cells], drawn["patches"][row, :cells], rtol=0, atol=1e-12)


def test_a_naflex_batchs_views_default_to_a_quarter_of_its_sides_patches():
    """Without a grid, a NaFlex batch's views are √L/4 patches a side (4 × 4 at 256 patches, 8 × 8 at 1024): 8 views
    half the tokens of a square image of the batch's length, whatever its images' shapes."""
    from clipdist.data import views as module

    assert [module.view_grid(length) for length in (16, 64, 256, 576, 1024)] == [1, 2, 4, 6, 8]
    patch, generator = 4, torch.Generator().manual_seed(0)
    images = [torch.rand(3, h * patch, w * patch, generator=generator) for h, w in ((16, 16), (4, 30), (9, 7))]
    views = module.local_patch_views(_naflex_batch(images, patch, 256), crops=2, patch_size=patch)
    assert views["patches"].shape == (6, 16, patch * patch * 3) and bool(views["patch_valid"].all())


def test_the_draws_read_nothing_back_from_the_device():
    """Views, masks and their draws for a batch on the meta device (shapes, no values: any read back to the host,
    a .tolist() or .item() that would stall a GPU step, raises there) — 128 rows × 8 views, as SigLIP 2's step."""
    from clipdist.data.views import draws, key_tensor

    images = torch.empty(128, 3, 256, 256, device="meta")
    assert local_views(images, crops=8, size=(112, 112), seed=3, step=9).shape == (128, 8, 3, 112, 112)
    assert patch_masks(images, 256, 0.5, seed=3, step=9).shape == (128, 256)
    valid = torch.empty(128, 256, dtype=torch.bool, device="meta")
    assert patch_masks(images, 256, 0.5, seed=3, step=9, valid=valid).shape == (128, 256)
    assert draws(key_tensor(images), 3, 9, "par:", 1).shape == (128, 1)


def test_the_view_augmentation_is_torchvisions_colour_jitter_grayscale_and_blur():
    """view_augment, all views at once with a choice each, is torchvision's functional transforms view by view: the
    jitter's four adjustments in the view's own order, grayscale, a Gaussian blur of the view's σ; and the choices'
    shares are DINO's (jitter 0.8, grayscale 0.2, blur 0.5)."""
    import torchvision.transforms.functional as TF

    from clipdist.data import view_augment as va

    generator = torch.Generator().manual_seed(0)
    pixels = torch.rand(12, 3, 20, 20, generator=generator, dtype=torch.float64)
    uniforms = torch.rand(12, va.DRAWS, generator=generator, dtype=torch.float64)
    jittered = va.colour_jitter(pixels, uniforms[:, :9])
    blurred = va.gaussian_blur(pixels, 0.1 + 1.9 * uniforms[:, 11])
    for view, u in enumerate(uniforms.tolist()):
        theirs = pixels[view]
        if u[0] < va.JITTER:
            adjust = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue]
            factors = [0.6 + 0.8 * u[1], 0.6 + 0.8 * u[2], 0.8 + 0.4 * u[3], 0.1 * (2 * u[4] - 1)]
            for index in torch.tensor(u[5:9]).argsort().tolist():
                theirs = adjust[index](theirs, factors[index])
        torch.testing.assert_close(jittered[view], theirs, rtol=1e-6, atol=1e-6)
        sigma = 0.1 + 1.9 * u[11]
        torch.testing.assert_close(blurred[view], TF.gaussian_blur(pixels[view], [13, 13], [sigma, sigma]))
    torch.testing.assert_close(va.grayscale(pixels)[:, 0], TF.rgb_to_grayscale(pixels)[:, 0])
    views = torch.randn(4000, 3, 4, 4, generator=generator)
    choices = torch.rand(4000, va.DRAWS, generator=generator)
    augmented = va.augment(views, choices, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    assert augmented.shape == views.shape and augmented.dtype == views.dtype
    for column, share in ((0, 0.8), (9, 0.2), (10, 0.5)):
        assert abs(float((choices[:, column] < share).float().mean()) - share) < 0.03


def test_a_samples_global_view_is_its_own_at_its_own_size_and_a_whole_box_is_the_image():
    """global_views: each image's global view at the image's size, the sample's own wherever it is (another row,
    another rank's share), other draws than its local views'; a box of the whole image is the image or its mirror."""
    from clipdist.data.views import global_views

    images = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    normalised = ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    views = global_views(images, seed=1, step=4, augmentation=normalised)
    assert views.shape == images.shape and views.dtype == images.dtype
    order = torch.tensor([5, 2, 0, 4, 1, 3])
    assert torch.equal(global_views(images[order], seed=1, step=4, augmentation=normalised), views[order])
    assert torch.equal(global_views(images[3:], seed=1, step=4, augmentation=normalised), views[3:])
    assert not torch.equal(global_views(images, seed=1, step=5, augmentation=normalised), views)
    whole = global_views(images, seed=1, step=4, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    for view, image in zip(whole, images):
        assert torch.equal(view, image) or torch.equal(view, image.flip(-1))
    assert not torch.equal(whole, images) and not torch.equal(whole, images.flip(-1))  # some flipped, some not
