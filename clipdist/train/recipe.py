"""The recipe said back: what a run trains, in a few lines at its start (console and train.log), and one-line
warnings for settings that run but do not do what their writer meant.

    model clipdist-tiny: 3.4M parameters, 3.4M trained (image tower locked: 0 of 1.9M trained)
    optimizer adamw (lr 0.002, weight decay 0.1, ...); cosine schedule, warmup 50 of 600 steps; precision fp32
    loss disco: contrastive_loss × 1 + caption_loss × 2; global batch 128 (2 rank(s) × 64)
    data: 4 train shard(s) in 1 source(s); evaluation: val
"""

from __future__ import annotations

import torch

from clipdist.config import TrainConfig
from clipdist.data import tables
from clipdist.data.sources import Shards
from clipdist.distributed.parallel import uses_cuda
from clipdist.model.factory import built_model_config
from clipdist.model.short_text import trims_exactly
from clipdist.registry.losses import BACKENDS, CLIP

SCALARS = ("logit_scale", "logit_bias")


def _millions(count: int) -> str:
    return f"{count / 1e6:.1f}M" if count >= 100_000 else f"{count:,}"


def _tower(parameters) -> tuple[int, int]:
    """(trained, total) parameter counts."""
    parameters = list(parameters)
    return sum(p.numel() for p in parameters if p.requires_grad), sum(p.numel() for p in parameters)


def model_line(cfg: TrainConfig, model: torch.nn.Module) -> str:
    """Parameters trained of the total, and how much of each locked tower still trains."""
    trained, total = _tower(model.parameters())
    image = _tower(model.get_submodule("visual").parameters())
    text = _tower(p for name, p in model.named_parameters() if not name.startswith("visual.") and name not in SCALARS)
    locks = [
        f"{name} tower locked: {_millions(part[0])} of {_millions(part[1])} trained"
        for name, locked, part in (("image", cfg.model.lock_image, image), ("text", cfg.model.lock_text, text))
        if locked
    ]
    return f"model {cfg.model.name}: {_millions(total)} parameters, {_millions(trained)} trained" + (
        f" ({'; '.join(locks)})" if locks else ""
    )


def recipe(
    cfg: TrainConfig,
    model: torch.nn.Module,
    objective,
    world_size: int,
    chunks: int,
    precision: str,
    shards: Shards,
    budget=None,
    trim_text: bool = False,
) -> list[str]:
    """The start banner's lines (`budget`: a NaFlex run's data.naflex.TokenBudget; `trim_text`: the step cuts
    captions to the batch's longest)."""
    optim = cfg.optim
    settings = [f"lr {optim.lr:g}", f"weight decay {optim.weight_decay:g}"]
    settings += [f"betas {list(optim.betas)}"] if optim.betas is not None else []
    settings += [f"eps {optim.eps:g}"] if optim.eps is not None else []
    settings += [f"grad clip {optim.grad_clip:g}" if optim.grad_clip else "no grad clip"]
    terms = " + ".join(
        f"{term.name} × {weight:g}"
        + (f" ({term.shape})" if term.shape else "")
        + (f" from step {objective.starts[term.name]}" if objective.starts.get(term.name, 1) > 1 else "")
        + (" (after the last step: it never counts)" if objective.starts.get(term.name, 1) > optim.max_steps else "")
        for term, weight in objective.terms
    )
    caching = f", {chunks} gradient-caching chunks" if chunks > 1 else ""
    kept = str(cfg.world.parallel) == "fsdp" and not cfg.world.reshard_after_forward
    parallel = f"{cfg.world.parallel}{' (gathered weights kept)' if kept else ''}"
    evals, rows = ", ".join(evalset.name for evalset in shards.evals) or "none", table_rows(shards)
    batch = (
        f"global batch {cfg.world.batch_per_device * world_size} ({world_size} rank(s) × {cfg.world.batch_per_device}"
    )
    if budget is not None:
        sizes = ", ".join(f"{length}: {budget.max_tokens // length}" for length in budget.seq_lens)
        batch = (
            f"global batch of {budget.max_tokens} image patches (samples at each sequence length: {sizes}; "
            f"{world_size} rank(s)"
        )
    return [
        model_line(cfg, model),
        f"optimizer {optim.name} ({', '.join(settings)}); {optim.schedule} schedule, warmup {optim.warmup_steps} of "
        f"{optim.max_steps} steps; precision {precision}",
        f"loss {cfg.loss.name}: {terms}; {batch}{caching}); {parallel}",
        f"data: {len(shards.train)} train shard(s) in {len(shards.sources)} source(s)"
        + (f", {rows:,} rows" if rows else "")
        + f"; evaluation: {evals}; {captions_line(cfg, model, trim_text)}",
    ]


