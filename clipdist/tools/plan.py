"""`clipdist plan`: per-device and per-node memory and communication of a run before it is launched.

Figures per device:
  parameters + optimizer   P·16 bytes: fp32 weights, fp32 gradients, AdamW's two moments; under
                           FSDP (--parallel fsdp) each rank's shard of them: Σ ⌈rows/N⌉·row size
                           over the sharded tensors (dim 0 padded to a multiple of N), ·16, plus
                           the 0-dim scalars kept whole
  activations              what the towers keep for backward: measured on CPU at batch 1 and 2
                           (same precision, same grad checkpointing), scaled linearly; with
                           gradient caching, one chunk's worth
  cached features          with gradient caching: the local batch's image and text features and
                           their gradients, 4·b·d elements
  loss                     what the backend keeps for backward on one rank (measured on 3 gloo ranks
                           at small (b, B, d), fitted exactly on the monomials of
                           clipdist.tools.memory.LOSS_TERMS) + what its backward holds on top
                           (the backend's transient_bytes, counted from its code)
  inputs                   the batch as the loader hands it over: uint8 pixels 3·H·W and int64
                           tokens 8·context per sample; with gradient caching one chunk's (the rest
                           waits in host memory, each chunk copied over as it runs)
  communication buffers    DDP: none (gradients are views into its all-reduce buckets). FSDP: the
                           gathered weights of the root unit (kept through the step) and of two
                           blocks (one computing, one prefetched), and their unsharded fp32
                           gradients before the reduce-scatter; with --no-reshard-after-forward
                           every block's gathered weights (kept from forward to backward)
  teacher                  with --distill: the teacher's fp32 weights, its features of the local batch
                           and the distillation term's ring buffers (Measurements.teacher_bytes)
  --recipe siglip2         the recipe's terms' own modules (heads, a decoder) in parameters + optimizer,
                           the weight average it keeps (4 bytes a parameter), and what their forwards keep
                           for backward (local views, the masked image, the decoder's logits) measured
                           with the towers' activations; the EMA teacher's forwards keep nothing (no_grad)
Peak = parameters + optimizer + buffers + inputs + teacher + (activations + loss, or with chunks cached
features + max(loss, one chunk's activations), since the loss's graph is freed before the chunks
are re-run).

Host memory per node: ranks per node × the inputs of the local batch and of what the loader reads
ahead (2 loader batches per worker: DataLoader's prefetch). With gradient caching the plan has the
loader read the batch in pieces of a chunk (data.pieces = chunks), so it reads ahead chunks, not batches.

Bytes sent per rank per step: the loss's collectives (NCCL ring figures,
clipdist.losses.*.sent_bytes_per_rank) + DDP's gradient all-reduce 2·(N−1)/N·P·4, or FSDP's all-gathers
(forward and backward; forward only with --no-reshard-after-forward) 2·(N−1)/N·P·w and reduce-scatter
(N−1)/N·P·4, with w the bytes of a gathered weight (2 under bf16).

`--chunks auto` picks the chunk size: the largest power of two whose largest batch is within 5% of the
largest any chunk size reaches (smaller chunks add steps of overhead and little batch).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
from omegaconf import OmegaConf

from clipdist.config import CONF
from clipdist.config import preset as menu_entry
from clipdist.data.loader import held_samples, sample_bytes
from clipdist.data.naflex import default_seq_lens
from clipdist.distributed.parallel import transformer_blocks
from clipdist.losses import build
from clipdist.model import targets
from clipdist.model.factory import create_model, get_tokenizer, image_size
from clipdist.model.timm_towers import naflex_patch_size, naflex_trunk
from clipdist.objective import TermContext
from clipdist.objective.teacher import TeacherTerm
from clipdist.registry.terms import TERMS
from clipdist.tools.memory import ActivationFit, LossFit, fit_loss_memory, measure_activations

OPTIMIZER_BYTES_PER_PARAMETER = 16  # fp32 weight + fp32 grad + AdamW exp_avg + exp_avg_sq
EMA_BYTES_PER_PARAMETER = 4  # optim.ema's fp32 average, sharded as the weights under FSDP2
AUTO_CHUNK_SHARE = 0.95  # --chunks auto: the largest chunk whose largest batch is this share of the best


# Usable memory of common accelerators, as their makers state it.
DEVICES = {
    "a100-40gb": 40 * 10**9,
    "a100-80gb": 80 * 10**9,
    "h100-80gb": 80 * 10**9,
    "h200": 141 * 10**9,
    "l40s": 48 * 10**9,
    "a10g": 24 * 10**9,
    "v100-32gb": 32 * 10**9,
    "rtx4090": 24 * 10**9,
}


def parse_bytes(text: str, what: str = "device memory") -> int:
    """'40GB', '80GiB', '24g', '512MiB' or a device name from DEVICES ('a100-40gb') → bytes (GB = 10⁹, GiB = 2³⁰),
    at least one; `what` names the argument in the ValueError."""
    if text.lower() in DEVICES:
        return DEVICES[text.lower()]
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if not match:
        raise ValueError(f"{what} {text!r}: write it like 40GB, 80GiB or 24G, or name a device: {', '.join(DEVICES)}")
    number, prefix, binary = match.groups()
    power = "kmgt".find(prefix) + 1 if prefix else 0
    size = int(float(number) * (1024 if binary else 1000) ** power)
    if size < 1:
        raise ValueError(f"{what} {text!r}: must be at least 1 byte")
    return size


def resolve_model(preset: str) -> tuple[str, bool]:
    """A conf/model preset (vit_b32) or an open_clip config name (ViT-B-32) → (name, grad_checkpointing)."""
    cfg = menu_entry("model", preset)
    return (cfg.name, bool(cfg.get("grad_checkpointing", False))) if cfg is not None else (preset, False)


DEFAULT_GLOBAL_BATCH = 32768  # `clipdist plan --world N` without --global-batch


def preset_global_batch(preset: str) -> int:
    """The global batch a run with this world preset trains on (its batch_per_device × its ranks); for a number of
    ranks, DEFAULT_GLOBAL_BATCH."""
    cfg = None if preset.isdigit() else menu_entry("world", preset)
    if cfg is None or "batch_per_device" not in cfg:
        return DEFAULT_GLOBAL_BATCH
    return int(cfg.batch_per_device) * int(cfg.nodes) * int(cfg.procs_per_node)


def resolve_world(preset: str) -> tuple[int, int]:
    """A conf/world preset (64gpu) or a number of ranks → (world size, ranks per node; 8 at most for a number)."""
    if preset.isdigit():
        return int(preset), min(int(preset), 8)
    cfg = menu_entry("world", preset)
    if cfg is None:
        known = sorted(p.stem for p in (CONF / "world").glob("*.yaml")) if CONF.is_dir() else []
        raise ValueError(f"world {preset!r}: not a number of ranks nor a preset ({', '.join(known)})")
    return int(cfg.nodes) * int(cfg.procs_per_node), int(cfg.procs_per_node)


@dataclass
class Host:
    """The node around the devices: its ranks, loader workers per rank and memory (bytes)."""

    ranks_per_node: int = 8
    loader_workers: int = 8
    memory: float = 2 * 10**12


@dataclass
class PlanRow:
    backend: str
    chunks: int
    micro_batch: int  # samples per chunk (the local batch when chunks = 1)
    local_batch: int
    global_batch: int
    parameters_optimizer: float
    activations: float
    cached_features: float
    loss_buffers: float  # kept for backward + what the loss's backward holds on top
    inputs: float
    communication_buffers: float
    peak: float
    host_per_node: float
    fits: bool
    sent_bytes_per_step: float
    max_global_batch: int
    limit: str  # what stops the batch from growing past max_global_batch
    parallel: str = "ddp"
    teacher: float = 0.0  # distillation (--distill): the teacher's weights, its features, the term's ring buffers
    # --chunks auto: the chunk size chosen; the request and max_global_batch are both in chunks of this size
    chunk_size: int | None = None


@dataclass
class Measurements:
    activations: ActivationFit
    losses: dict[str, LossFit]
    feature_bytes: int  # bytes per feature element reaching the loss (2 under bf16)
    parameter_shapes: list[tuple[int, ...]] = field(default_factory=list)
    block_parameters: list[int] = field(default_factory=list)  # FSDP units: each transformer block
    input_bytes: int = (
        0  # per sample as the loader hands it over: uint8 pixels (NaFlex: float32 patches) + int64 tokens
    )
    teacher_parameters: int = 0  # distillation: the teacher's parameter count (fp32 weights, no gradient)
    teacher_dim: int = 0  # and its feature dim
    ema: bool = False  # optim.ema: a weight average beside the weights (--ema)
    # an EMA teacher term's image tower and head (parameters, the largest term's): under FSDP2 the average's shards
    # are gathered whole (fp32) for each teacher forward
    gathered_teacher: int = 0
    # world.reshard_after_forward (a run setting, as ema): false keeps every block's gathered weights to backward
    reshard_after_forward: bool = True

    def teacher_bytes(self, local_batch: int) -> float:
        """A distillation teacher on one rank: fp32 weights; its image and text features of the local batch (kept
        until the loss); what the distillation term's backward holds (as tiled's, with the teacher's block
        travelling beside the student's: 7·b·(d + d')·4). Its forward keeps nothing (no_grad)."""
        if not self.teacher_parameters:
            return 0.0
        dim = self.activations.feature_dim
        return (
            4 * self.teacher_parameters
            + 2 * local_batch * self.teacher_dim * 4
            + 7 * local_batch * (dim + self.teacher_dim) * 4
        )

    def state_bytes(self, world_size: int, parallel: str) -> float:
        """Parameters, gradients and AdamW moments on one rank (and optim.ema's average where `ema`)."""
        shards = world_size if parallel == "fsdp" else 1
        held = sum(-(-shape[0] // shards) * math.prod(shape[1:]) if shape else 1 for shape in self.parameter_shapes)
        return held * (OPTIMIZER_BYTES_PER_PARAMETER + (EMA_BYTES_PER_PARAMETER if self.ema else 0))

    def gathered_parameters(self) -> int:
        """Parameters a rank holds gathered at once under FSDP2: the root's (kept through the step) and two blocks'
        (one computing, one prefetched), or every one where they are kept from forward to backward."""
        if not self.reshard_after_forward:
            return self.activations.parameters
        return 2 * max(self.block_parameters, default=0) + self.activations.parameters - sum(self.block_parameters)

    def fsdp_buffers(self) -> float:
        """The gathered weights and the unsharded fp32 gradients of the root and one block before their reduce."""
        largest, root = max(self.block_parameters, default=0), self.activations.parameters - sum(self.block_parameters)
        return self.gathered_parameters() * self.feature_bytes + (largest + root) * 4

    def gathers(self) -> int:
        """All-gathers of the weights a step under FSDP: forward and backward, or forward alone."""
        return 2 if self.reshard_after_forward else 1


def recipe_terms(recipe: str, model: torch.nn.Module) -> tuple[list, bool]:
    """conf/recipe/<recipe>.yaml's terms with a module of their own, put on `model` and built as a run builds them
    (the teacher: the model's own tensors, as an average is at its start), and whether the recipe keeps an average."""
    cfg = menu_entry("recipe", recipe)
    if cfg is None:
        raise ValueError(f"--recipe {recipe}: no conf/recipe/{recipe}.yaml; choose one of {recipes()}")
    sections, chosen = cfg.get("loss", {}), []
    for name, spec in TERMS.items():
        if spec.attach and name in sections:
            options = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(spec.options), sections[name]))
            if spec.load(spec.attach)(options, model):
                chosen.append((spec, options))
    weights = {name: parameter.detach() for name, parameter in model.named_parameters()}
    context = TermContext(model, teacher=lambda: weights)
    terms = [spec.load()(options, context) for spec, options in chosen]
    return terms, float(OmegaConf.select(cfg, "optim.ema.decay", default=0.0) or 0.0) > 0


def recipes() -> list[str]:
    return sorted(path.stem for path in (CONF / "recipe").glob("*.yaml"))


def measure(
    model_name: str,
    backends: list[str],
    precision: str = "bf16",
    grad_checkpointing: bool = False,
    progress=print,
    teacher: str | None = None,
    seq_len: int | None = None,
    recipe: str | None = None,
) -> Measurements:
    """Run the real towers and loss backends small, on CPU, and fit how their memory scales; `teacher`: a
    distillation teacher (loss.distill.model), counted from its structure; `seq_len`: a NaFlex tower's images at
    that many patches (default: its image_size grid); `recipe`: a conf/recipe entry whose terms train modules of
    their own (their parameters, and what their forwards keep: local views, a masked image, a decoder's logits)
    and keep a weight average."""
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
    context = get_tokenizer(model_name).context_length
    height, width = image_size(model)
    if naflex_trunk(model) is not None:
        seq_len = seq_len or default_seq_lens((height, width), naflex_patch_size(model))[0]
    elif seq_len is not None:
        raise ValueError(f"--seq-len is for NaFlex image towers; {model_name}'s takes {height}×{width} images")
    terms, ema = recipe_terms(recipe, model) if recipe else ([], False)
    activations = measure_activations(model, context, autocast, seq_len=seq_len, terms=terms)
    measured = Measurements(
        activations,
        losses,
        2 if precision == "bf16" else 4,
        *parameter_layout(model),
        input_bytes=sample_bytes(model, context, seq_len),
    )
    measured.ema = ema
    measured.gathered_teacher = max(  # one forward's gathered tensors at a time
        (
            sum(p.numel() for module in (term.visual, term.head) for p in module.parameters())
            for term in terms
            if isinstance(term, TeacherTerm)
        ),
        default=0,
    )
    if teacher:
        structure: Any = targets.structure(targets.resolve(teacher))  # an open_clip model
        measured.teacher_parameters = sum(p.numel() for p in structure.parameters())
        with torch.no_grad():  # the feature dim: a forward on the meta device computes nothing
            measured.teacher_dim = structure.encode_text(
                torch.zeros(1, structure.context_length, dtype=torch.long, device="meta")
            ).shape[-1]
    return measured


def parameter_layout(model) -> tuple[list[tuple[int, ...]], list[int]]:
    """(every parameter's shape, the parameter count of each transformer block): what sharding needs."""
    return (
        [tuple(p.shape) for p in model.parameters()],
        [sum(p.numel() for p in block.parameters()) for block in transformer_blocks(model)],
    )


def breakdown(
    m: Measurements,
    backend: str,
    world_size: int,
    local_batch: int,
    micro_batch: int,
    parallel: str = "ddp",
    host: Host | None = None,
) -> dict:
    """Per-device bytes (and host bytes per node) of one configuration (see the module docstring);
    micro_batch = local_batch: no gradient caching."""
    host = host or Host()
    act, dim = m.activations, m.activations.feature_dim
    global_batch = local_batch * world_size
    params = m.state_bytes(world_size, parallel)
    buffers = m.fsdp_buffers() if parallel == "fsdp" else 0
    loss_kept = m.losses[backend].bytes(local_batch, global_batch, dim)
    loss = loss_kept + build(backend).transient_bytes(local_batch, global_batch, dim, m.feature_bytes)
    micro_batch = min(micro_batch, local_batch)
    inputs = micro_batch * m.input_bytes
    if micro_batch < local_batch:
        cached = 4 * local_batch * dim * m.feature_bytes  # image + text features and their gradients
        activations = act.bytes(micro_batch)
        held = max(loss, activations)  # the loss's graph is gone before the chunks re-run
        kept = max(loss_kept, activations)
    else:
        cached, activations = 0, act.bytes(local_batch)
        held, kept = activations + loss, activations + loss_kept
    pieces = local_batch // micro_batch  # the loader reads the batch in pieces of a chunk
    host_bytes = host.ranks_per_node * held_samples(local_batch, host.loader_workers, pieces) * m.input_bytes
    teacher = m.teacher_bytes(local_batch) + (4 * m.gathered_teacher if parallel == "fsdp" else 0)
    terms = {"activations": activations, "loss": loss, "cached features": cached, "inputs": inputs}
    return {
        "parameters_optimizer": params,
        "activations": activations,
        "cached_features": cached,
        "loss_buffers": loss,
        "inputs": inputs,
        "communication_buffers": buffers,
        "teacher": teacher,
        "peak": params + buffers + inputs + cached + held + teacher,
        "host_per_node": host_bytes,
        "growing": max(terms, key=lambda name: terms[name]),  # the largest term that grows with the batch
        "kept_for_backward": kept,
    }  # what autograd holds at most: what SavedTensorMeter measures


def sent_bytes(m: Measurements, backend: str, world_size: int, local_batch: int, parallel: str = "ddp") -> float:
    loss_fn = build(backend)
    share, params = (world_size - 1) / world_size, m.activations.parameters
    weights = 2 * share * params * 4 if parallel == "ddp" else share * params * (m.gathers() * m.feature_bytes + 4)
    return loss_fn.sent_bytes_per_rank(local_batch, world_size, m.activations.feature_dim, 4) + weights


def _fits(parts: dict, device_bytes: float, host: Host) -> bool:
    return parts["peak"] <= device_bytes and parts["host_per_node"] <= host.memory


def largest_local_batch(
    m: Measurements,
    backend: str,
    world_size: int,
    chunks: int | None,
    device_bytes: int,
    parallel: str = "ddp",
    host: Host | None = None,
    micro_batch: int | None = None,
) -> tuple[int, str]:
    """(the largest b that fits on the device and the host, what stops a larger one; 0 if none fits) with
    `chunks` chunks per batch, or chunks of `micro_batch` samples."""
    host = host or Host()
    if micro_batch is None and chunks is None:
        raise ValueError("largest_local_batch: give chunks or micro_batch")
    step = 1 if micro_batch is not None else cast(int, chunks)

    def parts(b):
        size = micro_batch if micro_batch is not None else -(-b // step)
        return breakdown(m, backend, world_size, b, size, parallel, host)

    def fits(b):
        return _fits(parts(b), device_bytes, host)

    low = step
    if not fits(low):
        return 0, limit_of(parts(low), device_bytes, host)
    high = low * 2
    while fits(high):
        low, high = high, high * 2
        if high > 1 << 40:
            return low, "none below 2^40 samples"
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low, limit_of(parts(high), device_bytes, host)


def limit_of(parts: dict, device_bytes: float, host: Host) -> str:
    """What a configuration that does not fit runs out of, and the term that grows into it."""
    if parts["peak"] > device_bytes:
        return f"device: {parts['growing']}"
    return "host: inputs"


def auto_micro_batch(
    m: Measurements, backend: str, world_size: int, device_bytes: int, parallel: str, host: Host
) -> tuple[int, int, str]:
    """--chunks auto: (chunk size, its largest local batch, its limit); see the module docstring."""
    found = []
    size = 1
    while True:
        batch, limit = largest_local_batch(m, backend, world_size, None, device_bytes, parallel, host, size)
        if batch < size:
            break
        found.append((size, batch, limit))
        size *= 2
    if not found:  # not even one sample a chunk fits
        return 1, 0, limit
    best = max(batch for _, batch, _ in found)
    return max((entry for entry in found if entry[1] >= AUTO_CHUNK_SHARE * best), key=lambda entry: entry[0])


def check_request(
    backends: list[str], chunks_options: list[int], world_size: int, global_batch: int, parallel_options=("ddp",)
) -> None:
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
        if chunks == AUTO:
            continue
        if not 1 <= chunks <= global_batch // world_size:
            raise ValueError(f"--chunks {chunks}: need 1 ≤ chunks ≤ the local batch ({global_batch // world_size})")
    for backend in backends:
        build(backend)


AUTO = 0  # --chunks auto


def plan(
    m: Measurements,
    backends: list[str],
    chunks_options: list[int],
    world_size: int,
    global_batch: int,
    device_bytes: int,
    parallel_options: tuple[str, ...] = ("ddp",),
    host: Host | None = None,
) -> list[PlanRow]:
    """One row per (parallel, backend, chunks): the requested batch's figures and the largest batch.
    chunks AUTO: the chunk size from auto_micro_batch, kept for the requested and the largest batch."""
    host = host or Host()
    check_request(backends, chunks_options, world_size, global_batch, parallel_options)
    local_batch = global_batch // world_size
    rows = []
    for parallel in parallel_options:
        for backend in backends:
            for chunks in chunks_options:
                auto = chunks == AUTO
                if auto:  # chunks of `micro` samples (the auto size), for this batch and the largest
                    micro, largest, limit = auto_micro_batch(m, backend, world_size, device_bytes, parallel, host)
                    chunks = -(-local_batch // micro)
                else:
                    micro = -(-local_batch // chunks)
                    largest, limit = largest_local_batch(m, backend, world_size, chunks, device_bytes, parallel, host)
                parts = breakdown(m, backend, world_size, local_batch, min(micro, local_batch), parallel, host)
                del parts["growing"], parts["kept_for_backward"]
                rows.append(
                    PlanRow(
                        backend,
                        chunks,
                        micro,
                        local_batch,
                        global_batch,
                        **parts,
                        fits=_fits(parts, device_bytes, host),
                        sent_bytes_per_step=sent_bytes(m, backend, world_size, local_batch, parallel),
                        max_global_batch=world_size * largest,
                        limit=limit,
                        parallel=parallel,
                        chunk_size=micro if auto else None,
                    )
                )
    return rows


def rows_as_dicts(rows: list[PlanRow]) -> list[dict]:
    return [asdict(row) for row in rows]
