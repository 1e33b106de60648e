"""What a loss term is, and the parts of a forward the terms take (clipdist.objective's docstring has the sum)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from clipdist.defaults import DEFAULT_TILE


@dataclass
class Outputs:
    """A forward, in the parts the objective takes: `features` as a contrastive backend takes them (image, text,
    logit scale[, logit bias]) and each term's own part by the term's name (None where it takes nothing)."""

    features: tuple
    parts: dict[str, Any] = field(default_factory=dict)

    def with_parts(self, parts: dict[str, Any]) -> Outputs:
        """These outputs with more terms' parts (the own-forward terms', taken apart: Objective.own_backward)."""
        return Outputs(self.features, {**self.parts, **parts})


class OwnModule(torch.nn.Module):
    """A term's own module on the model (a head, a decoder), called outside the model's forward. `fsdp_methods`: its
    methods a term calls, which FSDP2 registers as forwards (parallel.wrap_model), so its shards are gathered for
    them as for forward."""

    fsdp_methods: tuple[str, ...] = ("touch",)
    calls_image_tower = False  # whether its term runs the image tower outside the model's forward (FSDP2: a unit)

    def touch(self) -> torch.Tensor:
        """0 · Σ of its parameters, in the graph: what a term that does not count yet adds to the loss, so each of
        its parameters gets a (zero) gradient every step — DDP's rule, and under FSDP2 the same update (AdamW's
        weight decay moves a parameter with a zero gradient, not one without)."""
        return 0 * torch.stack([parameter.sum() for parameter in self.parameters()]).sum()


@dataclass
class TermContext:
    """What a registered term's builder may need beyond its options (registry.terms): the student, where and in
    what dtype it runs, where models are cached, the run's length (for start_at), the loss's tile, the run's seed
    and its weight average (`teacher()`: the average's tensors by parameter name; None without optim.ema)."""

    model: torch.nn.Module
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype | None = None  # the weights' dtype where they are not fp32 (pure_bf16 / pure_fp16)
    cache_dir: str | None = None
    local_rank: int = 0
    max_steps: int = 1
    tile: int = DEFAULT_TILE
    seed: int = 0
    teacher: Callable[[], dict[str, torch.Tensor]] | None = None
    shared: dict[str, Any] = field(default_factory=dict)  # what the terms built from this context share


def features_of(raw) -> tuple:
    """The features of a model's forward: open_clip's CLIP returns (image, text, scale[, bias]); CoCa a dict."""
    if not isinstance(raw, dict):
        return tuple(raw)
    features = (raw["image_features"], raw["text_features"], raw["logit_scale"])
    return features + (raw["logit_bias"],) if raw.get("logit_bias") is not None else features


class Term:
    """One term T of the objective, over the global batch, exact at any world size and under gradient caching.

    - `take(raw, inputs)`: what it needs from one forward (a chunk's, under gradient caching) beyond the features,
      with the forward's graph where it has one; `inputs` are the model's named inputs (a teacher sees them too).
    - `merge(parts)`: the chunks' parts as one. Every rank calls it once per step, so a term may agree over ranks
      here (the caption term counts the global batch's tokens).
    - `value(features, part)`: this rank's share ℓ_r, such that the mean over ranks of ℓ_r is T and DDP's average
      of ∂ℓ_r/∂θ is ∂T/∂θ.
    - `chunk_value(chunk_part, part)`: under gradient caching, the share of ℓ_r one chunk's re-forward
      backpropagates itself (only for `per_chunk` terms); the others reach the model through the features, whose
      cached gradients every chunk's re-forward carries.
    - `reference(raw, inputs)`: T's definition on one process over the whole batch (open_clip's, where it has one).
    - `commit()`: after an optimizer step, the term's own state moves on (a centre); not after a stopped step.
    - `stats()`: scalars the logs show beside its value (the teacher terms: their targets' entropy).
    - `parameters()`: the modules only this term trains (a head): touched with weight 0 before its start, as DDP
      wants a gradient for every parameter at every step.

    An `own_forward` term runs a forward of its own, apart from the model's (a teacher term's student views), and
    its T is a mean over the global batch's B rows: `take(None, inputs)` gives a part whose first entry is Σ_i ℓ_i
    over the chunk's rows, with its graph. The step runs it before the model's forward, chunk by
    chunk, and backpropagates w · N/B · Σ_i ℓ_i of each chunk at once (Objective.own_backward), so its graph is
    gone before the next term's or the model's is made.
    """

    name: str = "term"  # its key in the logs
    per_chunk: bool = False  # its gradient reaches the model outside the features (chunk_value)
    own_forward: bool = False  # its forward is its own: backpropagated apart, before the model's (see above)
    step: int | None = None  # the step (1-based) the next forward is for: Objective.at sets it
    shape: str = ""  # what the start banner says of its own modules beside its weight (a decoder's depth)

    def modules(self) -> list[OwnModule]:
        """The term's own modules on the model (a head, a decoder): what it trains besides the towers."""
        return []

    def commit(self) -> None:
        return None

    def take(self, raw, inputs: dict):
        return None

    def merge(self, parts: list):
        return None

    def value(self, features: tuple, part) -> torch.Tensor:
        raise NotImplementedError

    def chunk_value(self, chunk_part, part) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} reaches the model through the features only")

    def reference(self, raw, inputs: dict) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, chunks: Callable[[], Iterable[dict]]) -> None:
        """An own-forward term, before its step's chunks: what it needs first of the whole global batch (`chunks()`
        gives them, each the model's named inputs). Every rank calls it, so it may agree over ranks."""
        return None

    def stats(self) -> dict[str, torch.Tensor]:
        """What the logs show of the term beside its value, after `merge` (global: the same on every rank)."""
        return {}
