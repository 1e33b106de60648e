"""The loss backends' one registry, torch-free: each backend's name, the options it takes (a dataclass whose fields
become `loss.<field>` keys, each with its resume rule) and where its class lives, imported only when it is built.

    from clipdist.losses.specs import BACKENDS
    BACKENDS["tiled"].options     # TileOptions: loss.tile
    BACKENDS["tiled"].load()      # clipdist.losses.tiled.TiledLoss (imports torch)

The config schema (clipdist.config: `loss=<name>` and its typed options), the checks before any rank starts,
`clipdist.losses.build` and the tests that parametrize over BACKENDS all read this table: a new backend is its
module, its entry here, and its test (docs/architecture.md walks through one)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import ClassVar

from clipdist.defaults import DEFAULT_TILE, FREE


@dataclass
class TileOptions:
    """The ring's tile: an order of summation (free to change on resume, as the world size is)."""

    RESUME: ClassVar[dict] = {"tile": FREE}
    tile: int = DEFAULT_TILE  # rows and columns per tile; the largest transient block is tile × tile logits


@dataclass(frozen=True)
class LossSpec:
    name: str
    target: str  # "module:Class", imported by load()
    summary: str  # one line for menus and errors
    options: type | None = None  # a dataclass of the backend's own keyword arguments (with RESUME rules)

    def load(self) -> type:
        module, attribute = self.target.split(":")
        return getattr(importlib.import_module(module), attribute)


BACKENDS: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("naive", "clipdist.losses.naive:NaiveLoss", "all_gather the features, B×B logits on every rank"),
        LossSpec("gather_layer", "clipdist.losses.gather_layer:GatherLayerLoss", "a gather whose backward sums"),
        LossSpec("disco", "clipdist.losses.disco:DiscoLoss", "DisCo-CLIP: local rows against the gathered columns"),
        LossSpec("tiled", "clipdist.losses.tiled:TiledLoss", "softmax on a ring of tiles, O(b·d)", TileOptions),
        LossSpec(
            "siglip", "clipdist.losses.siglip:SigLipLoss", "sigmoid + logit bias on the ring, O(b·d)", TileOptions
        ),
    )
}
