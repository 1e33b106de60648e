"""Σ_k w_k · T_k: the run's terms, weighted, each counted from its start step (clipdist.objective has the contract)."""

from __future__ import annotations

import torch

from clipdist.config import LossConfig
from clipdist.defaults import DEFAULT_TILE
from clipdist.model.factory import caption_weight, has_caption_decoder, image_width
from clipdist.objective.base import Outputs, Term, TermContext, features_of
from clipdist.objective.caption import CaptionTerm
from clipdist.objective.contrastive import ContrastiveTerm
from clipdist.objective.distillation import DistillationTerm
from clipdist.registry.terms import TERMS, start_step


class Objective:
    """Σ_k w_k · T_k over `terms`, a list of (Term, weight); the first is the contrastive term. A term in `starts`
    counts from that step on (`at(step)` says which step the next forward is; before any, every term counts)."""

    def __init__(self, terms: list[tuple[Term, float]], starts: dict[str, int] | None = None):
        self.terms, self.starts = list(terms), dict(starts or {})
        self.step: int | None = None

    def at(self, step: int) -> list[str]:
        """The next forward is step `step`'s (1-based); the terms that count from exactly this step on."""
        self.step = step
        for term, _ in self.terms:
            term.step = step
        return [term.name for term, _ in self.terms if self.starts.get(term.name, 1) == step > 1]

    @property
    def counted(self) -> list[tuple[Term, float]]:
        """The terms that count at the current step."""
        return [pair for pair in self.terms if self.step is None or self.starts.get(pair[0].name, 1) <= self.step]

    def chunk_outputs(self, raw, inputs: dict, per_chunk: bool = False) -> Outputs:
        """One forward's parts, unmerged (a chunk's under gradient caching; `per_chunk`: only the parts of the
        terms that backpropagate chunk by chunk, as the re-forward needs)."""
        return Outputs(
            features_of(raw),
            {term.name: term.take(raw, inputs) for term, _ in self.counted if term.per_chunk or not per_chunk},
        )

    def merge(self, chunks: list[Outputs], features: tuple | None = None) -> Outputs:
        """The chunks' outputs as the whole batch's: `features` (gradient caching: detached leaves of them all), or
        the only chunk's."""
        parts = {term.name: term.merge([chunk.parts[term.name] for chunk in chunks]) for term, _ in self.counted}
        return Outputs(features if features is not None else chunks[0].features, parts)

    def outputs(self, raw, inputs: dict) -> Outputs:
        """The whole batch's parts from one forward of it."""
        return self.merge([self.chunk_outputs(raw, inputs)])

    def __call__(self, outputs: Outputs) -> tuple[torch.Tensor, dict]:
        """(this rank's share of L, its terms unweighted and detached for the logs: {} where there is one term)."""
        losses, values = [], {}
        for term, weight in self.counted:
            value = term.value(outputs.features, outputs.parts[term.name])
            losses.append(value if weight == 1 else value * weight)
            values[term.name] = value.detach()
            prefix = term.name.removesuffix("_loss")
            values.update({f"{prefix}_{key}": stat for key, stat in term.stats().items()})
        return _total(losses + self.idle()), values if len(values) > 1 else {}

    def idle(self) -> list[torch.Tensor]:
        """The zero touch (OwnModule.touch) of each module of the terms that do not count yet."""
        counted = [term for term, _ in self.counted]
        return [module.touch() for term, _ in self.terms if term not in counted for module in term.modules()]

    def commit(self) -> None:
        """After an optimizer step: each counted term's own state moves on (Term.commit)."""
        for term, _ in self.counted:
            term.commit()

    def chunk_loss(self, chunk: Outputs, whole: Outputs) -> torch.Tensor | None:
        """Gradient caching: the share of the loss one chunk's re-forward backpropagates itself (None: all of it
        reaches the model through the features)."""
        shares = [
            weight * term.chunk_value(chunk.parts[term.name], whole.parts[term.name])
            for term, weight in self.counted
            if term.per_chunk
        ]
        shares += self.idle()
        return _total(shares) if shares else None

    def reference(self, raw, inputs: dict) -> torch.Tensor:
        """L on one process over the whole batch, from each term's own definition."""
        return _total([weight * term.reference(raw, inputs) for term, weight in self.counted])


def _total(values: list[torch.Tensor]) -> torch.Tensor:
    """Σ values, added in order (the first as it is: no 0 + x)."""
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total


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
    loss: LossConfig, model_name: str, backend, model: torch.nn.Module, context: TermContext | None = None
) -> Objective:
    """A run's objective from its loss section: the backend with `loss.contrastive_weight`; a CoCa model's caption
    term with `loss.caption_weight` (open_clip's 2 where unset); then every registered term its options turn on
    (registry.terms.TERMS: `loss.<name>.weight`, counted from `loss.<name>.start_at` of the run)."""
    objective = build_objective(
        backend,
        contrastive_weight=loss.contrastive_weight,
        caption_weight=caption_weight(loss, has_caption_decoder(model), model_name),
        pad_id=getattr(model, "pad_id", 0),
    )
    context = context or TermContext(model, tile=getattr(loss, "tile", DEFAULT_TILE))
    for name, spec in TERMS.items():
        options = loss.term(name)
        term = spec.load()(options, context)  # a term that trains a part of its own: attach_parts put it on
        if term is not None:
            objective.terms.append((term, options.weight * options.factor(image_width(model))))
            objective.starts[term.name] = start_step(options, context.max_steps)
    return objective


def as_objective(loss_fn) -> Objective:
    """A contrastive backend as the objective it is alone (weight 1); an Objective as is."""
    return loss_fn if isinstance(loss_fn, Objective) else build_objective(loss_fn)


def attach_parts(loss: LossConfig, model: torch.nn.Module) -> None:
    """The modules the run's terms train themselves (a head), put on the model before it is wrapped."""
    for name, spec in TERMS.items():
        if spec.attach:
            spec.load(spec.attach)(loss.term(name), model)