def captions_line(cfg: TrainConfig, model: torch.nn.Module, trimmed: bool) -> str:
    """How captions are padded, and why not to the batch's longest where they are not."""
    if trimmed:
        return "captions padded to the batch's longest"
    reason = trims_exactly(model)
    if cfg.data.trim_text is False:
        why = "data.trim_text=false"
    elif reason:
        why = reason
    elif cfg.data.trim_text is None:
        why = "data.trim_text=null cuts them in fp32 only; data.trim_text=true cuts them under autocast too"
    else:
        why = "the teacher's text tower cannot take them shorter"
    return f"captions padded to the context length ({why})"


def table_rows(shards: Shards) -> int | None:
    """The training rows where every shard is a table part (the only kind whose size is known before reading)."""
    return tables.total_rows(shards.train)


def _naflex(cfg: TrainConfig) -> bool:
    """Whether the run's image tower is a NaFlex one, read from its model config (a name the checks before any
    rank cannot resolve is theirs to refuse: not one here)."""
    try:
        built = built_model_config(cfg.model.name, {"image_tower": cfg.model.image_tower})
    except (RuntimeError, ValueError, OSError):
        return False
    return "naflex" in str((built.get("vision_cfg") or {}).get("timm_model_name", ""))


def traps(cfg: TrainConfig, shards: Shards) -> list[str]:
    """Warnings for settings that run but do not do what they seem to: a warmup as long as the run (the lr never
    reaches optim.lr), half precision on a CPU (slower than fp32), a compile mode with compile off, FSDP2's reshard
    setting under DDP, a global batch larger than the data (every batch holds pairs twice: false negatives) or of one
    pair under a softmax loss (0 whatever the weights)."""
    found, optim = [], cfg.optim
    if optim.warmup_steps >= optim.max_steps:
        found.append(
            f"optim.warmup_steps={optim.warmup_steps} is not below optim.max_steps={optim.max_steps}: the lr "
            f"never reaches optim.lr={optim.lr:g}; lower the warmup or raise max_steps"
        )
    if str(cfg.precision) not in ("fp32", "auto") and not uses_cuda(str(cfg.world.device)):  # auto: fp32 on a CPU
        found.append(
            f"precision={cfg.precision} on a CPU rank: CPUs without bfloat16/float16 units run it far slower than "
            "fp32 (a 64-px ViT-B/32 took 37-52 s a step in bf16 on this project's 2-core machine); "
            "use precision=fp32 on a CPU"
        )
    if str(cfg.model.compile_mode) != "default" and cfg.model.compile is False:
        found.append(f"model.compile_mode={cfg.model.compile_mode.name} with model.compile=false: nothing is compiled")
    if not cfg.world.reshard_after_forward and str(cfg.world.parallel) != "fsdp":
        found.append(
            f"world.reshard_after_forward=false with world.parallel={cfg.world.parallel}: it is FSDP2's setting, "
            "and nothing is resharded under DDP"
        )
    teacher_terms = [name for name in ("self_distill", "masked") if getattr(cfg.loss, name).on]
    if teacher_terms and _naflex(cfg):
        found.append(
            f"loss.{' and loss.'.join(teacher_terms)} on a NaFlex tower: an extension, not SigLIP 2's recipe (the "
            "paper trains its NaFlex variant with the sigmoid loss and the decoder alone: recipe=siglip2_naflex)"
        )
    rows, batch = table_rows(shards), cfg.world.batch_per_device * cfg.world.world_size
    if rows is not None and batch > rows:
        found.append(
            f"the global batch {batch} is larger than the {rows} rows of data.train_shards: every batch "
            "holds some pairs twice, false negatives for a contrastive loss; lower world.batch_per_device"
        )
    softmax = cfg.loss.name in BACKENDS and BACKENDS[cfg.loss.name].reference == CLIP
    if batch == 1 and softmax and not _naflex(cfg):  # a NaFlex batch is a token budget, not batch_per_device
        found.append(
            f"a global batch of 1 with loss={cfg.loss.name}: CLIP's softmax over one pair is log 1 = 0 whatever the "
            "weights, so the contrastive term trains nothing; give a step 2 or more samples"
        )
    return found
