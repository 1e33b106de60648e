"""The teacher terms' learning signal watched (docs/siglip2.md#the-learning-signal): the floors below which a term's
targets have collapsed, read from the values every step already agrees (TeacherTerm.stats: no extra sync).

- information H(p̄) − H̄ (the mutual information of image and prototype) under 0.1 nat: every image gets one target,
  however sharp or flat (the uniform targets of an unstandardised head measured 0.03);
- mean target entropy H̄ under ln 2: each image's target is one or two prototypes (a fast teacher with a fast head:
  optim.ema.decay=0.9 with head_lr=10 went from 3.3 to 0.5 nats in 6 steps).
"""

from __future__ import annotations

import math

INFORMATION_FLOOR = 0.1
ENTROPY_FLOOR = math.log(2)


def collapse(information: float, entropy: float) -> list[str]:
    """What is below its floor, in words; [] where the targets are healthy."""
    below = []
    if information < INFORMATION_FLOOR:
        below.append(f"{information:.2f} nat of information about the image: the images share their targets")
    if entropy < ENTROPY_FLOOR:
        below.append(f"entropy {entropy:.2f} nats: each image's target is one or two prototypes")
    return below


class SignalWatch:
    """Warns once a run for each teacher term whose targets fall below a floor."""

    def __init__(self) -> None:
        self.warned: set[str] = set()

    def check(self, step: int, values: dict[str, float]) -> list[str]:
        """The warnings for this step's agreed term values (`<term>_target_information`, `<term>_target_entropy`)."""
        warnings = []
        for key, information in values.items():
            term = key.removesuffix("_target_information")
            if term == key or term in self.warned:
                continue
            if below := collapse(float(information), float(values[f"{term}_target_entropy"])):
                self.warned.add(term)
                warnings.append(
                    f"step {step}: {term}'s teacher targets have collapsed ({'; '.join(below)}). A slower teacher "
                    f"(optim.ema.decay nearer 1: DINO's 0.996 and up) or a lower loss.{term}.head_lr; "
                    "docs/siglip2.md#the-learning-signal"
                )
        return warnings
