"""Exact distributed contrastive-loss backends and their registry.

    loss_fn = build("disco")
    loss = loss_fn(image_features, text_features, logit_scale)               # softmax backends
    loss = build("siglip")(image_features, text_features, logit_scale, logit_bias)

See DistributedContrastiveLoss for the contract every backend keeps.
"""

from __future__ import annotations

import inspect

from torch import nn

from clipdist.losses.base import DistributedContrastiveLoss
from clipdist.losses.disco import DiscoLoss
from clipdist.losses.gather_layer import GatherLayerLoss
from clipdist.losses.naive import NaiveLoss
from clipdist.losses.reference import clip_loss, siglip_loss
from clipdist.losses.siglip import SigLipLoss
from clipdist.losses.tiled import TiledLoss

BACKENDS: dict[str, type[nn.Module]] = {
    "naive": NaiveLoss,
    "gather_layer": GatherLayerLoss,
    "disco": DiscoLoss,
    "tiled": TiledLoss,
    "siglip": SigLipLoss,
}


def build(name: str, **options) -> nn.Module:
    """Instantiate the backend registered as `name` with its options."""
    try:
        backend = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown loss backend {name!r}; choose one of: {', '.join(BACKENDS)}") from None
    try:
        return backend(**options)
    except TypeError as error:
        accepted = [p for p in inspect.signature(backend).parameters if p != "group"]
        raise ValueError(f"loss.options for {name!r}: {error}; it accepts {accepted or 'no options'}") from None


__all__ = ["BACKENDS", "DistributedContrastiveLoss", "build", "clip_loss", "siglip_loss"]
