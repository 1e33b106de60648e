"""The loss terms: each term a config section `loss.<name>` (its options dataclass, with
the weight and start every term has, and resume rules), a one-line summary, and where its builder lives, imported
only when a run builds its objective.

    from clipdist.registry.terms import TERMS
    TERMS["distill"].options      # DistillOptions: loss.distill.model, .pretrained, .weight, .start_at
    TERMS["distill"].load()       # clipdist.objective.distillation.build (imports torch)

The config schema (`loss.<name>` for every entry), the start banner, `build_objective` and the tests that
parametrize over TERMS read this table. A term is on where its builder returns one (distillation: where
`loss.distill.model` names a teacher). The two terms that are not config sections: the contrastive term (the
backend, `loss=<name>`) and CoCa's caption term (a model with a text decoder; `loss.caption_weight`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from clipdist.defaults import FREE, REFUSE, WARN, above_zero, non_negative, positive
from clipdist.errors import ConfigError
from clipdist.registry import CodeSpec, Registry, plugged


@dataclass
class TermOptions:
    """What every term takes: its weight and from when it counts (a fraction of the run, as SigLIP 2 adds its
    self-distillation at 80%: its value and gradient are 0 before step ⌈start_at · optim.max_steps⌉ + 1)."""

    RESUME: ClassVar[dict] = {"weight": REFUSE, "start_at": REFUSE}

    weight: float = 1.0  # the term's weight in the objective
    start_at: float = 0.0  # the fraction of optim.max_steps after which the term counts; 0: from the first step

    def check(self, name: str, cfg: Any) -> None:
        """The combinations of the run's config (a TrainConfig) this term cannot train with: a ConfigError."""

    def factor(self, width: int) -> float:
        """What the weight is multiplied by for an image tower of this width: 1 (the teacher terms: SigLIP 2's size
        factor where asked)."""
        return 1.0

    def lr_scale(self) -> float:
        """The lr of the term's own module (TermSpec.part) as a multiple of the run's: 1 (the teacher terms'
        heads: head_lr)."""
        return 1.0


@dataclass
class DistillOptions(TermOptions):
    """A teacher to distil from (open_clip's --distill-model / --distill-pretrained): open_clip's DistillClipLoss
    over the global batch, exact (clipdist.losses.distill); added with weight 1, as open_clip_train adds it."""

    RESUME: ClassVar[dict] = {**TermOptions.RESUME, "model": REFUSE, "pretrained": REFUSE}

    # an open_clip name (with `pretrained`), hf-hub:, local-dir:, an export, a run, a checkpoint
    model: str | None = None
    pretrained: str | None = None  # the open_clip pretrained tag for `model` (e.g. openai)


@dataclass
class TeacherOptions(TermOptions):
    """What the terms that learn from the EMA teacher (optim.ema) share (clipdist.objective.teacher): a DINO head of
    their own on the model (embedding → hidden → GELU → bottleneck, normalised → `prototypes` logits), whose
    student outputs are pulled to the teacher's, centred and sharpened."""

    RESUME: ClassVar[dict] = {
        **TermOptions.RESUME,
        **dict.fromkeys(
            ("hidden", "bottleneck", "prototypes", "student_temp", "teacher_temp", "centre_momentum", "by_size"),
            REFUSE,
        ),
        "augment": WARN,  # the views from then on are others; the run goes on
        "head_lr": FREE,  # as optim.lr: a resume's rates are its config's
    }

    hidden: int = positive(256)  # the head's hidden width
    bottleneck: int = positive(64)  # the head's normalised bottleneck width
    prototypes: int = positive(1024)  # the head's outputs: the distributions' support (DINO: 65536)
    student_temp: float = 0.1  # the student's softmax temperature (DINO's 0.1)
    teacher_temp: float = 0.04  # the teacher's, lower: its targets sharper (DINO's 0.04)
    centre_momentum: float = 0.9  # c ← m·c + (1 − m)·(the global batch's mean teacher output), after each step
    # the weight times SigLIP 2's factor for the image tower's size (size_factor: B 0.25, L 0.5, So400m 1, g 0.5)
    by_size: bool = False
    # the views augmented as SILC's (DINO's): the teacher's (and the masked student's) a global crop, flipped,
    # colour-jittered, grayed, blurred (views.global_views), the local views likewise (view_augment.py)
    augment: bool = True
    # the head's (and mask token's) lr as a multiple of the run's lr, schedule and all: they start fresh when the
    # term does, in the schedule's tail (the paper does not say theirs; DINO's: the run's, 1)
    head_lr: float = above_zero(1.0)

    def factor(self, width: int) -> float:
        """What the weight is multiplied by for an image tower of this width: SigLIP 2's size factor, or 1."""
        return size_factor(width) if self.by_size else 1.0

    def lr_scale(self) -> float:
        return self.head_lr

    @property
    def on(self) -> bool:
        return False

    def check(self, name: str, cfg: Any) -> None:
        if not self.on:
            return
        if cfg.optim.ema.decay <= 0:
            raise ConfigError(f"loss.{name} needs a teacher: the weights' average, optim.ema.decay (e.g. 0.999)")
        if min(self.student_temp, self.teacher_temp) <= 0 or not 0 <= self.centre_momentum < 1:
            raise ConfigError(
                f"loss.{name}: the temperatures must be above 0 and centre_momentum in [0, 1) (DINO: 0.1, 0.04, 0.9)"
            )


