"""The loss terms' one registry, torch-free: each term a config section `loss.<name>` (its options dataclass, with
the weight and start every term has, and resume rules), a one-line summary, and where its builder lives, imported
only when a run builds its objective.

    from clipdist.objective.specs import TERMS
    TERMS["distill"].options      # DistillOptions: loss.distill.model, .pretrained, .weight, .start_at
    TERMS["distill"].load()       # clipdist.objective.distillation.build (imports torch)

The config schema (`loss.<name>` for every entry), the start banner, `build_objective` and the tests that
parametrize over TERMS read this table. A term is on where its builder returns one (distillation: where
`loss.distill.model` names a teacher). The two terms that are not config sections: the contrastive term (the
backend, `loss=<name>`) and CoCa's caption term (a model with a text decoder; `loss.caption_weight`)."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import ClassVar

from clipdist.defaults import REFUSE


@dataclass
class TermOptions:
    """What every term takes: its weight and from when it counts (a fraction of the run, as SigLIP 2 adds its
    self-distillation at 80%: its value and gradient are 0 before step ⌈start_at · optim.max_steps⌉ + 1)."""

    RESUME: ClassVar[dict] = {"weight": REFUSE, "start_at": REFUSE}

    weight: float = 1.0  # the term's weight in the objective
    start_at: float = 0.0  # the fraction of optim.max_steps after which the term counts; 0: from the first step


@dataclass
class DistillOptions(TermOptions):
    """A teacher to distil from (open_clip's --distill-model / --distill-pretrained): open_clip's DistillClipLoss
    over the global batch, exact (clipdist.losses.distill); added with weight 1, as open_clip_train adds it."""

    RESUME: ClassVar[dict] = {**TermOptions.RESUME, "model": REFUSE, "pretrained": REFUSE}

    # an open_clip name (with `pretrained`), hf-hub:, local-dir:, an export, a run, a checkpoint
    model: str | None = None
    pretrained: str | None = None  # the open_clip pretrained tag for `model` (e.g. openai)


@dataclass(frozen=True)
class TermSpec:
    name: str  # its config section, loss.<name>
    target: str  # "module:function": build(options, context) -> the Term, or None where the options leave it off
    summary: str  # one line for menus and errors
    options: type = TermOptions  # a TermOptions dataclass: the section's keys

    def load(self):
        module, attribute = self.target.split(":")
        return getattr(importlib.import_module(module), attribute)


TERMS: dict[str, TermSpec] = {
    spec.name: spec
    for spec in (
        TermSpec("distill", "clipdist.objective.distillation:build", "logits pulled to a teacher's", DistillOptions),
    )
}


def start_step(options: TermOptions, max_steps: int) -> int:
    """The first step (1-based) at which a term with these options counts."""
    return math.ceil(round(options.start_at * max_steps, 6)) + 1 if options.start_at > 0 else 1
