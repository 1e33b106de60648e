"""What a step minimises: a weighted sum of terms, each over the global batch, exact at any world size, with
unequal local batches and under gradient caching:

    L = Σ_k w_k · T_k       contrastive (any backend) · CoCa's caption (caption.py) · distillation (distillation.py)

Each term (base.Term) takes from a forward what it needs, merges the chunks of gradient caching, gives this rank's
share ℓ_r (mean over ranks: T; DDP's average of its gradient: ∂T/∂θ), and its single-process reference, which
`clipdist gradcheck` compares against. A new term is one file here and one line in `build_objective`.
"""

from __future__ import annotations

import torch

from clipdist.config import LossConfig
from clipdist.defaults import DEFAULT_TILE
from clipdist.model.factory import caption_weight, has_caption_decoder
from clipdist.objective.base import Outputs, Term, features_of
from clipdist.objective.caption import CaptionTerm, caption_cross_entropy
from clipdist.objective.contrastive import ContrastiveTerm
from clipdist.objective.distillation import DistillationTerm

__all__ = ["Objective", "Outputs", "Term", "build_objective", "run_objective", "as_objective", "caption_cross_entropy"]


class Objective:
    """Σ_k w_k · T_k over `terms`, a list of (Term, weight); the first is the contrastive term."""

    def __init__(self, terms: list[tuple[Term, float]]):
        self.terms = list(terms)

    def chunk_outputs(self, raw, inputs: dict, per_chunk: bool = False) -> Outputs:
        """One forward's parts, unmerged (a chunk's under gradient caching; `per_chunk`: only the parts of the
        terms that backpropagate chunk by chunk, as the re-forward needs)."""
        return Outputs(
            features_of(raw),
            {term.name: term.take(raw, inputs) for term, _ in self.terms if term.per_chunk or not per_chunk},
        )

    def merge(self, chunks: list[Outputs], features: tuple | None = None) -> Outputs:
        """The chunks' outputs as the whole batch's: `features` (gradient caching: detached leaves of them all), or
        the only chunk's."""
        parts = {term.name: term.merge([chunk.parts[term.name] for chunk in chunks]) for term, _ in self.terms}
        return Outputs(features if features is not None else chunks[0].features, parts)

    def outputs(self, raw, inputs: dict) -> Outputs:
        """The whole batch's parts from one forward of it."""
        return self.merge([self.chunk_outputs(raw, inputs)])

    def __call__(self, outputs: Outputs) -> tuple[torch.Tensor, dict]:
        """(this rank's share of L, its terms unweighted and detached for the logs: {} where there is one term)."""
        loss, values = None, {}
        for term, weight in self.terms:
            value = term.value(outputs.features, outputs.parts[term.name])
            weighted = value if weight == 1 else value * weight
            loss = weighted if loss is None else loss + weighted
            values[term.name] = value.detach()
        return loss, values if len(values) > 1 else {}

    def chunk_loss(self, chunk: Outputs, whole: Outputs) -> torch.Tensor | None:
        """Gradient caching: the share of the loss one chunk's re-forward backpropagates itself (None: all of it
        reaches the model through the features)."""
        shares = [
            weight * term.chunk_value(chunk.parts[term.name], whole.parts[term.name])
            for term, weight in self.terms
            if term.per_chunk
        ]
        return sum(shares) if shares else None

    def reference(self, raw, inputs: dict) -> torch.Tensor:
        """L on one process over the whole batch, from each term's own definition."""
        return sum(weight * term.reference(raw, inputs) for term, weight in self.terms)


def build_objective(
    contrastive,
    *,
    contrastive_weight: float = 1.0,
    caption_weight: float = 0.0,
    pad_id: int = 0,
    teacher: torch.nn.Module | None = None,
    distill_weight: float = 1.0,
    tile: int = DEFAULT_TILE,
) -> Objective:
    """The run's objective: the contrastive backend; CoCa's caption term where its weight is not 0 (no cross-entropy
    over the logits otherwise); distillation where there is a teacher."""
    terms: list[tuple[Term, float]] = [(ContrastiveTerm(contrastive), contrastive_weight)]
    if caption_weight:
        terms.append((CaptionTerm(pad_id), caption_weight))
    if teacher is not None:
        terms.append((DistillationTerm(teacher, tile), distill_weight))
    return Objective(terms)


def run_objective(
    loss: LossConfig, model_name: str, backend, model: torch.nn.Module, teacher: torch.nn.Module | None = None
) -> Objective:
    """A run's objective from its loss section: the backend with `loss.contrastive_weight`; a CoCa model's caption
    term with `loss.caption_weight` (open_clip's 2 where unset); the teacher's term with `loss.distill.weight`."""
    return build_objective(
        backend,
        contrastive_weight=loss.contrastive_weight,
        caption_weight=caption_weight(loss, has_caption_decoder(model), model_name),
        pad_id=getattr(model, "pad_id", 0),
        teacher=teacher,
        distill_weight=loss.distill.weight,
        tile=getattr(loss, "tile", DEFAULT_TILE),
    )


def as_objective(loss_fn) -> Objective:
    """A contrastive backend as the objective it is alone (weight 1); an Objective as is."""
    return loss_fn if isinstance(loss_fn, Objective) else build_objective(loss_fn)
