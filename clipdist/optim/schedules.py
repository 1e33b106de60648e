"""The built-in lr schedules (clipdist.registry.schedules), open_clip_train's scheduler functions step for step:
each the lr at optimizer step s (0-based, s ≥ W after the warmup) as a multiple of optim.lr.

- `cosine`: ½(1 + cos(π (s − W)/(S − W)))
- `const`: 1
- `const_cooldown`: 1 until S − C, then (1 − e/C)^p · (1 − end/lr) + end/lr with e = s − (S − C)
"""

from __future__ import annotations

import math
from collections.abc import Callable

from clipdist.registry.schedules import SCHEDULES


def cosine(step: int, optim, options: None) -> float:
    progress = (step - optim.warmup_steps) / max(1, optim.max_steps - optim.warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def const(step: int, optim, options: None) -> float:
    return 1.0


def const_cooldown(step: int, optim, options) -> float:
    start = optim.max_steps - options.steps
    if step < start:
        return 1.0
    decay = max(0.0, 1 - (step - start) / options.steps) ** options.power
    end = options.end_lr / optim.lr if optim.lr else 0.0
    return decay * (1 - end) + end


def lr_factor(optim) -> Callable[[int], float]:
    """The lr at optimizer step `step` (0-based) as a multiple of optim.lr: the warmup (s + 1)/W, then the
    schedule `optim.schedule`."""
    spec = SCHEDULES[str(optim.schedule)]
    after_warmup = spec.load()
    options = getattr(optim, spec.name) if spec.options is not None else None

    def factor(step: int) -> float:
        return (step + 1) / optim.warmup_steps if step < optim.warmup_steps else after_warmup(step, optim, options)

    return factor
