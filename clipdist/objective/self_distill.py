"""SILC's local-to-global self-distillation (Naeem et al. 2023; SigLIP 2 adds it for the last 20% of training).

An EMA teacher (optim.ema's average of the weights) sees each image whole; the student sees K local views of it
(clipdist.data.views: crops seeded by the sample). Both go through the image tower and a head h (DINO's: an MLP to a
normalised bottleneck, then `prototypes` logits), the teacher's with the average's weights. With the centre c (a
running mean of the teacher's outputs) and temperatures τ_t < τ_s:

    p_i = softmax((h_T(x_i) − c) / τ_t)                                  the teacher's target, no gradient
    T   = 1/B · Σ_i 1/K · Σ_k  −⟨p_i, log_softmax(h_S(v_ik) / τ_s)⟩       over the B rows of the global batch

Rank r's share is ℓ_r = N/B · Σ_{i∈r} (1/K Σ_k …), B summed over ranks (the caption term's argument: the mean over
ranks of ℓ_r is T and DDP's average of ∂ℓ_r/∂θ is ∂T/∂θ, for any split of the rows, chunk by chunk under gradient
caching). After every optimizer step c ← m·c + (1 − m)·(1/B Σ_i h_T(x_i)), the mean over the global batch (one
all-reduce, with B): the centre is the same on every rank and for every world size. The head is a module of the
model (`self_distill_head`), so the average, checkpoints and resume hold it; exports leave it out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.func import functional_call

from clipdist.data.views import local_views
from clipdist.distributed import parallel
from clipdist.errors import ConfigError
from clipdist.model.flexible_grid import allow_other_sizes
from clipdist.model.timm_towers import naflex_trunk
from clipdist.objective.base import Term, TermContext
from clipdist.objective.specs import SelfDistillOptions

PART = "self_distill_head"


class DistillHead(torch.nn.Module):
    """DINO's projection head: embedding → hidden → GELU → bottleneck, L2-normalised → prototype logits; `centre`
    (a buffer) is the running mean of the teacher's logits."""

    centre: torch.Tensor

    def __init__(self, dim: int, hidden: int, bottleneck: int, prototypes: int):
        super().__init__()
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, bottleneck)
        )
        self.prototypes = torch.nn.Linear(bottleneck, prototypes, bias=False)
        self.register_buffer("centre", torch.zeros(prototypes))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.prototypes(F.normalize(self.mlp(features), dim=-1))


def attach(options: SelfDistillOptions, model: torch.nn.Module) -> bool:
    """The head put on the model (before it is wrapped, so DDP, the optimizer, the average and checkpoints see it),
    and a fixed-size tower made to take the crops' size; False where the term is off."""
    if not options.crops:
        return False
    if naflex_trunk(model) is not None:
        raise ConfigError("loss.self_distill takes fixed-size image towers for now: this model's is NaFlex")
    size = tower_size(model)
    if options.crop_size and options.crop_size != size and not allow_other_sizes(model):
        raise ConfigError(
            f"loss.self_distill.crop_size={options.crop_size}: this image tower takes only {size}-pixel images; "
            "set crop_size=0 (the tower's size)"
        )
    reference = next(model.parameters())
    head = DistillHead(tower(model).output_dim, options.hidden, options.bottleneck, options.prototypes)
    model.add_module(PART, head.to(reference.device, reference.dtype))
    return True


def tower(model: torch.nn.Module) -> Any:
    """The model's image tower (open_clip's `visual`)."""
    return model.visual


def tower_size(model: torch.nn.Module) -> int:
    size = tower(model).image_size
    return int(size[0] if isinstance(size, (tuple, list)) else size)


def build(options: SelfDistillOptions, context: TermContext) -> SelfDistillTerm | None:
    """loss.self_distill's term: None at crops=0; its teacher the run's weight average (context.teacher)."""
    if not options.crops:
        return None
    if context.teacher is None:
        raise ConfigError("loss.self_distill needs optim.ema.decay > 0: its teacher is the weights' average")
    return SelfDistillTerm(context.model, context.teacher, options, seed=context.seed)


class SelfDistillPart(NamedTuple):
    total: torch.Tensor  # Σ over this rank's rows of 1/K Σ_k CE (a chunk's, with its graph, under gradient caching)
    per_row: torch.Tensor  # N / B: what turns a sum over this rank's rows into its share of the global mean


