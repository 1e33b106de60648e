"""The built-in dense task (clipdist.tools.dense_probe): seeded scenes whose labels are the shapes drawn, patch labels
by majority, a probe that reads what its features hold and nothing else, and a clear refusal of towers without a
patch grid."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clipdist.tools.dense_probe import CLASSES, fit_probe, grid_of, patch_labels, scenes


def test_scenes_are_seeded_and_their_labels_are_the_shapes_drawn():
    images, labels = scenes(48, 32, seed=5)
    again, same = scenes(48, 32, seed=5)
    assert np.array_equal(images, again) and np.array_equal(labels, same)
    assert not np.array_equal(images, scenes(48, 32, seed=6)[0])
    assert images.shape == (48, 32, 32, 3) and images.dtype == np.uint8 and labels.shape == (48, 32, 32)
    assert set(np.unique(labels)) == set(range(len(CLASSES)))  # background and all three shapes occur
    for image, label in zip(images[:8], labels[:8]):  # a shape is one flat colour; the background is noisy
        for kind in set(np.unique(label)) - {0}:
            assert len(np.unique(image[label == kind], axis=0)) <= 3  # (shapes of one kind but other colours)
        assert len(np.unique(image[label == 0], axis=0)) > 10


def test_a_patch_takes_its_pixels_most_common_class():
    labels = np.zeros((1, 4, 4), np.int64)
    labels[0, :2, :2] = [[1, 1], [1, 0]]  # patch (0, 0): three of four pixels are class 1
    labels[0, :2, 2:] = [[2, 0], [0, 3]]  # patch (0, 1): class 0 has two, 2 and 3 one each
    labels[0, 2:, 2:] = 3
    assert patch_labels(labels, 2).tolist() == [[1, 0, 0, 3]]


def test_the_probe_reads_what_the_features_hold_and_nothing_else():
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (2000,), generator=generator)
    noise = torch.randn(2000, 16, generator=generator)
    informed = torch.cat([torch.nn.functional.one_hot(labels, 4).float() * 3, noise], 1)
    probe = fit_probe(informed[:1000], labels[:1000], 4)
    assert (probe(informed[1000:].double()).argmax(-1) == labels[1000:]).float().mean() == 1.0
    probe = fit_probe(noise[:1000], labels[:1000], 4)  # features that say nothing: chance, about a quarter
    assert (probe(noise[1000:].double()).argmax(-1) == labels[1000:]).float().mean() < 0.35


def test_a_tower_without_a_fixed_patch_grid_is_refused_in_one_line():
    from clipdist.model.factory import create_model

    assert grid_of(create_model("clipdist-tiny")) == (32, 4)  # 8-px patches
    with pytest.raises(ValueError, match="NaFlex tower has no fixed patch grid"):
        grid_of(create_model("clipdist-naflex-tiny"))
