"""The optimizer and its schedule, built from `optim` config: AdamW with decoupled weight decay on the
matrices only, linear warmup then cosine decay to 0."""
from __future__ import annotations

import math

import torch


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters in two groups: decayed, and not (gains, biases, logit scale/bias, positional
    embeddings — open_clip's rule)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "logit_" in name or "positional" in name else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(warmup_steps: int, max_steps: int):
    """The learning-rate factor at a step: (step + 1) / warmup during warmup, then ½(1 + cos(π·progress))."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def build_optimizer(model: torch.nn.Module, optim):
    """(AdamW, its LambdaLR schedule) for `model`'s trainable parameters."""
    groups = parameter_groups(model, optim.weight_decay)
    # The fused kernel (CPU and CUDA) updates all parameters in one call: for a small model on the CPU the
    # default per-parameter loop costs ~15x more (26.5 vs 1.8 ms a step for the tiny model's 62 tensors).
    params = [param for group in groups for param in group["params"]]
    fused = all(param.device.type in ("cpu", "cuda") and param.is_floating_point() for param in params)
    optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, fused=fused or None)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(optim.warmup_steps, optim.max_steps))