class SelfDistillTerm(Term):
    """T above. `model` is the student unwrapped (its image tower and head are called directly: DDP reduces their
    gradients with the rest of the step's); `teacher()` gives the teacher's tensors by parameter name."""

    name = "self_distill_loss"
    per_chunk = True  # the crops' forward is the term's own: each chunk backpropagates its share

    def __init__(
        self,
        model: torch.nn.Module,
        teacher: Callable[[], dict[str, torch.Tensor]],
        options: SelfDistillOptions,
        seed: int = 0,
    ):
        self.model, self.teacher, self.options, self.seed = model, teacher, options, seed
        self.head: DistillHead = getattr(model, PART)
        self.visual: torch.nn.Module = tower(model)
        self.size = options.crop_size or tower_size(model)
        self.pending: torch.Tensor | None = None  # the global batch's mean teacher output, for the centre

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.head.parameters())

    def targets(self, images: torch.Tensor) -> torch.Tensor:
        """h_T of the whole images with the teacher's tensors, no gradient: (b, prototypes) logits."""
        weights = self.teacher()
        own = dict(self.model.named_parameters())
        visual = {name[7:]: weights[name].to(own[name].dtype) for name in own if name.startswith("visual.")}
        head = {name[len(PART) + 1 :]: weights[name].to(own[name].dtype) for name in own if name.startswith(PART + ".")}
        with torch.no_grad():
            pooled = _pooled(functional_call(self.visual, visual, (images,)))
            return functional_call(self.head, head, (pooled,))

    def student(self, images: torch.Tensor, step: int) -> torch.Tensor:
        """h_S of each image's K local views: (b, K, prototypes) logits."""
        options = self.options
        size, scale = (self.size, self.size), (options.scale[0], options.scale[1])
        views = local_views(images, crops=options.crops, size=size, scale=scale, seed=self.seed, step=step)
        logits = self.head(_pooled(self.visual(views.flatten(0, 1))))
        return logits.view(len(images), options.crops, -1)

    def cross_entropy(self, teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
        """Per row: 1/K Σ_k −⟨softmax((t − c)/τ_t), log_softmax(s_k/τ_s)⟩, in float32 at least."""
        dtype = torch.promote_types(student.dtype, torch.float32)
        centre = self.head.centre.to(dtype)
        target = torch.softmax((teacher.to(dtype) - centre) / self.options.teacher_temp, dim=-1)
        log_student = torch.log_softmax(student.to(dtype) / self.options.student_temp, dim=-1)
        return -(target[:, None] * log_student).sum(-1).mean(1)

    def take(self, raw, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(Σ over the rows of their cross-entropy, Σ of the teacher's logits, rows) of this forward."""
        images = inputs["image"]
        teacher = self.targets(images)
        total = self.cross_entropy(teacher, self.student(images, self.step or 0)).sum()
        return total, teacher.double().sum(0), len(images)

    def merge(self, parts: list) -> SelfDistillPart:
        """The chunks as one; one all-reduce gives B / N and the teacher's global mean (the centre's next step)."""
        total = sum(part[0] for part in parts)
        counts = torch.cat(
            [
                torch.tensor([float(sum(part[2] for part in parts))], dtype=torch.float64).to(total.device),
                sum(part[1] for part in parts),
            ]
        )
        mean = parallel.all_reduce_mean(counts)  # (B/N, Σ_i h_T(x_i) / N)
        self.pending = mean[1:] / mean[0]
        return SelfDistillPart(total, 1 / mean[0].to(total.dtype))

    def value(self, features: tuple, part: SelfDistillPart) -> torch.Tensor:
        return part.per_row * part.total

    def chunk_value(self, chunk_part, part: SelfDistillPart) -> torch.Tensor:
        return part.per_row * chunk_part[0]

    def commit(self) -> None:
        """After an optimizer step: the centre moves toward the step's global mean teacher output."""
        if self.pending is not None:
            with torch.no_grad():
                centre = self.head.centre
                centre.lerp_(self.pending.to(centre.dtype), 1 - self.options.centre_momentum)
            self.pending = None

    def reference(self, raw, inputs: dict) -> torch.Tensor:
        """T on one process over the whole batch: soft-target cross-entropy over the b·K (view, target) pairs."""
        images = inputs["image"]
        targets = torch.softmax((self.targets(images) - self.head.centre) / self.options.teacher_temp, dim=-1)
        student = self.student(images, self.step or 0)
        pairs = targets.repeat_interleave(self.options.crops, dim=0)
        return F.cross_entropy(student.flatten(0, 1) / self.options.student_temp, pairs)


def _pooled(output) -> torch.Tensor:
    """An image tower's pooled embedding (open_clip's ViT returns (pooled, tokens) when it outputs tokens)."""
    return output[0] if isinstance(output, tuple) else output
