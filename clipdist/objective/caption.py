"""CoCa's captioning term, as the global token mean over the whole batch.

    T = Σ_{tokens t of the global batch, label ≠ pad} CE_t / T_count

(open_clip's CoCaLoss with `coca_caption_loss_weight` 2 by default.) open_clip takes each rank's own token mean,
which is the global mean only when every rank has as many caption tokens. Here rank r's share is
ℓ_r = N · Σ_{t∈r} CE_t / T_count with T_count summed over ranks: the mean over ranks of ℓ_r is T, and DDP's average
of ∂ℓ_r/∂θ is ∂T/∂θ — for any split of the tokens, and chunk by chunk under gradient caching (a chunk's share is
its own sum times the same N / T_count).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from clipdist.distributed import parallel
from clipdist.objective.base import Term


def caption_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ CE over the label tokens that are not padding, their number); in float32 at least. The (b, L, vocab)
    logits as b·L rows, a softmax over the last dimension: over the middle one, as open_clip's CoCaLoss takes it, CUDA
    runs its spatial softmax (59 ms forward, 28 ms backward of a 222 ms decoder step on an H200; 160 ms this way)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    total = F.cross_entropy(logits.flatten(0, 1).to(dtype), labels.flatten(), ignore_index=pad_id, reduction="sum")
    return total, (labels != pad_id).sum()


class CaptionPart(NamedTuple):
    total: torch.Tensor  # Σ CE over this rank's label tokens
    per_token: torch.Tensor  # N / T_count: what turns a sum of this rank's into its share of the global mean


class CaptionTerm(Term):
    name = "caption_loss"
    per_chunk = True  # the decoder's gradient comes from each chunk's own cross-entropy

    def __init__(self, pad_id: int = 0):
        self.pad_id = pad_id

    def take(self, raw, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ CE, token count) of this forward: the (b, L, vocab) logits go here."""
        return caption_cross_entropy(raw["logits"], raw["labels"], self.pad_id)

    def merge(self, parts: list) -> CaptionPart:
        total = sum(part[0] for part in parts)
        mean_tokens = parallel.all_reduce_mean(sum(part[1] for part in parts).to(total.device, torch.float64))  # T/N
        return CaptionPart(total, 1 / mean_tokens.clamp(min=1e-9).to(total.dtype))

    def value(self, features: tuple, part: CaptionPart) -> torch.Tensor:
        return part.per_token * part.total

    def chunk_value(self, chunk_part, part: CaptionPart) -> torch.Tensor:
        return part.per_token * chunk_part[0]

    def reference(self, raw, inputs: dict) -> torch.Tensor:
        return F.cross_entropy(raw["logits"].permute(0, 2, 1), raw["labels"], ignore_index=self.pad_id)
