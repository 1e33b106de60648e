"""TIPS's masked prediction (Maninis et al. 2025, after iBOT; SigLIP 2 adds it for the last 20% of training).

The student sees each image with M = round(ratio · L) of its L patch embeddings replaced by a learned mask token
(clipdist.data.views.patch_masks: seeded by the sample); the EMA teacher sees it unmasked. Both see the image's
global view (teacher.global_view: with `augment`, a crop resized back and augmented, as SILC's; else the image).
The image tower's per-patch outputs (open_clip's tokens, after ln_post) go through the term's head (teacher.py),
and at each masked patch j of image i the student's output is pulled to the teacher's output at that patch:

    ℓ_i = 1/M Σ_{j masked} CE(h_S(z̃_ij), h_T(z_ij))        T = 1/B Σ_i ℓ_i over the global batch

(every image has M masked patches, so T is also the mean over all masked patches of the global batch); the centre
follows the teacher's mean output over every patch of the global batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from open_clip.transformer import VisionTransformer

from clipdist.data.views import patch_masks
from clipdist.errors import ConfigError
from clipdist.model.factory import image_width
from clipdist.model.timm_towers import patch_projection, vit_trunk_of
from clipdist.objective.base import TermContext
from clipdist.objective.teacher import Head, TeacherTerm, images_in, put_on, teacher_term, tokens_out, tower
from clipdist.registry.terms import MaskedOptions

PART = "masked_head"


class MaskedHead(Head):
    """The head, and the learned token that takes a masked patch's embedding (zeros at first, as iBOT's)."""

    fsdp_methods = (*Head.fsdp_methods, "fill")

    def __init__(self, width: int, options: MaskedOptions):
        super().__init__(width, options)
        self.mask_token = torch.nn.Parameter(torch.zeros(width))

    def fill(self, embeddings: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Patch embeddings — (b, width, grid_h, grid_w) from a ViT's conv, (b, L, width) from a NaFlex tower's
        linear projection — with the mask token where `mask` (b, L) is True."""
        token = self.mask_token.to(embeddings.dtype)
        if embeddings.dim() == 3:
            return torch.where(mask[..., None], token, embeddings)
        masked = mask.view(embeddings.shape[0], 1, *embeddings.shape[2:])
        return torch.where(masked, token[None, :, None, None], embeddings)


def attach(options: MaskedOptions, model: torch.nn.Module) -> bool:
    """The head and mask token put on the model before it is wrapped; False where the term is off."""
    if not options.on:
        return False
    visual = tower(model)
    if vit_trunk_of(visual) is None and (not isinstance(visual, VisionTransformer) or visual.attn_pool is not None):
        raise ConfigError(
            "loss.masked needs open_clip's ViT image tower with a token per patch (no attention pool), a timm ViT "
            f"(SigLIP 2's) or a NaFlex tower: this model's is {type(visual).__name__}"
        )
    put_on(model, PART, MaskedHead(image_width(model), options))
    return True


def build(options: MaskedOptions, context: TermContext) -> TeacherTerm | None:
    """loss.masked's term: None at ratio=0; its teacher the run's weight average (context.teacher)."""
    return teacher_term(MaskedTerm, "masked", options, context)


@contextmanager
def masked_tokens(visual: Any, mask: torch.Tensor, head: MaskedHead) -> Iterator:
    """Inside, the tower returns (pooled, per-patch tokens), the patch embeddings at `mask`'s (b, L) True positions
    the head's mask token (before the position table is added, as iBOT masks)."""
    trunk = vit_trunk_of(visual)
    embedding = patch_projection(trunk) if trunk is not None else visual.conv1
    handle = embedding.register_forward_hook(lambda module, args, out: head.fill(out, mask))
    try:
        with tokens_out(visual):
            yield
    finally:
        handle.remove()


class MaskedTerm(TeacherTerm):
    name = "masked_loss"
    options: MaskedOptions
    head: MaskedHead

    def __init__(self, model, teacher, options: MaskedOptions, seed: int = 0):
        super().__init__(model, teacher, options, PART, seed)

    def teacher_embeddings(self, images: torch.Tensor | dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.teacher_image(images)[1], images_in(images)[1]

    def outputs(self, images: torch.Tensor | dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the student's (m, P) logits at the batch's m masked patches, the teacher's (b, L, P) at every position, the
        (b, L) mask, the (b, L) patches that are the images' own: all but a NaFlex batch's padding)."""
        pixels, valid = images_in(images)
        teacher = self.teacher_head(*self.teacher_embeddings(images))
        mask = patch_masks(pixels, teacher.shape[1], self.options.ratio, self.seed, self.step or 0, valid)
        with masked_tokens(self.visual, mask, self.head):
            tokens = self.visual(self.global_view(images))[1]  # the view the teacher sees, masked
        own = valid if valid is not None else torch.ones_like(mask)
        return self.head(tokens[mask]), teacher, mask, own

    def rows(self, images: torch.Tensor | dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ℓ_i: the mean cross-entropy over row i's masked patches; the teacher's outputs at every patch."""
        student, teacher, mask, own = self.outputs(images)
        losses = self.cross_entropy(student, teacher[mask])
        rows = mask.nonzero()[:, 0]
        per_row = losses.new_zeros(len(mask)).index_add(0, rows, losses) / mask.sum(1).to(losses.dtype)
        return per_row, teacher[own], student

    def reference(self, raw, inputs: dict) -> torch.Tensor:
        """T on one process over the whole batch: each image's soft-target cross-entropy averaged over its masked
        patches, averaged over the images (every ViT image has as many: the mean over all masked patches)."""
        student, teacher, mask, _ = self.outputs(inputs["image"])
        losses = F.cross_entropy(
            student / self.options.student_temp, self.soft_targets(teacher[mask]), reduction="none"
        )
        counts = mask.sum(1)
        return torch.stack([part.mean() for part in losses.split(counts.tolist())]).mean()