# SigLIP 2 (§2.3) weighs its teacher terms by model size: ViT-B 0.25, L 0.5, So400m 1, g 0.5; by the image tower's
# width, a narrower tower as B (the tiny model too), a width between two sizes as the larger
SIZE_FACTORS = ((768, 0.25), (1024, 0.5), (1152, 1.0), (1536, 0.5))


def size_factor(width: int) -> float:
    """SigLIP 2's weight factor for a teacher term on an image tower of this width (SIZE_FACTORS)."""
    return next((factor for widest, factor in SIZE_FACTORS if width <= widest), SIZE_FACTORS[-1][1])


@dataclass
class SelfDistillOptions(TeacherOptions):
    """SILC's local-to-global self-distillation (clipdist.objective.self_distill): the teacher sees a global view of
    the image, the student `crops` local views of it; each view's pooled embedding is pulled to the teacher's. Off at
    crops=0."""

    RESUME: ClassVar[dict] = {
        **TeacherOptions.RESUME,
        **dict.fromkeys(("crops", "crop_size", "scale"), REFUSE),
    }

    crops: int = non_negative(0)  # local views per image (SILC: 8); 0: the term is off
    crop_size: int = non_negative(0)  # their side in pixels; 0: SILC's 96/224 of the tower's (NaFlex: √L/4 patches)
    scale: list[float] = field(default_factory=lambda: [0.05, 0.4])  # a crop's area fraction (SILC, DINO's locals)

    @property
    def on(self) -> bool:
        return self.crops > 0

    def check(self, name: str, cfg: Any) -> None:
        super().check(name, cfg)
        if self.on and (len(self.scale) != 2 or not 0 < self.scale[0] <= self.scale[1] <= 1):
            raise ConfigError(f"loss.{name}.scale={list(self.scale)}: give [low, high] with 0 < low ≤ high ≤ 1")


@dataclass
class MaskedOptions(TeacherOptions):
    """TIPS's masked prediction (clipdist.objective.masked): the student sees the image with `ratio` of its patch
    embeddings replaced by a learned mask token; its output at each masked patch is pulled to the teacher's output
    at that patch of the unmasked image. Off at ratio=0."""

    RESUME: ClassVar[dict] = {**TeacherOptions.RESUME, "ratio": REFUSE}

    ratio: float = 0.0  # the fraction of each image's patches masked (TIPS, SigLIP 2: 0.5); 0: the term is off

    @property
    def on(self) -> bool:
        return self.ratio > 0

    def check(self, name: str, cfg: Any) -> None:
        super().check(name, cfg)
        if not 0 <= self.ratio < 1:
            raise ConfigError(f"loss.{name}.ratio={self.ratio}: give a fraction of the patches in [0, 1)")


