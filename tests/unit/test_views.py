"""Local views (clipdist.data.views): torchvision's crop boxes, seeded by the sample alone, resampled in one call."""

from __future__ import annotations

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


def test_a_naflex_images_views_are_boxes_of_its_patch_grid_whatever_its_row_or_padding():
    """local_patch_views: each view a whole h' × w' grid from (0, 0), its patches the image's own (or, flipped, their
    mirror images in the mirrored order), never padding; the same views for a sample at another row of another
    batch with more padding."""
    from clipdist.data.views import local_patch_views

    patch, crops = 4, 3
    images = _naflex_rows(5, patch)
    views = local_patch_views(images, crops=crops, patch_size=patch, scale=(0.2, 0.6), seed=1, step=9)
    assert views["patches"].shape[0] == 5 * crops
    for view in range(5 * crops):
        row, valid = view // crops, views["patch_valid"][view]
        at = views["patch_coord"][view][valid]
        height, width = int(at[:, 0].max()) + 1, int(at[:, 1].max()) + 1
        assert len(at) == height * width and {tuple(c) for c in at.tolist()} == {
            (y, x) for y in range(height) for x in range(width)
        }
        assert not views["patches"][view][~valid].any()
        source = images["patches"][row][images["patch_valid"][row]]
        mine = views["patches"][view][valid]
        mirrored = mine.view(-1, patch, patch, 3).flip(2).reshape(mine.shape)
        as_is = all(any(torch.equal(p, s) for s in source) for p in mine)
        flipped = all(any(torch.equal(p, s) for s in source) for p in mirrored)
        assert as_is or flipped
    # rows 1..4 alone, after two more padding patches each: the same views as there
    moved = {
        "patches": torch.cat([images["patches"][1:], torch.zeros(4, 2, images["patches"].shape[2])], 1),
        "patch_coord": torch.cat([images["patch_coord"][1:], torch.zeros(4, 2, 2, dtype=torch.long)], 1),
        "patch_valid": torch.cat([images["patch_valid"][1:], torch.zeros(4, 2, dtype=torch.bool)], 1),
    }
    again = local_patch_views(moved, crops=crops, patch_size=patch, scale=(0.2, 0.6), seed=1, step=9)
    for view in range(4 * crops):
        ours, theirs = again["patch_valid"][view], views["patch_valid"][view + crops]
        assert torch.equal(again["patches"][view][ours], views["patches"][view + crops][theirs])
        assert torch.equal(again["patch_coord"][view][ours], views["patch_coord"][view + crops][theirs])
    other = local_patch_views(images, crops=crops, patch_size=patch, scale=(0.2, 0.6), seed=1, step=10)
    assert not torch.equal(other["patch_coord"], views["patch_coord"]) or not torch.equal(
        other["patches"], views["patches"]
    )


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
