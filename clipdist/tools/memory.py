"""Measure what a forward pass keeps for backward, and fit how it scales.

`SavedTensorMeter` hooks autograd's saved tensors (torch.autograd.graph.saved_tensors_hooks)
and counts the distinct storages alive at once: the bytes kept for backward, peak included.
`measure_activations` and `fit_loss_memory` turn small real runs of the towers and of a loss
backend into per-sample and per-(b, B, d) coefficients that `clipdist plan` scales up.
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from clipdist.config import OptimConfig
from clipdist.data.batch import Batch
from clipdist.defaults import COLLECTIVE_TIMEOUT_S
from clipdist.distributed.launch import launch_local
from clipdist.distributed.parallel import wrap_model
from clipdist.losses import build
from clipdist.model.factory import create_model_for_loss, get_tokenizer, image_size, random_tokens
from clipdist.model.timm_towers import full_patches, naflex_patch_size, naflex_trunk
from clipdist.optim.optimizer import build_optimizer
from clipdist.train.step import build_step


class _Kept:
    """What autograd stores instead of a saved tensor: the tensor, counted while it lives."""

    __slots__ = ("tensor", "meter", "key", "nbytes")

    def __init__(self, tensor, meter, key, nbytes):
        self.tensor, self.meter, self.key, self.nbytes = tensor, meter, key, nbytes
        meter._acquire(key, nbytes)

    def __del__(self):
        self.meter._release(self.key, self.nbytes)


class SavedTensorMeter:
    """Context manager: bytes of distinct storages autograd keeps for backward (`live`, `peak`).

    Tensors in `exclude` (inputs that exist anyway, parameters) are not counted.
    """

    def __init__(self, exclude=()):
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.refs: Counter = Counter()
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.excluded or storage.nbytes() == 0:
            return tensor
        return _Kept(tensor, self, key, storage.nbytes())

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Kept) else saved

    def _acquire(self, key, nbytes):
        self.refs[key] += 1
        if self.refs[key] == 1:
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def _release(self, key, nbytes):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= nbytes

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def model_inputs(model, batch: int, context_length: int, seq_len: int | None = None) -> dict:
    """`batch` random images (a NaFlex tower: grids of up to `seq_len` patches, every one valid) and token rows, as
    an open_clip model's named inputs."""
    images: torch.Tensor | dict[str, torch.Tensor]
    if naflex_trunk(model) is None:
        images = torch.randn(batch, 3, *image_size(model))
    elif seq_len is None:
        raise ValueError("a NaFlex tower's outputs need seq_len, the patches an image")
    else:
        images = full_patches(batch, naflex_patch_size(model), seq_len)
    return {"image": images, "text": random_tokens(batch, context_length)}


@dataclass(frozen=True)
class ActivationFit:
    """Bytes the towers keep for backward: per_sample·batch + per_step (e.g. autocast weight copies)."""

    per_sample: float
    per_step: float
    feature_dim: int
    parameters: int

    def bytes(self, batch: int) -> float:
        return self.per_sample * batch + self.per_step if batch > 0 else 0.0


def measure_activations(
    model, context_length: int, autocast=None, batches=(1, 2), seq_len: int | None = None, terms=()
) -> ActivationFit:
    """Run the real towers at two small batches (CPU) and fit the straight line through them (a NaFlex tower at
    `seq_len` patches an image); with `terms` (objective Terms that take a part of the step), what they keep too, as
    the step holds it: a decoder's logits beside the towers', an own-forward term's (local views, a masked image)
    alone, its graph gone before the next is made (Objective.own_backward) — the peak of those phases."""
    model.train()
    kept = []
    for batch in batches:
        inputs = model_inputs(model, batch, context_length, seq_len)
        with SavedTensorMeter(exclude=list(model.parameters())) as meter, autocast or nullcontext():
            raw = model(**inputs)
            parts = [term.take(raw, inputs) for term in terms if not term.own_forward]
            phases = [meter.live]
        feature_dim = raw[0].shape[-1]
        del raw, parts
        for term in terms:
            if term.own_forward:
                with SavedTensorMeter(exclude=list(model.parameters())) as meter, autocast or nullcontext():
                    part = term.take(None, inputs)
                    phases.append(meter.live)
                del part
        kept.append(max(phases))
    per_sample = (kept[1] - kept[0]) / (batches[1] - batches[0])
    return ActivationFit(
        per_sample, kept[0] - per_sample * batches[0], feature_dim, sum(p.numel() for p in model.parameters())
    )


