"""`clipdist plan`: per-device memory and communication of a run before it is launched.

Figures per device:
  parameters + optimizer   P·16 bytes: fp32 weights, fp32 gradients, AdamW's two moments; under
                           FSDP (--parallel fsdp) each rank's shard of them: Σ ⌈rows/N⌉·row size
                           over the sharded tensors (dim 0 padded to a multiple of N), ·16, plus
                           the 0-dim scalars kept whole
  activations              what the towers keep for backward: measured on CPU at batch 1 and 2
                           (same precision, same grad checkpointing), scaled linearly; with
                           gradient caching, one chunk's worth plus the cached features and
                           their gradients (4·b·d elements)
  loss buffers             what the backend keeps for backward on one rank: measured on 3 gloo
                           ranks at small (b, B, d) and fitted exactly on the monomials of
                           clipdist.tools.memory.LOSS_TERMS
  communication buffers    DDP: none (gradients are views into its all-reduce buckets). FSDP: the
                           gathered weights of the root unit (kept through the step) and of two
                           blocks (one computing, one prefetched), and their unsharded fp32
                           gradients before the reduce-scatter
Peak = parameters + optimizer + buffers + (activations + loss, or with chunks
max(loss, one chunk's activations) + cached features, since the loss's graph is freed before
the chunks are re-run). Bytes sent per rank per step: the loss's collectives (NCCL ring
figures, clipdist.losses.*.sent_bytes_per_rank) + DDP's gradient all-reduce 2·(N−1)/N·P·4, or
FSDP's all-gathers (forward and backward) 2·(N−1)/N·P·w and reduce-scatter (N−1)/N·P·4, with w
the bytes of a gathered weight (2 under bf16).
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from clipdist.losses import build
from clipdist.tools.memory import ActivationFit, LossFit, fit_loss_memory, measure_activations

CONF = Path(__file__).resolve().parents[1] / "conf"  # clipdist/conf, shipped in the package
OPTIMIZER_BYTES_PER_PARAMETER = 16  # fp32 weight + fp32 grad + AdamW exp_avg + exp_avg_sq


# Usable memory of common accelerators, as their makers state it.
DEVICES = {"a100-40gb": 40 * 10**9, "a100-80gb": 80 * 10**9, "h100-80gb": 80 * 10**9, "h200": 141 * 10**9,
           "l40s": 48 * 10**9, "a10g": 24 * 10**9, "v100-32gb": 32 * 10**9, "rtx4090": 24 * 10**9}


def parse_bytes(text: str) -> int:
    """'40GB', '80GiB', '24g', '512MiB' or a device name from DEVICES ('a100-40gb') → bytes (GB = 10⁹, GiB = 2³⁰)."""
    if text.lower() in DEVICES:
        return DEVICES[text.lower()]
    match = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if not match:
        raise ValueError(f"device memory {text!r}: write it like 40GB, 80GiB or 24G, or name a device: "
                         f"{', '.join(DEVICES)}")
    number, prefix, binary = match.groups()
    power = "kmgt".find(prefix) + 1 if prefix else 0
    return int(float(number) * (1024 if binary else 1000) ** power)


def _preset(group: str, name: str):
    """conf/<group>/<name>.yaml as a DictConfig, or None when there is no such preset."""
    path = CONF / group / f"{name}.yaml"
    return OmegaConf.load(path) if path.is_file() else None


def resolve_model(preset: str) -> tuple[str, bool]:
    """A conf/model preset (vit_b32) or an open_clip config name (ViT-B-32) → (name, grad_checkpointing)."""
    cfg = _preset("model", preset)
    return (cfg.name, bool(cfg.get("grad_checkpointing", False))) if cfg is not None else (preset, False)


def resolve_world(preset: str) -> int:
    """A conf/world preset (64gpu) or a number of ranks → world size."""
    if preset.isdigit():
        return int(preset)
    cfg = _preset("world", preset)
    if cfg is None:
        known = sorted(p.stem for p in (CONF / "world").glob("*.yaml")) if CONF.is_dir() else []
        raise ValueError(f"world {preset!r}: not a number of ranks nor a preset ({', '.join(known)})")
    return int(cfg.nodes) * int(cfg.procs_per_node)


@dataclass
class PlanRow:
    backend: str
    chunks: int
    local_batch: int
    global_batch: int
    parameters_optimizer: float
    activations: float
    loss_buffers: float
    communication_buffers: float
    kept_for_backward: float  # peak bytes autograd holds: what SavedTensorMeter measures in a real step
    peak: float
    fits: bool
    sent_bytes_per_step: float
    max_global_batch: int
    parallel: str = "ddp"


@dataclass
class Measurements:
    activations: ActivationFit
    losses: dict[str, LossFit]
    feature_bytes: int  # bytes per feature element reaching the loss (2 under bf16)
    parameter_shapes: list[tuple[int, ...]] = field(default_factory=list)
    block_parameters: list[int] = field(default_factory=list)  # FSDP units: each transformer block

    def state_bytes(self, world_size: int, parallel: str) -> float:
        """Parameters, gradients and AdamW moments on one rank."""
        shards = world_size if parallel == "fsdp" else 1
        held = sum(-(-shape[0] // shards) * math.prod(shape[1:]) if shape else 1 for shape in self.parameter_shapes)
        return held * OPTIMIZER_BYTES_PER_PARAMETER

    def fsdp_buffers(self) -> float:
        largest = max(self.block_parameters, default=0)
        root = self.activations.parameters - sum(self.block_parameters)
        return (2 * largest + root) * self.feature_bytes + (largest + root) * 4


def measure(model_name: str, backends: list[str], precision: str = "bf16", grad_checkpointing: bool = False,
            progress=print) -> Measurements:
    """Run the real towers and loss backends small, on CPU, and fit how their memory scales."""
    from clipdist.models import create_model, get_tokenizer

    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision={precision!r}; choose bf16 or fp32")
    # The loss ranks first: they are forked from this process, and a fork of a process whose OpenMP
    # threads have run (the towers below) hangs in its first parallel op (libgomp is not fork-safe).
    progress(f"measuring loss buffers of {', '.join(backends)} on 3 gloo ranks…")
    losses = fit_loss_memory(backends, "bfloat16" if precision == "bf16" else "float32")
    progress(f"measuring {model_name} activations (CPU, batch 1 and 2, {precision})…")
    torch.manual_seed(0)
    model = create_model(model_name, grad_checkpointing=grad_checkpointing)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else None
    activations = measure_activations(model, get_tokenizer(model_name).context_length, autocast)
    return Measurements(activations, losses, 2 if precision == "bf16" else 4, *parameter_layout(model))


def parameter_layout(model) -> tuple[list[tuple[int, ...]], list[int]]:
    """(every parameter's shape, the parameter count of each transformer block): what sharding needs."""
    from clipdist.parallel import transformer_blocks

    return ([tuple(p.shape) for p in model.parameters()],
            [sum(p.numel() for p in block.parameters()) for block in transformer_blocks(model)])


def breakdown(m: Measurements, backend: str, world_size: int, local_batch: int, chunks: int,
              parallel: str = "ddp") -> dict:
    """Per-device bytes of one configuration (see the module docstring)."""
    act, dim = m.activations, m.activations.feature_dim
    global_batch = local_batch * world_size
    params = m.state_bytes(world_size, parallel)
    buffers = m.fsdp_buffers() if parallel == "fsdp" else 0
    loss = m.losses[backend].bytes(local_batch, global_batch, dim)
    if chunks > 1:
        feature_cache = 4 * local_batch * dim * m.feature_bytes  # image + text features and their gradients
        chunk_activations = act.bytes(math.ceil(local_batch / chunks))
        activations = chunk_activations + feature_cache
        kept = max(loss, chunk_activations)  # the loss's graph is gone before the chunks re-run
    else:
        feature_cache = 0
        activations = act.bytes(local_batch)
        kept = activations + loss
    return {"parameters_optimizer": params, "activations": activations, "loss_buffers": loss,
            "communication_buffers": buffers, "kept_for_backward": kept,
            "peak": params + buffers + kept + feature_cache}


def sent_bytes(m: Measurements, backend: str, world_size: int, local_batch: int, parallel: str = "ddp") -> float:
    loss_fn = build(backend)
    share, params = (world_size - 1) / world_size, m.activations.parameters
    weights = 2 * share * params * 4 if parallel == "ddp" else share * params * (2 * m.feature_bytes + 4)
    return loss_fn.sent_bytes_per_rank(local_batch, world_size, m.activations.feature_dim, 4) + weights


def largest_local_batch(m: Measurements, backend: str, world_size: int, chunks: int, device_bytes: int,
                        parallel: str = "ddp") -> int:
    """The largest b (≥ chunks) whose peak fits in device memory, 0 if none does."""
    def fits(b):
        return breakdown(m, backend, world_size, b, chunks, parallel)["peak"] <= device_bytes

    low = chunks
    if not fits(low):
        return 0
    high = low * 2
    while fits(high):
        low, high = high, high * 2
        if high > 1 << 40:
            return low
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def check_request(backends: list[str], chunks_options: list[int], world_size: int, global_batch: int,
                  parallel_options=("ddp",)) -> None:
    """Arguments that cannot make a plan: a ValueError naming the argument, before anything is measured."""
    for parallel in parallel_options:
        if parallel not in ("ddp", "fsdp"):
            raise ValueError(f"--parallel {parallel}: choose ddp or fsdp (or both: ddp,fsdp)")
    if global_batch < 1:
        raise ValueError(f"--global-batch {global_batch}: must be at least 1")
    if world_size < 1:
        raise ValueError(f"--world {world_size}: must be at least 1 rank")
    if global_batch % world_size:
        raise ValueError(f"--global-batch {global_batch} does not divide over {world_size} ranks")
    for chunks in chunks_options:
        if not 1 <= chunks <= global_batch // world_size:
            raise ValueError(f"--chunks {chunks}: need 1 ≤ chunks ≤ the local batch ({global_batch // world_size})")
    for backend in backends:
        build(backend)


def plan(m: Measurements, backends: list[str], chunks_options: list[int], world_size: int, global_batch: int,
         device_bytes: int, parallel_options: tuple[str, ...] = ("ddp",)) -> list[PlanRow]:
    check_request(backends, chunks_options, world_size, global_batch, parallel_options)
    local_batch = global_batch // world_size
    rows = []
    for parallel in parallel_options:
        for backend in backends:
            for chunks in chunks_options:
                parts = breakdown(m, backend, world_size, local_batch, chunks, parallel)
                rows.append(PlanRow(
                    backend, chunks, local_batch, global_batch, **parts, fits=parts["peak"] <= device_bytes,
                    sent_bytes_per_step=sent_bytes(m, backend, world_size, local_batch, parallel),
                    max_global_batch=world_size * largest_local_batch(m, backend, world_size, chunks, device_bytes,
                                                                      parallel),
                    parallel=parallel,
                ))
    return rows


def rows_as_dicts(rows: list[PlanRow]) -> list[dict]:
    return [asdict(row) for row in rows]
