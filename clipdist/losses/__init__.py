"""Exact distributed contrastive-loss backends and their registry.

    loss_fn = build("disco")
    loss = loss_fn(image_features, text_features, logit_scale)

See DistributedContrastiveLoss for the contract every backend keeps.
"""
from __future__ import annotations

from torch import nn

from clipdist.losses.base import DistributedContrastiveLoss
from clipdist.losses.disco import DiscoLoss
from clipdist.losses.gather_layer import GatherLayerLoss
from clipdist.losses.naive import NaiveLoss
from clipdist.losses.reference import clip_loss

BACKENDS: dict[str, type[nn.Module]] = {
    "naive": NaiveLoss,
    "gather_layer": GatherLayerLoss,
    "disco": DiscoLoss,
}


def build(name: str, **options) -> nn.Module:
    """Instantiate the backend registered as `name` with its options."""
    try:
        backend = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown loss backend {name!r}; choose one of: {', '.join(BACKENDS)}") from None
    return backend(**options)


__all__ = ["BACKENDS", "DistributedContrastiveLoss", "build", "clip_loss"]
