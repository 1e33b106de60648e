"""Exact distributed contrastive-loss backends, built by name from their registry (clipdist.registry.losses).

    loss_fn = build("disco")
    loss = loss_fn(image_features, text_features, logit_scale)               # softmax backends
    loss = build("siglip")(image_features, text_features, logit_scale, logit_bias)

See DistributedContrastiveLoss (clipdist.losses.base) for the contract every backend keeps. Importing this package
imports no torch: a backend's module is imported when it is built.
"""

from __future__ import annotations

import functools
import importlib
import inspect

from clipdist.registry import left_out, load
from clipdist.registry.losses import BACKENDS

_LAZY = {  # name -> the module that defines it, imported on first use
    "DistributedContrastiveLoss": "clipdist.losses.base",
    "clip_loss": "clipdist.losses.reference",
    "siglip_loss": "clipdist.losses.reference",
}


def build(name: str, **options):
    """Instantiate the backend registered as `name` with its options (an nn.Module)."""
    if name not in BACKENDS:
        choices = ", ".join(BACKENDS)
        raise ValueError(f"unknown loss backend {name!r}{left_out('clipdist.losses', name)}; choose one of: {choices}")
    spec = BACKENDS[name]
    backend = spec.load()
    try:
        instance = backend(**options)
    except TypeError as error:
        accepted = [p for p in inspect.signature(backend).parameters if p != "group"]
        raise ValueError(f"loss.options for {name!r}: {error}; it accepts {accepted or 'no options'}") from None
    instance.reference = _reference(spec.reference, options)  # the one place a backend's definition is named
    return instance


def _reference(target: str, options: dict):
    """The single-process loss `target` names, given those of the backend's options it takes by name (a loss
    whose value depends on an option: label smoothing, a margin; not the ring's tile)."""
    reference = load(target)
    taken = {key: value for key, value in options.items() if key in inspect.signature(reference).parameters}
    return functools.partial(reference, **taken) if taken else reference


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BACKENDS", "DistributedContrastiveLoss", "build", "clip_loss", "siglip_loss"]
