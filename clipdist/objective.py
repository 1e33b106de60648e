"""What a step minimises: the contrastive loss (any backend), for open_clip's CoCa models their captioning loss, and
with a teacher the distillation term (clipdist.losses.distill) — each over the global batch, exact at any world
size, with unequal local batches and with gradient caching.

    L = w_c · L_contrastive + w_cap · L_caption + w_d · D
    L_caption = Σ_{tokens t of the global batch, label ≠ pad} CE_t / T,   T = that number of tokens

(open_clip's CoCaLoss: the same weights, `coca_contrastive_loss_weight` 1 and `coca_caption_loss_weight` 2 by
default). open_clip takes each rank's own token mean, which is the global mean only when every rank has as
many caption tokens. Here rank r returns ℓ_r = w_cap · N · Σ_{t∈r} CE_t / T with T summed over ranks: the mean
over ranks of ℓ_r is L_caption, and DDP's average of ∂ℓ_r/∂θ is ∂L_caption/∂θ — for any split of the tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from clipdist import parallel
from clipdist.defaults import DEFAULT_TILE
from clipdist.losses.distill import DistillationLoss


@dataclass
class Outputs:
    """A model's forward, in the parts the objective takes: `features` as a contrastive backend takes them
    (image, text, logit scale[, logit bias]); for a CoCa model also this rank's caption cross-entropy summed over
    its label tokens and their number (`caption`: (sum, count), None for a CLIP model)."""

    features: tuple
    caption: tuple[torch.Tensor, torch.Tensor] | None = None
    teacher: tuple | None = None  # distillation: the teacher's (image, text) features and logit scale, no graph


def caption_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ CE over the label tokens that are not padding, their number); in float32 at least."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    total = F.cross_entropy(logits.permute(0, 2, 1).to(dtype), labels, ignore_index=pad_id, reduction="sum")
    return total, (labels != pad_id).sum()


class Objective:
    """The step's loss from a model's `Outputs`: w_c times the contrastive backend on the features, plus w_cap times
    the global token mean of the caption cross-entropy (CoCa), plus w_d times the distillation term against
    `teacher` (clipdist.losses.distill, in tiles of `tile`). `caption_factor` is w_cap·N/T of the last call: the
    factor a chunk's caption sum is multiplied by when gradient caching backpropagates it chunk by chunk."""

    def __init__(self, contrastive, contrastive_weight: float = 1.0, caption_weight: float = 0.0, pad_id: int = 0,
                 teacher: torch.nn.Module | None = None, distill_weight: float = 1.0, tile: int = DEFAULT_TILE):
        self.contrastive, self.contrastive_weight = contrastive, contrastive_weight
        self.caption_weight, self.pad_id = caption_weight, pad_id
        self.teacher, self.distill_weight = teacher, distill_weight
        self.distill = DistillationLoss(tile) if teacher is not None else None
        self.caption_factor = None
        self.terms: dict[str, torch.Tensor] = {}  # the last call's terms beside the total, for the logs

    def outputs(self, raw) -> Outputs:
        """The parts of a forward: open_clip's CLIP returns (image, text, scale[, bias]); CoCa a dict with the
        caption logits and labels, turned into their cross-entropy sum here (the (b, L, vocab) logits go)."""
        if not isinstance(raw, dict):
            return Outputs(tuple(raw))
        features = (raw["image_features"], raw["text_features"], raw["logit_scale"])
        if raw.get("logit_bias") is not None:
            features += (raw["logit_bias"],)
        caption = None  # with no caption term to train, the logits are not reduced at all
        if "logits" in raw and self.caption_weight:
            caption = caption_cross_entropy(raw["logits"], raw["labels"], self.pad_id)
        return Outputs(features, caption)

    @torch.no_grad()
    def teach(self, images, tokens) -> tuple | None:
        """The teacher's normalised features of the same images and texts and its logit scale (None: no teacher);
        frozen, in eval mode, in the caller's precision."""
        if self.teacher is None:
            return None
        return (self.teacher.encode_image(images, normalize=True), self.teacher.encode_text(tokens, normalize=True),
                self.teacher.logit_scale.exp())

    def __call__(self, outputs: Outputs) -> torch.Tensor:
        contrastive = self.contrastive(*outputs.features)
        loss = contrastive if self.contrastive_weight == 1 else contrastive * self.contrastive_weight
        terms = {}  # unweighted, for the logs; their means over ranks are the global terms
        if outputs.caption is not None:
            caption_sum, count = outputs.caption
            mean_tokens = parallel.all_reduce_mean(count.to(caption_sum.device, torch.float64))  # T / N
            self.caption_factor = self.caption_weight / mean_tokens.clamp(min=1e-9).to(caption_sum.dtype)
            loss = loss + self.caption_factor * caption_sum
            terms["caption_loss"] = (self.caption_factor / self.caption_weight * caption_sum).detach()
        if self.distill is not None:
            distill = self.distill(*outputs.features[:3], *outputs.teacher)
            loss = loss + self.distill_weight * distill
            terms["distill_loss"] = distill.detach()
        self.terms = {"contrastive_loss": contrastive.detach(), **terms} if terms else {}
        return loss


def as_objective(loss_fn) -> Objective:
    """A contrastive backend as the objective it is alone (weight 1, no caption term); an Objective as is."""
    return loss_fn if isinstance(loss_fn, Objective) else Objective(loss_fn)
