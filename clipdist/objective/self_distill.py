"""SILC's local-to-global self-distillation (Naeem et al. 2023; SigLIP 2 adds it for the last 20% of training).

The EMA teacher sees a global view of each image (with `augment`, teacher.global_view: a crop of 40-100% of it
resized back and augmented, as SILC's; else the image); the student sees K local views of it (clipdist.data.views:
crops seeded by the sample). Both pooled embeddings go through the term's head (teacher.py: h, the centre c, the
temperatures), the teacher's with the average's weights:

    ℓ_i = 1/K Σ_k CE(h_S(v_ik), h_T(x_i))        T = 1/B Σ_i ℓ_i over the global batch

and the centre follows the teacher's mean output over the global batch's images.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from open_clip.transformer import VisionTransformer

from clipdist.data.views import SILC_VIEW, local_patch_views, local_views
from clipdist.errors import ConfigError
from clipdist.model.factory import image_size
from clipdist.model.flexible_grid import allow_other_sizes, patch_side
from clipdist.model.timm_towers import naflex_patch_size, naflex_trunk, pooled_width, vit_trunk_of
from clipdist.objective.base import TermContext
from clipdist.objective.teacher import Head, TeacherTerm, pooled, put_on, teacher_term, tower
from clipdist.registry.terms import SelfDistillOptions

PART = "self_distill_head"


def attach(options: SelfDistillOptions, model: torch.nn.Module) -> bool:
    """The head put on the model (before it is wrapped, so DDP, the optimizer, the average and checkpoints see it),
    and a fixed-size tower made to take the crops' size; False where the term is off."""
    if not options.on:
        return False
    visual = tower(model)
    if naflex_trunk(model) is not None:
        patch = naflex_patch_size(model)
        if options.crop_size % patch:
            raise ConfigError(
                f"loss.self_distill.crop_size={options.crop_size}: a NaFlex tower's views are grids of its "
                f"{patch}-pixel patches; give a multiple of {patch}, or 0 for √L/4 patches (L: a batch's length)"
            )
        put_on(model, PART, Head(pooled_width(visual), options))
        return True
    if not isinstance(visual, VisionTransformer) and vit_trunk_of(visual) is None:
        raise ConfigError(
            "loss.self_distill needs a ViT image tower (open_clip's, a timm ViT as SigLIP 2's, or a NaFlex tower): "
            f"this model's is {type(visual).__name__}; loss.self_distill.crops=0 trains without it"
        )
    size, crop = image_size(model)[0], view_size(options, model)
    if crop > size:
        raise ConfigError(
            f"loss.self_distill.crop_size={crop}: local views larger than the {size}-pixel images the tower takes "
            f"(SILC's are 96/224 of them); give at most {size}, or 0 for SILC's fraction"
        )
    if crop != size:
        if not allow_other_sizes(model):
            raise ConfigError(
                f"loss.self_distill: its views are {crop} pixels, and this image tower takes only {size}-pixel images; "
                f"set loss.self_distill.crop_size={size}"
            )
        patch = patch_side(model)
        if crop % patch:
            raise ConfigError(
                f"loss.self_distill.crop_size={crop}: not a multiple of the tower's {patch}-pixel "
                f"patches; e.g. {max(patch, crop // patch * patch)}"
            )
    put_on(model, PART, Head(pooled_width(visual), options))
    return True


def view_size(options: SelfDistillOptions, model: torch.nn.Module) -> int:
    """The local views' side in pixels: `crop_size`, or SILC's fraction of the tower's size (96 at 224, 112 at 256),
    a multiple of its patch, one patch at least."""
    if options.crop_size:
        return options.crop_size
    size, patch = image_size(model)[0], patch_side(model)
    return max(patch, round(size * SILC_VIEW / patch) * patch)


def build(options: SelfDistillOptions, context: TermContext) -> TeacherTerm | None:
    """loss.self_distill's term: None at crops=0; its teacher the run's weight average (context.teacher)."""
    return teacher_term(SelfDistillTerm, "self_distill", options, context)


class SelfDistillTerm(TeacherTerm):
    name = "self_distill_loss"
    options: SelfDistillOptions

    def __init__(self, model, teacher, options: SelfDistillOptions, seed: int = 0):
        super().__init__(model, teacher, options, PART, seed)
        self.size = 0 if self.patch_size else view_size(options, model)

    def teacher_embeddings(self, images: torch.Tensor | dict) -> tuple[torch.Tensor, None]:
        return self.teacher_image(images)[0], None

    def targets(self, images: torch.Tensor | dict) -> torch.Tensor:
        """h_T of the images' global views: (b, P) logits."""
        return self.teacher_head(*self.teacher_embeddings(images))

    def student(self, images: torch.Tensor | dict) -> torch.Tensor:
        """h_S of each image's K local views: (b, K, P) logits (a NaFlex batch's views: full grids of patches)."""
        options, step = self.options, self.step or 0
        scale = (options.scale[0], options.scale[1])
        if isinstance(images, dict):
            rows = len(images["patches"])
            views = local_patch_views(
                images,
                crops=options.crops,
                patch_size=self.patch_size,
                grid=options.crop_size // self.patch_size,
                scale=scale,
                seed=self.seed,
                step=step,
                augmentation=self.augmentation(images),
            )
            embedded = pooled(self.visual(views))
        else:
            rows, size = len(images), (self.size, self.size)
            crops = local_views(
                images,
                crops=options.crops,
                size=size,
                scale=scale,
                seed=self.seed,
                step=step,
                augmentation=self.augmentation(images),
            )
            embedded = pooled(self.visual(crops.flatten(0, 1)))
        return self.head(embedded).view(rows, options.crops, -1)

    def rows(self, images: torch.Tensor | dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        teacher, student = self.targets(images), self.student(images)
        return self.cross_entropy(student, teacher[:, None]).mean(1), teacher, student.flatten(0, 1)

    def reference(self, raw, inputs: dict) -> torch.Tensor:
        """T on one process over the whole batch: soft-target cross-entropy over the b·K (view, target) pairs."""
        images = inputs["image"]
        pairs = self.soft_targets(self.targets(images)).repeat_interleave(self.options.crops, dim=0)
        return F.cross_entropy(self.student(images).flatten(0, 1) / self.options.student_temp, pairs)