def human_bytes(nbytes: float, digits: int = 2) -> str:
    """1234567 -> '1.23 MB' (decimal units, as device makers state memory)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.{digits}f} {unit}"
    return f"{nbytes:.0f} B"


# Bytes a loss keeps for backward on one rank, as a function of local batch b, global batch B
# and feature dim d: coefficients of these monomials, fitted from exact measurements.
LOSS_TERMS = ("B·B", "b·B", "B·d", "b·d", "B", "b", "d", "1")


def _monomials(b: float, B: float, d: float) -> np.ndarray:
    return np.array([B * B, b * B, B * d, b * d, B, b, d, 1.0])


@dataclass(frozen=True)
class LossFit:
    backend: str
    coefficients: tuple[float, ...]
    max_residual_bytes: float

    def bytes(self, local_batch: int, global_batch: int, dim: int) -> float:
        return float(_monomials(local_batch, global_batch, dim) @ np.array(self.coefficients))


# Local batch sizes per rank (3 ranks) and feature dims the loss fit runs; varied enough that
# every monomial is pinned down (several b per B, several B, two d).
FIT_LAYOUTS = ([1, 2, 3], [2, 3, 4], [4, 4, 4], [5, 1, 4], [3, 7, 5], [6, 2, 2])
FIT_DIMS = (8, 24)


def loss_inputs(loss_fn, local_batch: int, dim: int, dtype=torch.float32, device="cpu") -> list[torch.Tensor]:
    """Random unit image and text features and the scalars `loss_fn` takes, all requiring grad."""
    image, text = (
        F.normalize(torch.randn(local_batch, dim, device=device), dim=-1).to(dtype).requires_grad_() for _ in range(2)
    )
    scalars = [torch.tensor(10.0, device=device, requires_grad=True)]
    if getattr(loss_fn, "uses_logit_bias", False):
        scalars.append(torch.tensor(loss_fn.init_logit_bias, device=device, requires_grad=True))
    return [image, text, *scalars]


def loss_kept_bytes(loss_fn, local_batch: int, dim: int, dtype=torch.float32, device="cpu") -> int:
    """Bytes `loss_fn` keeps for backward on this rank (inputs not counted); runs the backward too."""
    inputs = loss_inputs(loss_fn, local_batch, dim, dtype, device)
    with SavedTensorMeter(exclude=inputs) as meter:
        loss = loss_fn(*inputs)
    loss.backward()
    return meter.peak


def _measure_loss_points(backends: list[str], dtype_name: str):
    rank = dist.get_rank()
    points: dict[str, list[tuple[int, int, int, int]]] = {name: [] for name in backends}
    for name in backends:
        loss_fn = build(name)
        for sizes in FIT_LAYOUTS:
            for dim in FIT_DIMS:
                kept = loss_kept_bytes(loss_fn, sizes[rank], dim, getattr(torch, dtype_name))
                points[name].append((sizes[rank], sum(sizes), dim, kept))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, points)
    return (
        {name: [p for rank_points in gathered for p in rank_points[name]] for name in backends} if rank == 0 else None
    )


def fit_loss_memory(
    backends: list[str], feature_dtype: str = "float32", timeout_s: float = COLLECTIVE_TIMEOUT_S
) -> dict[str, LossFit]:
    """Run each backend on 3 gloo ranks at FIT_LAYOUTS × FIT_DIMS, fit bytes kept per rank."""
    ranks = launch_local(_measure_loss_points, len(FIT_LAYOUTS[0]), list(backends), feature_dtype, timeout_s=timeout_s)
    points = ranks[0]  # rank 0's: every rank's points
    fits = {}
    for name, rows in points.items():
        design = np.stack([_monomials(b, B, d) for b, B, d, _ in rows])
        kept = np.array([k for *_, k in rows], dtype=float)
        coefficients, *_ = np.linalg.lstsq(design, kept, rcond=None)
        residual = float(np.abs(design @ coefficients - kept).max())
        fits[name] = LossFit(name, tuple(float(c) for c in coefficients), residual)
    return fits


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of a tensor (a DTensor's local shard)."""
    local = getattr(tensor, "_local_tensor", tensor)
    return local.numel() * local.element_size()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's parameters, gradients and optimizer state in bytes (what DDP replicates, FSDP shards)."""
    params = list(model.parameters())
    moments = [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    return {
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local_bytes(m) for m in moments),
    }


def state_bytes_after_a_step(model_name: str, parallel: str, local_batch: int) -> dict[str, int]:
    """One training step (so gradients and AdamW moments exist) under `parallel`; this rank's state bytes."""
    torch.manual_seed(0)
    loss_fn = build("disco")
    model = create_model_for_loss(model_name, loss_fn)
    wrapped = wrap_model(model, parallel=parallel)
    optimizer, _ = build_optimizer(model, OptimConfig())
    images = torch.randn(local_batch, 3, *image_size(model))
    build_step(wrapped, loss_fn).gradients(
        Batch.of(images, random_tokens(local_batch, get_tokenizer(model_name).context_length))
    )
    optimizer.step()
    return state_bytes(model, optimizer)


def measure_state_bytes(
    model_name: str, parallel: str, world_size: int, local_batch: int = 4, timeout_s: float = COLLECTIVE_TIMEOUT_S
) -> list[dict[str, int]]:
    """Parameters, gradients and optimizer bytes on each of `world_size` gloo ranks after one step."""
    results = launch_local(state_bytes_after_a_step, world_size, model_name, parallel, local_batch, timeout_s=timeout_s)
    return [results[rank] for rank in range(world_size)]
