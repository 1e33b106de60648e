"""One rank's batch: the model's inputs by name, beside what the loader knows of them.

    batch = Batch({"image": images, "text": tokens}, counts)
    model(**batch)                       # open_clip's forward(image=..., text=...)
    for chunk in batch.split(4): ...     # gradient caching: every input split alike, along its rows
    batch.to(device)                     # every tensor, nested ones included

The names are the model's forward keywords, so a new input (NaFlex's patches with their coordinates and validity
mask, per-row text lengths) is one more entry — a tensor, or a mapping of tensors that share the rows — and
nothing that carries a batch changes. Every input has the batch's rows as its first dimension.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import accumulate
from typing import Any

import torch

Inputs = dict[str, Any]  # name -> tensor, or a mapping name -> tensor (one model input made of several)


def apply(value, function: Callable[[torch.Tensor], Any]):
    """`function` on a tensor, or on every tensor of a mapping of them."""
    if isinstance(value, Mapping):
        return {name: apply(item, function) for name, item in value.items()}
    return function(value)


def apply_pair(value, other, function: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
    """`function(tensor, other's tensor)` for a tensor and its counterpart, or for every name of two mappings."""
    if isinstance(value, Mapping):
        for name, item in value.items():
            apply_pair(item, other[name], function)
    else:
        function(value, other)


def _split(value, chunks: int) -> list:
    """A tensor, or a mapping of them, as `chunks` of consecutive rows."""
    if isinstance(value, Mapping):
        parts = {name: _split(item, chunks) for name, item in value.items()}
        return [{name: part[k] for name, part in parts.items()} for k in range(chunks)]
    return list(value.tensor_split(chunks))


def _first_tensor(value) -> torch.Tensor:
    return _first_tensor(next(iter(value.values()))) if isinstance(value, Mapping) else value


class Batch(Mapping):
    """The model's inputs by name (a read-only mapping: `model(**batch)`), and beside them `counts` (this rank's
    [samples skipped, shards skipped while reading it, samples of each source]: the step's agreement sums them
    over ranks) and `sample_keys` (each row's sample as
    "shard#key", for logging.sample_keys)."""

    def __init__(
        self,
        inputs: Inputs,
        counts: list[int] | None = None,
        sample_keys: list[str] | None = None,
    ):
        if not inputs:
            raise ValueError("a batch needs at least one input")
        self.inputs = dict(inputs)
        self.counts = list(counts) if counts is not None else []
        self.sample_keys = sample_keys

    def __getitem__(self, name: str):
        return self.inputs[name]

    def __iter__(self):
        return iter(self.inputs)

    def __len__(self) -> int:
        return len(self.inputs)

    @property
    def rows(self) -> int:
        """The samples this batch holds (every input's first dimension)."""
        return _first_tensor(next(iter(self.inputs.values()))).shape[0]

    @property
    def seq_len(self) -> int | None:
        """A NaFlex batch's sequence length (its patches' second dimension); None for image tensors (or encoded
        images: data/device_decode.py)."""
        images = self.inputs.get("image")
        return images["patches"].shape[1] if isinstance(images, dict) and "patches" in images else None

    def map(self, function: Callable[[torch.Tensor], Any], names=None) -> Batch:
        """The batch with `function` applied to every tensor of the inputs `names` (all where None)."""
        inputs = {
            name: apply(value, function) if names is None or name in names else value
            for name, value in self.inputs.items()
        }
        return Batch(inputs, self.counts, self.sample_keys)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> Batch:
        return self.map(lambda tensor: tensor.to(device, non_blocking=non_blocking))

    def split(self, chunks: int) -> list[Batch]:
        """`chunks` batches of consecutive rows (torch.tensor_split's sizes: the first ones one row larger), every
        input split alike; `counts` stay with the whole batch."""
        if not 1 <= chunks <= self.rows:
            raise ValueError(f"grad_cache.chunks={chunks} is more than the local batch ({self.rows})")
        inputs = _split(self.inputs, chunks)
        ends = list(accumulate(_first_tensor(piece).shape[0] for piece in inputs))
        keys = self.sample_keys
        return [
            Batch(piece, [], keys[end - _first_tensor(piece).shape[0] : end] if keys else None)
            for piece, end in zip(inputs, ends)
        ]

    @classmethod
    def of(
        cls,
        images: torch.Tensor | dict[str, torch.Tensor],
        tokens: torch.Tensor,
        counts: list[int] | None = None,
        **options,
    ) -> Batch:
        """The batch of a two-tower CLIP model: images (or uint8 pixels; a NaFlex tower's patches, a dict) and their
        captions' tokens."""
        return cls({"image": images, "text": tokens}, counts, **options)

    @classmethod
    def dummy(cls, images, tokens: torch.Tensor, sources: int) -> Batch:
        """A batch of `images` (blank ones) and `tokens` (empty captions, as the run's tokenizer writes them: start
        and end of text, then padding, so every term gets a caption it can read) that read nothing: what a rank steps
        on when a stop signal arrives while it waits for data (the step's collectives still match on every rank, and
        its agreement stops them)."""
        return cls.of(images, tokens, zero_counts(sources))


def stack_rows(items: list):
    """Per-sample inputs (tensors, or mappings of them) stacked into one batch input."""
    if items and isinstance(items[0], Mapping):
        return {name: stack_rows([item[name] for item in items]) for name in items[0]}
    return torch.stack(items)


def floats_to(value, dtype: torch.dtype | None):
    """A tensor (or a mapping's tensors) in `dtype` where it is floating point (NaFlex coordinates and masks stay)."""
    if dtype is None:
        return value
    return apply(value, lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor)


def as_batch(batch) -> Batch:
    """A Batch as is; any other mapping of named inputs as a Batch."""
    return batch if isinstance(batch, Batch) else Batch(batch)


def zero_counts(sources: int) -> list[int]:
    """The counts of a batch that read nothing (the step's agreement sums counts of one length)."""
    return [0, 0] + [0] * sources


def rows_consumed(counts: list[int]) -> int:
    """The samples of the global order a step consumed, from its counts summed over ranks: every row is one
    source's sample (a skipped sample gave its row to the next one, which is counted instead)."""
    return sum(counts[2:])
