"""The contrastive term: any backend of clipdist.losses (CLIP's softmax loss, SigLIP's sigmoid one) on the features."""

from __future__ import annotations

import torch

from clipdist.losses.reference import clip_loss
from clipdist.objective.base import Term, features_of


class ContrastiveTerm(Term):
    """T = the backend's loss over the global batch; each backend's docstring says why ℓ_r is exact. Its
    reference is the backend's own (`backend.reference`), CLIP's softmax loss for one that names none."""

    name = "contrastive_loss"

    def __init__(self, backend):
        self.backend = backend

    def value(self, features: tuple, part) -> torch.Tensor:
        return self.backend(*features)

    def reference(self, raw, inputs: dict) -> torch.Tensor:
        return getattr(self.backend, "reference", clip_loss)(*features_of(raw))
