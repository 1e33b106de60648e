"""Prove a distributed loss exact: one DDP (or FSDP) step on N gloo ranks vs one process on the whole batch.

Every parameter's gradient is compared with the single-process reference and classified:
exact, 1/N, N×, another pure rescaling, missing, or wrong (not a rescaling: terms dropped).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from omegaconf.errors import OmegaConfBaseException

from clipdist.config import LossConfig, to_train_config, validate
from clipdist.data.batch import Batch
from clipdist.defaults import COLLECTIVE_TIMEOUT_S, DEFAULT_MODEL
from clipdist.distributed.launch import launch_local
from clipdist.distributed.parallel import full_tensor, wrap_model
from clipdist.losses import BACKENDS, build, clip_loss
from clipdist.model.factory import (
    caption_weight,
    check_logit_bias,
    create_model,
    create_model_for_loss,
    get_tokenizer,
    has_caption_decoder,
    lock_towers,
    random_tokens,
)
from clipdist.model.precision import gradient_scaler
from clipdist.model.timm_towers import float32_parameters, naflex_patch_size, naflex_trunk, random_patches
from clipdist.objective import TermContext, build_objective
from clipdist.registry.terms import TERMS, SelfDistillOptions
from clipdist.train.step import build_step

SCALAR_PARAMETERS = ("logit_scale", "logit_bias")
TOLERANCE = {"float64": 1e-9, "float32": 1e-4}
FLOAT32_TOLERANCE = 1e-6  # a parameter the tower differentiates in float32 (timm_towers.float32_parameters), at float64


def resolve_loss(spec: str, options: Mapping[str, Any] | None = None) -> Callable:
    """A registered backend name (built with its `options`), or 'package.module:attribute' naming a loss callable
    or class."""
    if spec in BACKENDS:
        return build(spec, **as_train_reads(spec, options or {}).options())
    if ":" not in spec:
        raise ValueError(
            f"unknown loss backend {spec!r}; choose one of: {', '.join(BACKENDS)}, "
            "or name your own loss as 'package.module:name'"
        )
    if options:
        raise ValueError(f"--option {', '.join(options)}: options are for a registered backend, not {spec}")
    module_name, attribute = spec.split(":", 1)
    try:
        loss = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--loss {spec!r}: cannot import it ({error})") from None
    loss = loss() if inspect.isclass(loss) else loss
    if not callable(loss):
        raise ValueError(f"--loss {spec!r} is not callable: name a loss function or class")
    try:
        inspect.signature(loss).bind(None, None, None)
    except TypeError as error:
        raise ValueError(
            f"--loss {spec!r} cannot be called as loss(image_features, text_features, logit_scale): {error}"
        ) from None
    except ValueError:  # no signature to read (some builtins): the call itself will tell
        pass
    return loss


NAFLEX_PATCHES = 12  # a NaFlex check's sequence length: every row its own grid of at most this many patches


def _random_batch(global_batch: int, model_name: str, seed: int, dtype: torch.dtype) -> Batch:
    """The check's global batch: random 32 px images (a NaFlex tower: random grids of patches, each row its own
    aspect and length, padded) and random captions."""
    generator = torch.Generator().manual_seed(seed + 1)
    structure = create_model(model_name, device="meta")
    images: torch.Tensor | dict[str, torch.Tensor]
    if naflex_trunk(structure) is not None:
        images = random_patches(global_batch, naflex_patch_size(structure), NAFLEX_PATCHES, generator, dtype)
    else:
        images = torch.randn(global_batch, 3, 32, 32, generator=generator, dtype=dtype)
    return Batch.of(images, random_tokens(global_batch, get_tokenizer(model_name).context_length, generator))


@dataclass(frozen=True)
class Locks:
    """Locked towers as model.lock_* config gives them: None for a trainable tower, else the number of its last
    layer groups (image) or layers (text) left unlocked."""

    image: int | None = None
    text: int | None = None

    def apply(self, model: torch.nn.Module) -> None:

        lock_towers(
            model,
            SimpleNamespace(
                lock_image=self.image is not None,
                lock_image_unlocked_groups=self.image or 0,
                lock_image_freeze_bn_stats=False,
                lock_text=self.text is not None,
                lock_text_unlocked_layers=self.text or 0,
                lock_text_freeze_layer_norm=True,
            ),
        )


@dataclass(frozen=True)
class Terms:
    """The terms a check adds beside the contrastive one (and a CoCa model's caption term)."""

    distill: bool = False  # loss.distill against a teacher: the same structure, other weights (seed + 1)
    # registered terms by name, each with its options (its registry entry's `probe`, then the check's --option
    # values); the EMA teacher of those that learn from one is another model's weights (seed + 1), each centre drawn
    # at random (as after some steps)
    own: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def named(cls, names: Sequence[str], options: Mapping[str, Any]) -> Terms:
        """The terms `names` (any registered: `distill` is the teacher check), each given its `<name>.<key>`
        options, typed and bounded as train.py takes them (`as_train_reads`); a ValueError for an unknown term or a
        bad option."""
        unknown = [name for name in names if name not in TERMS]
        if unknown:
            raise ValueError(f"--term {', '.join(unknown)}: choose from {', '.join(TERMS)}")
        stray = sorted({key.split(".")[0] for key in options} - (set(names) - {"distill"}))
        if stray:
            hint = "the check's teacher is its own" if stray[0] == "distill" else f"add --term {stray[0]} for them"
            raise ValueError(f"--option {stray[0]}.…: {hint}")
        own = [name for name in dict.fromkeys(names) if name != "distill"]
        sections: dict[str, dict] = {name: dict(TERMS[name].probe) for name in own}
        for key, value in options.items():
            sections[key.split(".")[0]][key.split(".", 1)[1]] = value
        loss = as_train_reads(LossConfig.name, sections)
        return cls("distill" in names, tuple((name, loss.term(name)) for name in own))


def as_train_reads(backend: str, given: Mapping[str, Any]) -> LossConfig:
    """`loss.<key>` values as train.py reads them: typed by the run's schema (with `backend`'s own options) and held
    to its checks (bounds, a term's own check, with the EMA teacher the check's teacher terms stand for); a
    ValueError naming the key."""
    run = {"name": "gradcheck", "run_dir": ".", "optim": {"ema": {"decay": 0.999}}}
    try:
        cfg = to_train_config({**run, "loss": {**given, "name": backend}})
        validate(cfg)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or "loss"
        raise ValueError(f"--option {str(key).removeprefix('loss.')}: {str(error).splitlines()[0]}") from None
    return cfg.loss


def _term_options(options, model: torch.nn.Module):
    """A term's options; a NaFlex tower's views at the default grid for the batch's sequence length (crop_size 0)."""
    if isinstance(options, SelfDistillOptions) and naflex_trunk(model) is not None:
        return dataclasses.replace(options, crop_size=0)
    return options


def _teacher(model_name: str, seed: int, dtype: torch.dtype):
    """The distillation check's teacher: the same structure, other weights (seed + 1), frozen, in eval mode."""
    torch.manual_seed(seed + 1)
    return create_model(model_name, init_logit_scale=math.log(30.0)).to(dtype).eval().requires_grad_(False)


def _objective(loss_fn, model, model_name: str, seed: int, dtype: torch.dtype, terms: Terms = Terms()):
    """What training minimises with this model: the loss alone, or for a CoCa model with open_clip's default
    caption weight (2) beside it; with `terms.distill`, the distillation term (weight 1) against a teacher, in small
    tiles; each of `terms.own` (weight 1) against another model's weights, built by its registry entry."""
    weight = caption_weight(LossConfig(), has_caption_decoder(model), "")
    teacher = _teacher(model_name, seed, dtype) if terms.distill else None
    objective = build_objective(
        loss_fn, caption_weight=weight, pad_id=getattr(model, "pad_id", 0), teacher=teacher, tile=3
    )
    if terms.own:
        other = _model(model_name, seed + 1, dtype, loss_fn, terms=terms)
        weights = {name: tensor.detach() for name, tensor in other.named_parameters()}
        context = TermContext(model, seed=seed, teacher=lambda: weights)
        objective.terms += [
            (TERMS[name].load()(_term_options(options, model), context), 1.0) for name, options in terms.own
        ]
    return objective


SCALE = 2.0**10  # the gradient scaler's scale when the check runs with one (a power of two: scaling is exact)


def _model(model_name: str, seed: int, dtype: torch.dtype, loss_fn, locks: Locks = Locks(), terms: Terms = Terms()):
    torch.manual_seed(seed)
    model = create_model_for_loss(model_name, loss_fn, init_logit_scale=math.log(1 / 0.07)).to(dtype)
    for name, options in terms.own:
        spec = TERMS[name]
        if spec.attach is not None:
            spec.load(spec.attach)(_term_options(options, model), model)
        for name, buffer in model.get_submodule(spec.part).named_buffers() if spec.part else ():
            buffer.normal_()  # a centre, the input moments: as after some steps
            if name.endswith("var"):
                buffer.abs_().add_(0.5)
    locks.apply(model)
    return model


def _rank_step(
    loss_specs: Sequence[str],
    local_sizes: Sequence[int],
    seed: int,
    dtype_name: str,
    model_name: str,
    chunks: int,
    parallel: str = "ddp",
    locks: Locks = Locks(),
    scaler: bool = False,
    terms: Terms = Terms(),
    backend_options: Mapping[str, Any] | None = None,
    reshard_after_forward: bool = True,
):
    """One DDP (or FSDP) step per loss on this rank's slice of the global batch (gradient-cached if chunks > 1;
    with `scaler`, the loss scaled by SCALE through precision=fp16's GradScaler and the gradients unscaled, as
    precision=fp16 trains).

    Rank 0 returns [(mean loss over ranks, {parameter: gradient}), ...]; other ranks None.
    """
    dtype = getattr(torch, dtype_name)
    rank = dist.get_rank()
    start = sum(local_sizes[:rank])
    batch = _random_batch(sum(local_sizes), model_name, seed, dtype).map(lambda t: t[start : start + local_sizes[rank]])
    results = []
    for spec in loss_specs:
        loss_fn = resolve_loss(spec, backend_options)
        model = _model(model_name, seed, dtype, loss_fn, locks, terms)
        # what training runs: DDP's or FSDP's settings and all
        wrapped = wrap_model(model, parallel=parallel, reshard_after_forward=reshard_after_forward)
        grad_scaler = gradient_scaler("fp16", torch.device("cpu"), SCALE) if scaler else None
        objective = _objective(loss_fn, model, model_name, seed, dtype, terms)
        step = build_step(wrapped, objective, chunks=chunks, scaler=grad_scaler)
        loss = step.gradients(batch)
        if grad_scaler is not None:
            grad_scaler.unscale_(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0))
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= dist.get_world_size()
        # Under FSDP each rank holds a shard of every gradient: gathered whole (on every rank: a collective).
        grads = {
            name: (None if p.grad is None else full_tensor(p.grad).clone()) for name, p in model.named_parameters()
        }
        results.append((mean_loss.item(), grads))
    return results if rank == 0 else None


