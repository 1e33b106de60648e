"""What the terms that learn from the EMA teacher share (self_distill.py, masked.py): a DINO head of their own on the
model, the teacher's forward with optim.ema's average of the weights, centred and sharpened targets, and the share
of a mean over the global batch's rows.

With the head h (an MLP to a normalised bottleneck, then P prototype logits), the centre c (a running mean of the
teacher's outputs, a buffer of the head) and temperatures τ_t < τ_s, one (student, teacher) output pair costs

    CE(s, t) = −⟨softmax((t − c) / τ_t), log_softmax(s / τ_s)⟩        (the target carries no gradient)

A term's value is T = 1/B Σ_i ℓ_i over the B rows of the global batch (ℓ_i: the row's mean CE over its pairs). Rank
r's share is N/B · Σ_{i∈r} ℓ_i, B summed over ranks (caption.py's argument: the mean over ranks of the shares is T,
DDP's average of their gradients ∂T/∂θ, for any split of the rows, chunk by chunk under gradient caching). After an
optimizer step, c ← m·c + (1 − m)·(the mean of the teacher's outputs over the global batch): the one all-reduce that
counts B also sums them, so the centre is the same on every rank and for every world size. The head is a module of
the model, so the average, checkpoints and resume hold it; exports and evaluation leave it out
(registry.terms.training_only_parts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.func import functional_call

from clipdist.data import view_augment
from clipdist.data.views import global_patch_views, global_views
from clipdist.distributed import parallel
from clipdist.errors import ConfigError
from clipdist.model.timm_towers import naflex_patch_size, naflex_trunk, vit_trunk_of
from clipdist.objective.base import OwnModule, Term, TermContext
from clipdist.registry.terms import TeacherOptions


class Head(OwnModule):
    """DINO's projection head on standardised embeddings: (x − μ)/σ → hidden → GELU → bottleneck, L2-normalised →
    prototype logits, each the cosine between the bottleneck and a prototype (DINO's weight-normalised last layer
    with its norm fixed at 1: a logit in [−1, 1], so τ_s = 0.1 and τ_t = 0.04 give the outputs a range of 20 and 50
    whatever the weights' scale; without it the fresh head's logits spread ~0.07 and the student stayed near
    uniform: docs/siglip2.md). The MLP starts as DINO's: weights normal with σ 0.02, biases 0 (PyTorch's
    default is 1/√(3·fan_in), 0.072 on a 64-wide input: relative to it, each Adam step moved a fresh head 3.6× less).
    Buffers: `centre`, the running mean of the teacher's logits; `input_mean` and `input_var`
    (μ, σ²), the running moments of the teacher's embeddings, per dimension.

    The standardisation is ours, not DINO's: a contrastive tower's embeddings lie in a narrow cone (cosine 0.996
    between the tiny model's images), so without it every image gets the same head output, the centring turns that
    one target into the uniform one, and the term teaches nothing (its targets' entropy at ln P: docs/siglip2.md).
    The moments are buffers moved after each step, as the centre is: within a step they are constants, so the term
    stays exact on any number of ranks."""

    centre: torch.Tensor
    input_mean: torch.Tensor
    input_var: torch.Tensor
    input_seen: torch.Tensor
    calls_image_tower = True  # the term runs the student's image tower outside the model's forward

    def __init__(self, dim: int, options: TeacherOptions):
        super().__init__()
        layers = torch.nn.Linear(dim, options.hidden), torch.nn.Linear(options.hidden, options.bottleneck)
        for layer in layers:  # DINO's init (docstring)
            torch.nn.init.trunc_normal_(layer.weight, std=0.02)
            torch.nn.init.zeros_(layer.bias)
        self.mlp = torch.nn.Sequential(layers[0], torch.nn.GELU(), layers[1])
        self.prototypes = torch.nn.Linear(options.bottleneck, options.prototypes, bias=False)
        self.register_buffer("centre", torch.zeros(options.prototypes))
        self.register_buffer("input_mean", torch.zeros(dim))
        self.register_buffer("input_var", torch.ones(dim))
        self.register_buffer("input_seen", torch.zeros(()))  # 0 until the moments are first the batch's own

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(self.input_var.to(features.dtype) + 1e-6)
        standard = (features - self.input_mean.to(features.dtype)) * scale
        return F.linear(F.normalize(self.mlp(standard), dim=-1), F.normalize(self.prototypes.weight, dim=-1))

    @torch.no_grad()
    def follow(self, sums: torch.Tensor, momentum: float) -> None:
        """The input moments toward the global batch's: `sums` is (n, Σx, Σx²) over the teacher's embeddings, as
        the all-reduce gives it (each divided by the world size alike)."""
        dim = len(self.input_mean)
        count, total, squares = sums[0], sums[1 : 1 + dim], sums[1 + dim :]
        mean = total / count
        var = (squares / count - mean * mean).clamp_min(0)
        weight = 1 - momentum if bool(self.input_seen) else 1.0
        self.input_mean.lerp_(mean.to(self.input_mean.dtype), weight)
        self.input_var.lerp_(var.to(self.input_var.dtype), weight)
        self.input_seen.fill_(1)


def put_on(model: torch.nn.Module, part: str, head: torch.nn.Module) -> None:
    """`head` as the model's module `part`, on the model's device and in its dtype."""
    reference = next(model.parameters())
    model.add_module(part, head.to(reference.device, reference.dtype))


def tower(model: torch.nn.Module) -> Any:
    """The model's image tower (open_clip's `visual`)."""
    return model.visual


def teacher_term(term: type[TeacherTerm], name: str, options: TeacherOptions, context: TermContext):
    """loss.<name>'s term built from its options: None where they leave it off; refused without a weight average.
    The terms built from one context share one EmaTeacher (its image forward runs once a step for all of them)."""
    if not options.on:
        return None
    if context.teacher is None:
        raise ConfigError(f"loss.{name} needs optim.ema.decay > 0: its teacher is the weights' average")
    if "ema_teacher" not in context.shared:
        context.shared["ema_teacher"] = EmaTeacher(context.model, context.teacher)
    return term(context.model, context.shared["ema_teacher"], options, seed=context.seed)  # type: ignore[call-arg]


@contextmanager
def tokens_out(visual: Any) -> Iterator:
    """Inside, the image tower returns (pooled, per-patch tokens): open_clip's ViT its tokens after ln_post, a timm
    ViT trunk (a NaFlexVit, SigLIP 2's VisionTransformer) its tokens after the last norm, before any pooling head,
    the prefix tokens dropped."""
    trunk = vit_trunk_of(visual)
    if trunk is None:
        before, visual.output_tokens = visual.output_tokens, True
        try:
            yield
        finally:
            visual.output_tokens = before
        return
    kept: list[torch.Tensor] = []
    handles = [
        trunk.norm.register_forward_hook(lambda module, args, out: kept.append(out[:, trunk.num_prefix_tokens :])),
        visual.register_forward_hook(lambda module, args, out: (out, kept.pop())),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def images_in(images: torch.Tensor | dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the pixels a sample is keyed by, the valid patches or None) of an image tower's input: images, or a NaFlex
    batch's patches and patch_valid."""
    if isinstance(images, dict):
        return images["patches"], images["patch_valid"]
    return images, None


class EmaTeacher:
    """The EMA teacher the terms share: the model's modules called with `average()`'s tensors (the average of each
    parameter by name) — under FSDP2 each rank's shards, gathered whole for the call, which runs on the model's
    structure as it was before sharding (parallel.plain_structure), not on the sharded modules (their hooks would put
    the student's weights back) — and the image tower's outputs, computed once for each batch (or chunk) and step."""

    def __init__(self, model: torch.nn.Module, average: Callable[[], dict[str, torch.Tensor]]):
        self.average = average
        self.plain = parallel.plain_structure(model)
        self.names = {id(module): name for name, module in model.named_modules()}
        self.last: tuple[Any, int | None, Any] | None = None  # (images, step, the tower's outputs)
        self.view: tuple[Any, int | None, Any] | None = None  # (images, step, their global views)

    def __call__(
        self, module: torch.nn.Module, *args, within: Callable[[Any], AbstractContextManager] = nullcontext
    ) -> Any:
        """`module` (the tower, a head) called with the teacher's tensors in place of its parameters (its buffers:
        the student's, which every rank holds whole), no gradient; `within(module)` around the call."""
        name = self.names[id(module)]
        plain, weights = self.plain.get_submodule(name), self.average()
        tensors = {
            key: parallel.full_tensor(weights[f"{name}.{key}"]).to(tensor.dtype)
            for key, tensor in plain.named_parameters()
        }
        tensors.update(module.named_buffers())
        with torch.no_grad(), within(plain):
            return functional_call(plain, tensors, args)

    def image(self, visual: torch.nn.Module, images: torch.Tensor | dict, step: int | None) -> tuple[torch.Tensor, Any]:
        """(pooled embeddings, per-patch tokens) of the teacher's image tower: one forward for every term that asks
        for the same images at the same step (the average moves only between steps)."""
        if self.last is None or self.last[0] is not images or self.last[1] != step:
            self.last = (images, step, self(visual, images, within=tokens_out))
        return self.last[2]

    def global_view(
        self, images: torch.Tensor | dict, seed: int, step: int | None, augmentation: tuple | None, patch_size: int = 0
    ) -> torch.Tensor | dict:
        """The images' global views (views.global_views; a NaFlex batch's, of `patch_size` patches:
        views.global_patch_views): made once for every term that asks for the same images at the same step, so the
        teacher's forward of them is one too."""
        if self.view is None or self.view[0] is not images or self.view[1] != step:
            at = step or 0
            view = (
                global_patch_views(images, patch_size=patch_size, seed=seed, step=at, augmentation=augmentation)
                if isinstance(images, dict)
                else global_views(images, seed=seed, step=at, augmentation=augmentation)
            )
            self.view = (images, step, view)
        return self.view[2]

    def forget(self) -> None:
        """Let the last images, their global views and the tower's outputs go (once the step's forwards have taken
        them: not held through backward)."""
        self.last = self.view = None


class TeacherPart(NamedTuple):
    total: torch.Tensor  # Σ over this rank's rows of ℓ_i (a chunk's, with its graph, under gradient caching)
    per_row: torch.Tensor  # N / B: what turns a sum over this rank's rows into its share of the global mean


class TeacherTerm(Term):
    """The shared half of a term against the EMA teacher. `model` is the student unwrapped (its image tower and the
    head are called directly: DDP or FSDP2 reduces their gradients with the rest of the step's); `ema_teacher` (not
    `teacher`: this term holds no teacher model) runs the teacher. A subclass gives `rows(images)`: each row's ℓ_i
    and the teacher's outputs that the centre averages."""

    per_chunk = True  # the student's extra forward is the term's own: each chunk backpropagates its share
    own_forward = True  # ... apart from the model's, one term's graph at a time (Objective.own_backward)

    def __init__(
        self,
        model: torch.nn.Module,
        ema_teacher: EmaTeacher,
        options: TeacherOptions,
        part: str,
        seed: int = 0,
    ):
        self.model, self.ema_teacher, self.options, self.seed = model, ema_teacher, options, seed
        self.shape = f"its head at {options.head_lr:g}× the lr" if options.head_lr != 1 else ""
        self.head: Head = getattr(model, part)
        self.visual: torch.nn.Module = tower(model)
        self.patch_size = naflex_patch_size(model) if naflex_trunk(model) is not None else 0  # NaFlex: its patches
        self.pending: torch.Tensor | None = None  # the global batch's mean teacher output, for the centre
        self.signal: dict[str, torch.Tensor] = {}  # the last step's entropies and centre norm (stats)
        self.moments = torch.zeros(0)  # (n, Σx, Σx²) of the teacher head's last inputs
        self.pending_moments = torch.zeros(0)
        preprocess = self.visual.preprocess_cfg  # the images' normalisation, as the data's (data.transforms)
        self.normalised = (preprocess["mean"], preprocess["std"]) if options.augment else None

    def rows(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ℓ_i for each row, (n, P) teacher outputs the centre averages, (m, P) student outputs)."""
        raise NotImplementedError

    def modules(self) -> list[OwnModule]:
        return [self.head]

    def global_view(self, images: torch.Tensor | dict) -> torch.Tensor | dict:
        """What the teacher (and the masked student) see of the images: with `augment`, each image's global view, a
        crop of 40-100% of it resized back, flipped, colour-jittered, grayed and blurred as SILC's (DINO's) global
        views (views.global_views, a NaFlex batch's in its own patches' places: shared by the terms); without, the
        images as they are."""
        if self.normalised is None:
            return images
        return self.ema_teacher.global_view(images, self.seed, self.step, self.augmentation(images), self.patch_size)

    def augmentation(self, images: torch.Tensor | dict) -> tuple | None:
        """(mean, std, blur scale) of the views' augmentation (view_augment.augment) for these images, None without
        `augment`: the blur's σ in proportion to the images' side, DINO's at 224 px; a NaFlex batch's (mean, std),
        its patch views scaling each image's blur by its own side."""
        if self.normalised is None:
            return None
        if isinstance(images, dict):
            return self.normalised
        return (*self.normalised, images.shape[-1] / view_augment.DINO_SIDE)

    def teacher_image(self, images: torch.Tensor | dict) -> tuple[torch.Tensor, Any]:
        """(pooled, per-patch tokens) of the teacher's image tower on the images' global views (EmaTeacher.image:
        shared by the terms)."""
        return self.ema_teacher.image(self.visual, self.global_view(images), self.step)

    def teacher_embeddings(self, images: torch.Tensor | dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(what the teacher's head reads of these images, the (b, L) positions that are the images' own or None)."""
        raise NotImplementedError

    def teacher_head(self, outputs: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """h_T: the head with the average's weights; the moments of its inputs (those `valid`, where given) kept for
        `take`, the head's input standardisation follows them."""
        self.moments = moments(outputs, valid)
        return self.ema_teacher(self.head, outputs)

    def prepare(self, chunks: Callable[[], Iterable[dict]]) -> None:
        """At the term's first step (its head's input moments never followed), the moments of this global batch's
        teacher embeddings: unstandardised, a contrastive tower's narrow cone gave every image one target at that
        step (the targets' information about the image ~0.03 nats). A collective: every rank calls it."""
        if bool(self.head.input_seen):
            return
        sums = torch.stack([moments(*self.teacher_embeddings(inputs["image"])) for inputs in chunks()]).sum(0)
        self.head.follow(parallel.all_reduce_mean(sums), momentum=0.0)

    def cross_entropy(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        """CE(s, t) over the last dimension, in float32 at least."""
        dtype = torch.promote_types(student.dtype, torch.float32)
        target = torch.softmax((teacher.to(dtype) - self.head.centre.to(dtype)) / self.options.teacher_temp, dim=-1)
        return -(target * torch.log_softmax(student.to(dtype) / self.options.student_temp, dim=-1)).sum(-1)

    def soft_targets(self, teacher: torch.Tensor) -> torch.Tensor:
        """softmax((t − c)/τ_t): the probabilities a reference's cross-entropy takes."""
        return torch.softmax((teacher - self.head.centre) / self.options.teacher_temp, dim=-1)

    def take(self, raw, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(Σ ℓ_i, [Σ of the teacher's outputs, Σ of its targets], [rows, outputs, students, Σ H(target),
        Σ H(student), the head inputs' moments]) of this forward: the sums the step's one all-reduce of the term
        takes."""
        losses, outputs, students = self.rows(inputs["image"])
        with torch.no_grad():
            targets = self.soft_targets(outputs.float())
            entropies = [entropy(targets), entropy(self.student_probabilities(students))]
        stats = torch.tensor([len(losses), len(outputs), len(students)], dtype=torch.float64, device=losses.device)
        stats = torch.cat([stats, torch.stack([part.double().sum() for part in entropies]), self.moments])
        return losses.sum(), torch.cat([outputs.double().sum(0), targets.double().sum(0)]), stats

    def merge(self, parts: list) -> TeacherPart:
        """The chunks as one; one all-reduce gives B / N, the teacher's global mean (the centre's next step) and
        the learning signal (`stats`): the mean entropies of the teacher's targets and the student's outputs, and
        the mean target p̄."""
        total = sum(part[0] for part in parts)
        stats = sum(part[2] for part in parts).to(total.device)
        sums = torch.cat([stats, sum(part[1] for part in parts).to(total.device)])
        self.ema_teacher.forget()  # every chunk's forward has taken what it needs of the teacher
        # (B/N, n/N, m/N, Σ H_t / N, Σ H_s / N, the moments / N, Σ t / N, Σ p / N)
        mean = parallel.all_reduce_mean(sums)
        moments = 1 + 2 * len(self.head.input_mean)
        outputs, targets = mean[5 + moments :].chunk(2)
        self.pending = outputs / mean[1]
        self.pending_moments = mean[5 : 5 + moments]
        target_entropy = mean[3] / mean[1]
        self.signal = {
            "target_entropy": target_entropy,
            "target_information": entropy(targets / mean[1]) - target_entropy,
            "student_entropy": mean[4] / mean[2],
            "centre_norm": self.head.centre.detach().double().norm(),
        }
        return TeacherPart(total, 1 / mean[0].to(total.dtype))

    def stats(self) -> dict[str, torch.Tensor]:
        """The learning signal, global (the same on every rank): the teacher targets' mean entropy H̄ (ln P: uniform,
        nothing to learn; 0: one prototype), their information about the image H(p̄) − H̄ (the mutual information of
        image and prototype: 0 when every image gets one target, however sharp), the student's outputs' mean entropy
        and the centre's norm."""
        return dict(self.signal)

    def student_probabilities(self, student: torch.Tensor) -> torch.Tensor:
        return torch.softmax(student.float() / self.options.student_temp, dim=-1)

    def value(self, features: tuple, part: TeacherPart) -> torch.Tensor:
        return part.per_row * part.total

    def chunk_value(self, chunk_part, part: TeacherPart) -> torch.Tensor:
        return part.per_row * chunk_part[0]

    def commit(self) -> None:
        """After an optimizer step: the centre moves toward the step's global mean teacher output."""
        if self.pending is not None:
            with torch.no_grad():
                centre = self.head.centre
                centre.lerp_(self.pending.to(centre.device, centre.dtype), 1 - self.options.centre_momentum)
            self.head.follow(self.pending_moments, self.options.centre_momentum)
            self.pending = None


def moments(outputs: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """(n, Σx, Σx²) in float64 over the rows of `outputs` (its last dimension the features; those `valid`)."""
    inputs = (outputs.detach().flatten(0, -2) if valid is None else outputs.detach()[valid]).double()
    return torch.cat([inputs.new_tensor([len(inputs)]), inputs.sum(0), (inputs * inputs).sum(0)])


def entropy(probabilities: torch.Tensor) -> torch.Tensor:
    """H(p) = −Σ p log p over the last dimension (nats)."""
    return -(probabilities * probabilities.clamp_min(1e-30).log()).sum(-1)


def pooled(output) -> torch.Tensor:
    """An image tower's pooled embedding (open_clip's ViT returns (pooled, tokens) when it outputs tokens)."""
    return output[0] if isinstance(output, tuple) else output