@dataclass
class DecoderOptions(TermOptions):
    """LocCa's captioning decoder (clipdist.objective.decoder): a small transformer decoder cross-attending to the
    image tower's patch tokens predicts each caption — autoregressively, or for a `parallel` fraction of the samples
    all tokens at once from mask tokens. Its shape is the text tower's with `depth` of its layers (SigLIP 2's: half)
    unless `layers`, `width`, `heads` say otherwise; off where layers and depth are both 0."""

    RESUME: ClassVar[dict] = {
        **TermOptions.RESUME,
        **dict.fromkeys(("layers", "depth", "width", "heads", "parallel"), REFUSE),
    }

    layers: int = non_negative(0)  # decoder blocks (self-attention, cross-attention to the patches, MLP); 0: `depth`
    depth: float = 0.0  # its blocks as a fraction of the text tower's layers (SigLIP 2: 0.5), one at least
    width: int = non_negative(0)  # its width; 0: the text tower's (where unknown, the image tower's)
    heads: int = non_negative(0)  # its attention heads (a divisor of the width); 0: the text tower's (unknown: 8)
    parallel: float = 0.5  # the fraction of samples predicted in parallel (LocCa, SigLIP 2: half)

    @property
    def on(self) -> bool:
        return self.layers > 0 or self.depth > 0

    def check(self, name: str, cfg: Any) -> None:
        if not math.isfinite(self.depth) or self.depth < 0:  # nan and inf too: round() of them is no layer count
            raise ConfigError(f"loss.{name}.depth={self.depth}: give a fraction of the text tower's layers, 0 or more")
        if self.on and not 0 <= self.parallel <= 1:
            raise ConfigError(f"loss.{name}.parallel={self.parallel}: give a fraction of the samples in [0, 1]")


@dataclass(frozen=True)
class TermSpec(CodeSpec):
    """`name`: its config section, loss.<name>; `target`: "module:function", build(options, context) -> the Term,
    or None where the options leave it off."""

    options: type = TermOptions  # a TermOptions dataclass: the section's keys
    # where the term trains a module of its own (a head): "module:function" attach(options, model) -> whether it
    # added one, called before the model is wrapped; `part` is its attribute, left out of exports and evaluation
    attach: str | None = None
    part: str | None = None
    # the options `clipdist gradcheck --term <name>` and the tests run it with: on, and small
    probe: dict[str, Any] = field(default_factory=dict)


TERMS: Registry[TermSpec] = plugged(
    "clipdist.terms",
    TermSpec,
    (
        TermSpec("distill", "clipdist.objective.distillation:build", "logits pulled to a teacher's", DistillOptions),
        TermSpec(
            "self_distill",
            "clipdist.objective.self_distill:build",
            "local views pulled to the EMA teacher's whole image (SILC)",
            SelfDistillOptions,
            attach="clipdist.objective.self_distill:attach",
            part="self_distill_head",
            probe={"crops": 2, "crop_size": 16, "hidden": 32, "bottleneck": 16, "prototypes": 32},
        ),
        TermSpec(
            "masked",
            "clipdist.objective.masked:build",
            "masked patches pulled to the EMA teacher's (TIPS)",
            MaskedOptions,
            attach="clipdist.objective.masked:attach",
            part="masked_head",
            probe={"ratio": 0.5, "hidden": 32, "bottleneck": 16, "prototypes": 32},
        ),
        TermSpec(
            "decoder",
            "clipdist.objective.decoder:build",
            "captions predicted from the patch tokens (LocCa)",
            DecoderOptions,
            attach="clipdist.objective.decoder:attach",
            part="caption_decoder",
            probe={"layers": 1, "width": 32, "heads": 2, "parallel": 0.5},
        ),
    ),
)


def training_only_parts() -> tuple[str, ...]:
    """The model's modules that only a term trains: a checkpoint holds them, an export or an evaluation leaves them
    out."""
    return tuple(spec.part for spec in TERMS.values() if spec.part)


def part_lr_scales(loss: Any) -> dict[str, float]:
    """{a term's own module (TermSpec.part): its lr multiplier} for the run's loss config, where not 1."""
    scales = {spec.part: loss.term(name).lr_scale() for name, spec in TERMS.items() if spec.part}
    return {part: scale for part, scale in scales.items() if scale != 1.0}


def training_only(name: str) -> bool:
    """Whether a state-dict key belongs to a term's own module (training_only_parts)."""
    return name.split(".", 1)[0] in training_only_parts()


def start_step(options: TermOptions, max_steps: int) -> int:
    """The first step (1-based) at which a term with these options counts."""
    return first_step(options.start_at, max_steps)


def first_step(start_at: float, max_steps: int) -> int:
    """The first step (1-based) of what starts after a fraction `start_at` of the run: ⌈start_at · max_steps⌉ + 1,
    or 1 from the start."""
    return math.ceil(round(start_at * max_steps, 6)) + 1 if start_at > 0 else 1