def _reference_step(
    global_batch: int,
    seed: int,
    dtype: torch.dtype,
    model_name: str,
    loss_fn,
    locks: Locks = Locks(),
    terms: Terms = Terms(),
):
    """The loss's own definition (`reference`: clip_loss unless it says otherwise) on one process; a locked
    parameter's gradient is None. With `terms`, plus each term's own definition (open_clip's DistillClipLoss)."""
    model = _model(model_name, seed, dtype, loss_fn, locks, terms)
    batch = _random_batch(global_batch, model_name, seed, dtype)
    objective = _objective(loss_fn, model, model_name, seed, dtype, terms)
    loss = objective.reference(model(**batch), batch)  # each term's definition
    loss.backward()
    return loss.item(), {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


@dataclass
class ParameterCheck:
    name: str
    rel_err: float  # ||g - g_ref|| / ||g_ref||
    ratio: float | None  # least-squares scale: g ≈ ratio · g_ref
    verdict: str


@dataclass
class GradcheckReport:
    backend: str
    world_size: int
    local_batch_sizes: list[int]
    dtype: str
    tolerance: float
    loss: float
    reference_loss: float
    loss_rel_err: float
    max_rel_err: float
    exact: bool
    parameters: list[ParameterCheck] = field(default_factory=list)
    diagnosis: list[str] = field(default_factory=list)
    chunks: int = 1  # gradient-caching chunks per rank
    parallel: str = "ddp"  # ddp | fsdp
    reshard_after_forward: bool = True  # fsdp: false keeps each block's gathered weights from forward to backward
    locks: dict = field(default_factory=dict)  # {"image": unlocked groups, "text": unlocked layers} of locked towers
    scaler: bool = False  # gradients scaled and unscaled by a GradScaler (precision=fp16's path)
    distill: bool = False  # with the distillation term against a teacher (loss.distill)
    terms: list[str] = field(default_factory=list)  # with these registered terms (their options: `options`)
    options: dict[str, Any] = field(default_factory=dict)  # the backend's and the terms' options the check was given
    locked_parameters: int = 0  # parameters that got no gradient, as in the reference
    float32_parameters: list[str] = field(default_factory=list)  # compared at FLOAT32_TOLERANCE: the tower's float32

    def to_dict(self) -> dict:
        return asdict(self)


def classify(grad: torch.Tensor | None, reference: torch.Tensor | None, world_size: int, tolerance: float):
    """(rel_err, ratio, verdict) of one gradient against its reference (None: a locked parameter)."""
    if reference is None:
        return (0.0, None, "exact") if grad is None else (math.inf, None, "spurious")
    ref_norm = reference.norm().item()
    if grad is None or (grad.norm().item() == 0 and ref_norm > 0):
        return math.inf, 0.0, "missing"
    if ref_norm == 0:
        return (0.0, None, "exact") if grad.norm().item() == 0 else (math.inf, None, "spurious")
    rel_err = (grad - reference).norm().item() / ref_norm
    if rel_err <= tolerance:
        return rel_err, 1.0, "exact"
    ratio = (grad * reference).sum().item() / ref_norm**2
    residual = (grad - ratio * reference).norm().item() / grad.norm().item()
    if residual > max(tolerance, 1e-6) * 10:
        return rel_err, ratio, "wrong"
    for factor, label in ((1 / world_size, "1/N"), (world_size, "N×")):
        if abs(ratio / factor - 1) < 1e-3:
            return rel_err, ratio, label
    return rel_err, ratio, f"×{ratio:.4g}"


def _diagnose(checks: list[ParameterCheck], loss_ratio: float, loss_exact: bool, world_size: int) -> list[str]:
    notes = []
    encoders = [c for c in checks if c.name not in SCALAR_PARAMETERS and c.verdict != "exact"]
    scalars = [c for c in checks if c.name in SCALAR_PARAMETERS and c.verdict != "exact"]
    verdicts = {c.verdict for c in encoders}
    if not loss_exact:
        notes.append(
            f"loss value: the mean over ranks is {loss_ratio:.4g}× the single-process loss on the global batch"
        )
    if "missing" in verdicts:
        notes.append(
            f"{sum(c.verdict == 'missing' for c in encoders)} encoder parameters get no gradient at all: "
            "the loss never reaches their features (detached or gathered without autograd, own slice not put back)"
        )
    if "1/N" in verdicts:
        notes.append(
            f"encoder gradients are 1/N (N={world_size}) of the single-process gradient: the gather's backward "
            "does not sum over ranks (returns grads[rank] only, or averages), or the own-slice pattern lacks "
            "its ×N. Sum in the gather's backward (reduce-scatter), or scale the local features' gradient by N"
        )
    if "N×" in verdicts:
        notes.append(
            f"encoder gradients are N× (N={world_size}) the single-process gradient: the loss is multiplied "
            "by N on top of a gather whose backward already sums over ranks"
        )
    if "wrong" in verdicts:
        notes.append(
            "encoder gradients are not a rescaling of the reference: terms are dropped — typically columns "
            "gathered without autograd, so a sample's role as another rank's negative never reaches its encoder"
        )
    for check in scalars:
        if check.verdict == "N×":
            notes.append(
                f"{check.name}: N× its true gradient — the loss was multiplied by the world size to repair the "
                "encoders. Scale the gradient into the local features instead, never the loss"
            )
        else:
            notes.append(f"{check.name}: gradient is {check.verdict} of the single-process gradient")
    return notes


def run_gradchecks(
    losses: Sequence[str],
    world_size: int = 2,
    local_batch: int | Sequence[int] = 4,
    dtype: str = "float64",
    model: str = DEFAULT_MODEL,
    seed: int = 0,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
    chunks: int = 1,
    parallel: str = "ddp",
    lock_image: int | None = None,
    lock_text: int | None = None,
    scaler: bool = False,
    distill: bool = False,
    terms: Sequence[str] = (),
    options: Mapping[str, Any] | None = None,
    reshard_after_forward: bool = True,
) -> list[GradcheckReport]:
    """Check several losses in one launch; `local_batch` is one size for every rank or one per rank.

    chunks > 1 runs each rank's step with gradient caching (clipdist.train.step) in that many chunks;
    parallel="fsdp" shards the model with FSDP2 (clipdist.distributed.parallel.wrap_model) instead of DDP, each
    block's gathered weights kept from forward to backward where not `reshard_after_forward`;
    lock_image / lock_text lock that tower with open_clip's lock functions, leaving its last N groups / layers
    trainable (as model.lock_* config does); scaler runs the step with precision=fp16's gradient scaler;
    distill adds the distillation term (loss.distill) against a teacher of the same structure with other weights,
    checked against open_clip's DistillClipLoss on the whole batch; `terms` adds registered terms (TERMS; `distill`
    as `distill=True`) with the options their entries' `probe` gives, any modules of their own on the model, the EMA
    teacher another model's weights, each checked against its own one-process definition. `options`: `key: value`
    for the backend's own options (`tile`) and `<term>.<key>` for a term's (`self_distill.crops`).
    """
    sizes = _local_sizes(parallel, dtype, world_size, local_batch, chunks, reshard_after_forward)
    options = dict(options or {})
    backend_options = {key: value for key, value in options.items() if "." not in key}
    chosen = Terms.named([*terms, *(["distill"] if distill else [])], {k: v for k, v in options.items() if "." in k})
    loss_fns = _losses(losses, backend_options, model)
    locks = Locks(lock_image, lock_text)
    rank_results = launch_local(
        _rank_step,
        world_size,
        list(losses),
        sizes,
        seed,
        dtype,
        model,
        chunks,
        parallel,
        locks,
        scaler,
        chosen,
        backend_options,
        reshard_after_forward,
        timeout_s=timeout_s,
    )[0]  # rank 0's (loss, grads) per backend
    reports = _reports(
        losses, loss_fns, rank_results, sizes, dtype, model, seed, locks, chosen, chunks, parallel, options
    )
    for report in reports:
        report.scaler, report.reshard_after_forward = scaler, reshard_after_forward
    return reports


def _reports(losses, loss_fns, rank_results, sizes, dtype, model, seed, locks, chosen, chunks, parallel, options):
    """Each loss's report: its ranks' step against its definition's one-process step (one per definition)."""
    world_size = len(sizes)
    tolerance = TOLERANCE[dtype]
    in_float32 = sorted(float32_parameters(create_model(model, device="meta"))) if dtype == "float64" else []
    references: dict[tuple, tuple[Any, Any]] = {}  # one single-process step per loss definition, shared by the backends
    reports = []
    for spec, loss_fn, (loss, grads) in zip(losses, loss_fns, rank_results):
        definition = (getattr(loss_fn, "reference", clip_loss), getattr(loss_fn, "uses_logit_bias", False))
        if definition not in references:
            references[definition] = _reference_step(
                sum(sizes), seed, getattr(torch, dtype), model, loss_fn, locks, chosen
            )
        setting = (world_size, sizes, dtype, tolerance, chunks, parallel, in_float32)
        report = _report(spec, loss, grads, *references[definition], *setting)
        report.locks = {tower: n for tower, n in (("image", locks.image), ("text", locks.text)) if n is not None}
        report.distill = chosen.distill
        report.terms, report.options = [name for name, _ in chosen.own], options
        report.locked_parameters = sum(ref is None for ref in references[definition][1].values())
        reports.append(report)
    return reports


def _losses(specs: Sequence[str], backend_options: dict, model: str) -> list:
    """The losses `specs` name, each checked against the model's logit bias: here, not in N workers."""
    loss_fns = [resolve_loss(spec, backend_options) for spec in specs]
    structure = create_model(model, device="meta")
    for spec, loss_fn in zip(specs, loss_fns):
        check_logit_bias(structure, loss_fn, f"--backend {spec}", model)
    return loss_fns


def _local_sizes(
    parallel: str, dtype: str, world_size: int, local_batch, chunks: int, reshard_after_forward: bool = True
) -> list[int]:
    """Each rank's batch; a ValueError for a request that cannot run."""
    if parallel not in ("ddp", "fsdp"):
        raise ValueError(f"parallel={parallel!r}: choose ddp or fsdp")
    if not reshard_after_forward and parallel != "fsdp":
        raise ValueError(f"reshard_after_forward=False is FSDP2's setting; parallel={parallel!r} reshards nothing")
    if dtype not in TOLERANCE:
        raise ValueError(f"dtype must be one of {list(TOLERANCE)}")
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    sizes = [local_batch] * world_size if isinstance(local_batch, int) else list(local_batch)
    if len(sizes) != world_size:
        raise ValueError(f"{len(sizes)} local batch sizes given for world size {world_size}")
    if chunks < 1 or chunks > min(sizes):
        raise ValueError(f"chunks={chunks}: need 1 ≤ chunks ≤ the smallest local batch ({min(sizes)})")
    return sizes


def run_gradcheck(loss: str = "disco", world_size: int = 2, **options) -> GradcheckReport:
    """Check one loss (a backend name or 'package.module:name'); options as run_gradchecks."""
    return run_gradchecks([loss], world_size, **options)[0]


def _report(
    spec,
    loss,
    grads,
    reference_loss,
    reference_grads,
    world_size,
    sizes,
    dtype,
    tolerance,
    chunks,
    parallel,
    in_float32=(),
):
    checks = [
        ParameterCheck(
            name,
            *classify(
                grads[name], ref, world_size, max(tolerance, FLOAT32_TOLERANCE) if name in in_float32 else tolerance
            ),
        )
        for name, ref in reference_grads.items()
    ]
    loss_rel_err = abs(loss - reference_loss) / abs(reference_loss)
    loss_exact = loss_rel_err <= tolerance
    return GradcheckReport(
        backend=spec,
        world_size=world_size,
        local_batch_sizes=sizes,
        dtype=dtype,
        tolerance=tolerance,
        loss=loss,
        reference_loss=reference_loss,
        loss_rel_err=loss_rel_err,
        max_rel_err=max([loss_rel_err] + [c.rel_err for c in checks if c.name not in in_float32]),
        exact=loss_exact and all(c.verdict == "exact" for c in checks),
        parameters=checks,
        diagnosis=_diagnose(checks, loss / reference_loss, loss_exact, world_size)
        + [
            f"{name}: compared at {FLOAT32_TOLERANCE:g} (relative error {check.rel_err:.1e}): the tower computes its "
            "gradient in float32 whatever the weights' dtype"
            for check in checks
            for name in in_float32
            if check.name == name
        ],
        chunks=chunks,
        parallel=parallel,
        float32_parameters=list(in_float32),
    )
