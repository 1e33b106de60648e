"""The optimizer and its schedule, built from `optim` config.

    optimizer, scheduler = build_optimizer(model, cfg.optim)

- Optimizer: `adamw` is torch's AdamW (fused kernel); any other name is timm's optimizer factory
  (`lion`, `lamb`, `nadamw`, `sgd`, ...; open_clip's `timm/<name>` spelling is accepted), given the
  betas / eps / momentum it takes and `optim.kwargs`.
- Parameter groups: decoupled weight decay on the matrices only — every parameter with ndim < 2 and every
  name containing an `optim.no_decay` pattern (default bn, ln, bias, logit_scale: open_clip_train's rule) is left
  undecayed; with a timm optimizer also what `model.no_weight_decay()` names (the positional embeddings), as
  open_clip_train's `--opt timm/<name>` leaves to timm; frozen (locked) parameters are left out.
  Layer-wise lr decay per tower (`optim.image_layer_decay`, `optim.text_layer_decay`): with L blocks, the
  stem (patch / token / position embeddings, the pre-norm) is layer 0, block i is layer i + 1, the rest
  (final norm, projection, pooling) is layer L + 1, and layer l's lr is lr · decay^(L + 1 − l).
- Schedule: the registered schedule `optim.schedule` (clipdist.optim.schedules) as a LambdaLR factor.
"""

from __future__ import annotations

import fnmatch
import re

import torch
from timm.optim import create_optimizer_v2, get_optimizer_info, list_optimizers

from clipdist.errors import words
from clipdist.optim.schedules import lr_factor

ADAMW = "adamw"
_BLOCK = re.compile(r"\.(?:resblocks|blocks|layers?)\.(\d+)\.")  # open_clip, timm and HF transformer blocks
_STEM = re.compile(r"embed|conv1|ln_pre|cls_token|patch_|pos_|stem")  # what comes before the blocks (layer 0)


def optimizer_name(name: str) -> str:
    """`name` as timm lists it: open_clip's `timm/lion` is `lion`."""
    return name.lower().removeprefix("timm/")


def hands_to_timm(name: str) -> bool:
    """Whether open_clip_train would build `name` with timm's factory (every optimizer but its own AdamW, and
    `timm/adamw` too): its decay groups are then timm's, which also leave `model.no_weight_decay()` undecayed."""
    return optimizer_name(name) != ADAMW or name.lower().startswith("timm/")


def check_optimizer(name: str) -> None:
    """A ValueError naming the choices when `name` is neither adamw nor one of timm's optimizers."""
    if optimizer_name(name) == ADAMW:
        return
    timm_names = [str(known) for known in list_optimizers()]
    if optimizer_name(name) not in timm_names:
        known = ", ".join(n for n in timm_names if not n.startswith(("bnb", "c")))
        raise ValueError(f"optim.name={name}: no such optimizer; adamw (torch's) or one of timm's: {known}")


def tower_of(name: str) -> str | None:
    """Which tower a parameter belongs to ('image', 'text'), or None for the model's scalars."""
    if name.startswith(("logit_scale", "logit_bias")):
        return None
    return "image" if name.startswith("visual.") else "text"


def layer_scales(model: torch.nn.Module, decays: dict[str, float | None]) -> dict[str, float]:
    """Each trainable parameter's lr multiplier under layer-wise decay (`decays`: tower -> decay or None)."""
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    scales = dict.fromkeys(names, 1.0)
    for tower, decay in decays.items():
        if decay is None:
            continue
        members = [name for name in names if tower_of(name) == tower]
        blocks = {name: int(found.group(1)) for name in members if (found := _BLOCK.search(name))}
        if not blocks:
            locked = any(_BLOCK.search(name) for name, _ in model.named_parameters() if tower_of(name) == tower)
            raise ValueError(
                f"optim.{tower}_layer_decay: the {tower} tower has no numbered blocks to decay over"
                + (
                    " among its trainable parameters (model.lock_* keeps them all frozen): unlock more of them or drop "
                    "the decay"
                    if locked
                    else ""
                )
            )
        depth = max(blocks.values()) + 1
        for name in members:
            layer = blocks[name] + 1 if name in blocks else 0 if _STEM.search(name) else depth + 1
            scales[name] = decay ** (depth + 1 - layer)
    return scales


def parameter_groups(
    model: torch.nn.Module,
    weight_decay: float,
    no_decay=("bn", "ln", "bias", "logit_scale"),
    decays: dict[str, float | None] | None = None,
    lr: float = 1.0,
    model_no_decay: bool = False,
    part_scales: dict[str, float] | None = None,
) -> list[dict]:
    """Trainable parameters grouped by (decayed or not, lr multiplier); each group's lr is `lr` × its multiplier.
    `model_no_decay`: also leave undecayed what the model's own `no_weight_decay()` names (fnmatch patterns) — the
    rule timm's optimizer factory applies, so open_clip_train's `--opt timm/<name>` (positional embeddings).
    `part_scales`: {a top-level module's name: a multiplier of its parameters' lr} (a term's head: head_lr)."""
    scales = layer_scales(model, decays or {})
    for name in scales:
        scales[name] *= (part_scales or {}).get(name.split(".", 1)[0], 1.0)
    named = getattr(model, "no_weight_decay", None)
    exempt = set(named()) if model_no_decay and callable(named) else set()
    groups: dict[tuple[bool, float], list] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            decayed = (
                param.ndim >= 2
                and not any(pattern in name for pattern in no_decay)
                and not any(fnmatch.fnmatch(name, pattern) for pattern in exempt)
            )
            groups.setdefault((decayed, scales[name]), []).append(param)
    return [  # "lr_scale": the multiplier, as timm's layer-decay groups carry it (run_lr reads it)
        {"params": params, "weight_decay": weight_decay if decayed else 0.0, "lr": lr * scale, "lr_scale": scale}
        for (decayed, scale), params in sorted(groups.items(), key=lambda item: (not item[0][0], -item[0][1]))
    ]


