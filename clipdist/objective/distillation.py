"""Distillation from a frozen teacher over the global batch (clipdist.losses.distill has the math and the ring)."""

from __future__ import annotations

import torch

from clipdist.defaults import DEFAULT_TILE
from clipdist.losses.distill import DistillationLoss
from clipdist.model.targets import load_teacher
from clipdist.objective.base import Term, TermContext, features_of
from clipdist.registry.terms import DistillOptions


def build(options: DistillOptions, context: TermContext) -> DistillationTerm | None:
    """loss.distill's term: None where it names no teacher."""
    teacher = load_teacher(options, context.cache_dir, context.device, context.dtype, context.local_rank)
    return None if teacher is None else DistillationTerm(teacher, context.tile)


class DistillationTerm(Term):
    """T = open_clip's DistillClipLoss term between the student's logits and the teacher's, every row against every
    column of the global batch. The teacher sees the same inputs, frozen, in eval mode, in the caller's precision;
    under gradient caching its features are taken chunk by chunk in the first forward and used once."""

    name = "distill_loss"

    def __init__(self, teacher, tile: int = DEFAULT_TILE):  # an open_clip model: encode_image, encode_text
        self.teacher, self.loss = teacher, DistillationLoss(tile)

    @torch.no_grad()
    def take(self, raw, inputs: dict) -> tuple:
        """The teacher's normalised features of the same images and texts, and its logit scale."""
        return (
            self.teacher.encode_image(inputs["image"], normalize=True),
            self.teacher.encode_text(inputs["text"], normalize=True),
            self.teacher.logit_scale.exp(),
        )

    def merge(self, parts: list) -> tuple:
        return torch.cat([part[0] for part in parts]), torch.cat([part[1] for part in parts]), parts[0][2]

    def value(self, features: tuple, part: tuple) -> torch.Tensor:
        return self.loss(*features[:3], *part)

    def reference(self, raw, inputs: dict) -> torch.Tensor:
        from open_clip.loss import DistillClipLoss

        return DistillClipLoss()(*features_of(raw)[:3], *self.take(raw, inputs))[1]
