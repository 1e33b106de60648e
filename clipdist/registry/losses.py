"""The loss backends: each backend's name, the options it takes (a dataclass whose fields become `loss.<field>` keys,
each with its resume rule), where its class lives (imported only when it is built) and the single-process loss it
must equal on the whole global batch (its `reference`: `clipdist gradcheck` and the tests compare it with that).

    from clipdist.registry.losses import BACKENDS
    BACKENDS["tiled"].options     # TileOptions: loss.tile
    BACKENDS["tiled"].load()      # clipdist.losses.tiled.TiledLoss (imports torch)

A new backend is its module, its entry here (or a plug-in's, group `clipdist.losses`) and its test
(docs/architecture.md walks through one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from clipdist.defaults import DEFAULT_TILE, FREE
from clipdist.registry import CodeSpec, Registry, plugged


@dataclass
class TileOptions:
    """The ring's tile: an order of summation (free to change on resume, as the world size is)."""

    RESUME: ClassVar[dict] = {"tile": FREE}
    tile: int = DEFAULT_TILE  # rows and columns per tile; the largest transient block is tile × tile logits


CLIP = "clipdist.losses.reference:clip_loss"  # CLIP's softmax loss; open_clip's ClipLoss at world size 1
SIGLIP = "clipdist.losses.reference:siglip_loss"  # the sigmoid loss with a logit bias; open_clip's SigLipLoss


@dataclass(frozen=True)
class LossSpec(CodeSpec):
    """`target`: "module:Class", a DistributedContrastiveLoss subclass."""

    options: type | None = None  # a dataclass of the backend's own keyword arguments (with RESUME rules)
    # "module:function": the loss on one process over the global batch, (image, text, scale[, bias]) -> scalar;
    # given by name those of the backend's options it takes (a smoothing, a margin)
    reference: str = CLIP


BACKENDS: Registry[LossSpec] = plugged(
    "clipdist.losses",
    LossSpec,
    (
        LossSpec("naive", "clipdist.losses.naive:NaiveLoss", "all_gather the features, B×B logits on every rank"),
        LossSpec("gather_layer", "clipdist.losses.gather_layer:GatherLayerLoss", "a gather whose backward sums"),
        LossSpec("disco", "clipdist.losses.disco:DiscoLoss", "DisCo-CLIP: local rows against the gathered columns"),
        LossSpec("tiled", "clipdist.losses.tiled:TiledLoss", "softmax on a ring of tiles, O(b·d)", TileOptions),
        LossSpec(
            "siglip",
            "clipdist.losses.siglip:SigLipLoss",
            "sigmoid + logit bias on the ring, O(b·d)",
            TileOptions,
            SIGLIP,
        ),
    ),
)