def run_lr(optimizer: torch.optim.Optimizer) -> float:
    """The run's own lr (optim.lr through its schedule) as the optimizer now holds it: a group's lr over its
    multiplier."""
    group = optimizer.param_groups[0]
    return group["lr"] / group.get("lr_scale", 1.0)


def create_optimizer(groups: list[dict], optim) -> torch.optim.Optimizer:
    """The optimizer `optim.name` over `groups` (each with its own lr and weight decay)."""
    name = optimizer_name(optim.name)
    params = [param for group in groups for param in group["params"]]
    if name == ADAMW:
        # The fused kernel (CPU and CUDA) updates all parameters in one call: for a small model on the CPU the
        # default per-parameter loop costs ~15x more (26.5 vs 1.8 ms a step for the tiny model's 62 tensors).
        fused = all(param.device.type in ("cpu", "cuda") and param.is_floating_point() for param in params)
        options = {"betas": tuple(optim.betas)} if optim.betas else {}
        if optim.eps is not None:
            options["eps"] = optim.eps
        return torch.optim.AdamW(groups, lr=optim.lr, fused=fused or None, **{**options, **optim.kwargs})
    info, options = get_optimizer_info(name), {}
    if info.has_betas and optim.betas:
        options["betas"] = tuple(optim.betas)  # as many as it takes (check_optim)
    if info.has_eps and optim.eps is not None:
        options["eps"] = optim.eps
    if info.has_momentum and optim.momentum is not None:
        options["momentum"] = optim.momentum
    return create_optimizer_v2(
        groups, opt=name, lr=optim.lr, weight_decay=optim.weight_decay, **{**options, **optim.kwargs}
    )


def build_optimizer(
    model: torch.nn.Module, optim, part_scales: dict[str, float] | None = None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """(the optimizer, its LambdaLR schedule) for `model`'s trainable parameters; `part_scales` multiplies the lr of
    a top-level module's (registry.terms.part_lr_scales: the teacher terms' heads)."""
    groups = parameter_groups(
        model,
        optim.weight_decay,
        tuple(optim.no_decay),
        {"image": optim.image_layer_decay, "text": optim.text_layer_decay},
        optim.lr,
        model_no_decay=hands_to_timm(optim.name),  # timm's factory skips model.no_weight_decay()
        part_scales=part_scales,
    )
    optimizer = create_optimizer(groups, optim)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(optim))


def check_optim(optim, on_cuda: bool = False) -> None:
    """Before any rank starts: the optimizer takes these options and steps with them (on a stand-in parameter, on
    the CPU), and the schedule can run. A ValueError says what to change. `on_cuda`: the ranks' devices are CUDA ones
    (apex's fused optimizers, which run there only, are then left to apex)."""
    check_optimizer(optim.name)
    name = optimizer_name(optim.name)
    info, defaults = get_optimizer_info(name), type(optim)()
    for key, taken in (("momentum", info.has_momentum), ("betas", info.has_betas), ("eps", info.has_eps)):
        value = getattr(optim, key)
        if not taken and value is not None and value != getattr(defaults, key):  # dropped by create_optimizer
            raise ValueError(f"optim.{key}={value}: optim.name={optim.name} takes no {key}; drop it")
    if info.has_betas and optim.betas and len(optim.betas) != info.num_betas:
        raise ValueError(
            f"optim.betas={list(optim.betas)}: optim.name={optim.name} takes {info.num_betas} betas; give "
            f"{info.num_betas}, or optim.betas=null for its own"
        )
    if info.second_order:
        raise ValueError(
            f"optim.name={optim.name} is a second-order optimizer (it needs backward(create_graph=True)), which "
            "clipdist's step does not run; choose a first-order one"
        )
    for key in ("image_layer_decay", "text_layer_decay"):
        value = getattr(optim, key)
        if value is not None and not 0 < value <= 1:
            raise ValueError(f"optim.{key}={value}: must be in (0, 1]")
    if on_cuda and name.startswith("fused"):  # apex's: built on CUDA parameters only
        return
    stand_in = torch.nn.Parameter(torch.zeros(2, 2))
    stand_in.grad = torch.zeros(2, 2)
    try:
        create_optimizer([{"params": [stand_in], "lr": optim.lr}], optim).step()
    except Exception as error:  # noqa: BLE001 -- anything its constructor or step raises on a stand-in: the options'
        said = words(error, 200) or type(error).__name__
        raise ValueError(f"optim.name={optim.name} with {dict(optim.kwargs) or 'these options'}: {said}") from None
