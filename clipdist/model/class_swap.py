"""A tower given a subclass of its own class in place (the same module, parameters and state dict): how short text
and other image sizes are allowed. Done before any wrapper: FSDP2 gives each unit a class of its own (FSDPCLIP),
which a swap that checks the class would pass over in silence."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule


def swap_class(module: torch.nn.Module, plain: type, changed: type) -> bool:
    """Make `module` a `changed` where it is exactly a `plain` (changed subclasses plain, adding no state); whether it
    is a `changed` now. A module FSDP2 has wrapped is refused (a bug of the caller: swap before wrapping)."""
    if isinstance(module, FSDPModule):
        raise RuntimeError(f"{type(module).__name__}: FSDP2 has wrapped it; make it a {changed.__name__} before")
    if type(module) is plain:
        module.__class__ = changed
    return isinstance(module, changed)
