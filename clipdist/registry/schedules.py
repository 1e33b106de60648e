"""The learning-rate schedules: each schedule's name, the function that gives its lr factor after the warmup (imported
when the optimizer is built) and its options — a dataclass whose fields become the keys of its own section,
`optim.<name>.<field>`, read only when `optim.schedule=<name>` (set under another schedule: refused).

    from clipdist.registry.schedules import SCHEDULES
    SCHEDULES["const_cooldown"].options   # CooldownOptions: optim.const_cooldown.steps, .end_lr, .power
    SCHEDULES["cosine"].load()            # clipdist.optim.schedules.cosine

Every schedule shares the linear warmup (`optim.warmup_steps`): the lr at optimizer step s (0-based) is
(s + 1)/W · lr for s < W, then `function(s, optim, options)` · lr. A new schedule is a function, its entry here (or
a plug-in's, group `clipdist.schedules`) and its test."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from clipdist.defaults import WARN, positive
from clipdist.errors import ConfigError
from clipdist.registry import CodeSpec, Registry, plugged


@dataclass
class CooldownOptions:
    """open_clip_train's const_lr_cooldown (--epochs-cooldown, --lr-cooldown-end, --lr-cooldown-power)."""

    RESUME: ClassVar[dict] = {"steps": WARN, "end_lr": WARN, "power": WARN}

    steps: int | None = positive(None)  # the last this many steps decay (needed)
    end_lr: float = 0.0  # the lr at the last step
    power: float = 1.0  # 1: linear decay, else polynomial

    def check(self, optim: Any) -> None:
        """A ConfigError where the cooldown cannot run in this run's steps."""
        if self.steps is None:
            raise ConfigError(
                "optim.schedule=const_cooldown needs optim.const_cooldown.steps (the last N steps decay), e.g. "
                f"optim.const_cooldown.steps={max(1, optim.max_steps // 10)}"
            )
        if self.steps > optim.max_steps - optim.warmup_steps:
            after = max(optim.max_steps - optim.warmup_steps, 0)
            raise ConfigError(
                f"optim.const_cooldown.steps={self.steps} is more than the steps after warmup: {after} "
                f"(optim.max_steps={optim.max_steps} less optim.warmup_steps={optim.warmup_steps}); shorten the "
                "cooldown or the warmup"
            )


@dataclass(frozen=True)
class ScheduleSpec(CodeSpec):
    """`name`: optim.schedule=<name>, its options' section optim.<name>; `target`: "module:function",
    (step, optim, options) -> the lr as a multiple of optim.lr, after the warmup."""

    options: type | None = None  # a dataclass (with `check(optim)` where a combination cannot run)


SCHEDULES: Registry[ScheduleSpec] = plugged(
    "clipdist.schedules",
    ScheduleSpec,
    (
        ScheduleSpec("cosine", "clipdist.optim.schedules:cosine", "cosine decay to 0 at optim.max_steps"),
        ScheduleSpec("const", "clipdist.optim.schedules:const", "optim.lr to the end"),
        ScheduleSpec(
            "const_cooldown",
            "clipdist.optim.schedules:const_cooldown",
            "optim.lr, then the last optim.const_cooldown.steps decay to its end_lr",
            CooldownOptions,
        ),
    ),
)
