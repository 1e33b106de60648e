"""Σ_k w_k · T_k: the run's terms, weighted, each counted from its start step (clipdist.objective has the contract)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from clipdist.config import LossConfig
from clipdist.defaults import DEFAULT_TILE
from clipdist.distributed import parallel
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

    @property
    def own_forward(self) -> list[tuple[Term, float]]:
        """The counted terms with a forward of their own (Term.own_forward): own_backward's."""
        return [pair for pair in self.counted if pair[0].own_forward]

    def chunk_outputs(self, raw, inputs: dict, per_chunk: bool = False, own: bool = False) -> Outputs:
        """One forward's parts, unmerged (a chunk's under gradient caching; `per_chunk`: only the parts of the
        terms that backpropagate chunk by chunk, as the re-forward needs). The own-forward terms' parts only with
        `own` (one backward for every term); the step runs those apart (own_backward)."""
        return Outputs(
            features_of(raw),
            {
                term.name: term.take(raw, inputs)
                for term, _ in self.counted
                if (term.per_chunk or not per_chunk) and (own or not term.own_forward)
            },
        )

    def merge(self, chunks: list[Outputs], features: tuple | None = None) -> Outputs:
        """The chunks' outputs as the whole batch's: `features` (gradient caching: detached leaves of them all), or
        the only chunk's."""
        names = chunks[0].parts
        parts = {
            term.name: term.merge([chunk.parts[term.name] for chunk in chunks])
            for term, _ in self.counted
            if term.name in names
        }
        return Outputs(features if features is not None else chunks[0].features, parts)

    def outputs(self, raw, inputs: dict) -> Outputs:
        """The whole batch's parts from one forward of it, the own-forward terms' with their graphs: for a caller
        that backpropagates everything at once (one process; the step runs those terms apart: own_backward)."""
        return self.merge([self.chunk_outputs(raw, inputs, own=True)])

    def own_backward(
        self,
        chunks: Callable[[], Iterable[dict]],
        rows: int,
        backward: Callable[[torch.Tensor], None],
        within: Callable[[], AbstractContextManager] = nullcontext,
    ) -> dict[str, Any]:
        """The counted own-forward terms (Term.own_forward) of this rank's `rows` rows, whose chunks `chunks()`
        gives one at a time (each the model's named inputs, made as it is needed): each chunk's share w · N/B · Σ_i ℓ_i
        of each term is taken (inside `within()`, an autocast) and handed to `backward` at once, so at most one term's
        graph is alive; then each term's chunks are merged without their graphs. {term name: its part}, for
        `__call__`, whose values of these terms then carry no graph. B, the rows summed over ranks, is one all-reduce
        for all the terms. Each term first sees every chunk (Term.prepare)."""
        own = self.own_forward
        for term, _ in own:
            with within():
                term.prepare(chunks)
        taken: dict[str, list] = {term.name: [] for term, _ in own}
        per_row = None
        for inputs in chunks() if own else ():
            for term, weight in own:  # the chunk's terms one after another: the teacher's forward is shared
                with within():
                    part = term.take(None, inputs)
                if per_row is None:
                    mean_rows = parallel.all_reduce_mean(part[0].new_tensor(float(rows), dtype=torch.float64))
                    per_row = 1 / mean_rows.to(part[0].dtype)
                backward(part[0] * (weight * per_row))
                taken[term.name].append(tuple(entry.detach() for entry in part))
        return {term.name: term.merge(taken[term.name]) for term, _ in own}

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
        """The zero touch (OwnModule.touch) of each module of the terms that do not count yet, and of the
        own-forward terms' (their gradients, made apart, are then reduced with the model's: DDP and FSDP2 reduce
        what a backward reaches)."""
        counted = [term for term, _ in self.counted]
        return [
            module.touch()
            for term, _ in self.terms
            if term not in counted or term.own_forward
            for module in term.modules()
        ]

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
            if term.per_chunk and not term.own_forward
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
