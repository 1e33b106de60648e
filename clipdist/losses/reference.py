"""The single-process losses: the definitions every distributed backend (and the distillation term) must reproduce."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def clip_loss(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale) -> torch.Tensor:
    """L = (CE(s·I·Tᵀ, diag) + CE(s·T·Iᵀ, diag)) / 2 over one whole batch (mean over rows).

    Same definition as open_clip's ``ClipLoss()`` with world size 1.
    """
    logits_per_image = logit_scale * image_features @ text_features.T
    labels = torch.arange(image_features.shape[0], device=image_features.device)
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_image.T, labels)) / 2


def siglip_loss(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale, logit_bias) -> torch.Tensor:
    """L = −(1/B) Σ_ij log σ(z_ij·(s·I_i·T_j + t)), z = +1 on the diagonal, −1 off it.

    Same definition as open_clip's ``SigLipLoss()`` with world size 1.
    """
    logits = logit_scale * image_features @ text_features.T + logit_bias
    signs = 2 * torch.eye(logits.shape[0], dtype=logits.dtype, device=logits.device) - 1
    return -F.logsigmoid(signs * logits).sum() / image_features.shape[0]


def distill_loss_reference(image_features, text_features, logit_scale, teacher_image, teacher_text, teacher_scale):
    """D = ½·[CE(softmax(y_i·), x_i·) + CE(softmax(y_·j), x_·j)] averaged over the batch, x = s·I·Tᵀ the student's and
    y = s'·I'·T'ᵀ the teacher's logits (clipdist.losses.distill). Same definition as open_clip's DistillClipLoss's
    distillation term with world size 1."""
    student = logit_scale * image_features @ text_features.T
    teacher = teacher_scale * teacher_image @ teacher_text.T

    def cross_entropy(teacher_logits, student_logits):
        return -(teacher_logits.softmax(dim=1) * student_logits.log_softmax(dim=1)).sum(dim=1).mean(dim=0)

    return (cross_entropy(teacher, student) + cross_entropy(teacher.T, student.T)) / 2
