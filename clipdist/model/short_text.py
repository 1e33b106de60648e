"""Captions padded to their batch's longest, not to the context length (data.trim_text).

open_clip's own text tower attends causally and pools at the end-of-text token (`argmax`: the largest id; `eos`),
so what comes after a batch's last end-of-text changes no caption's features: the padding columns after the last
non-pad token of any row are dropped. The same features up to float rounding, not bit for bit: the attention's sums
run over fewer (masked, zero-weight) columns. On ViT-B-32's random-init text features (size ~3),
`python scripts/trim_gap.py` measures 6.6e-7 relative in fp32, 8.8e-4 under fp16 autocast and 6.7e-3 under bf16 —
so data.trim_text=null (the default) cuts in fp32 only, and false gives open_clip's inputs exactly. The tower's work
falls with them (per layer ~24·L·d² + 4·L²·d for L positions): web captions of ~10–20 tokens against a context of 77.

    if trims_exactly(model) is None:
        allow_short_text(model)            # its encode_text takes (B, L ≤ context) tokens
        tokens = trim(tokens)              # in the step, per batch (or gradient-caching chunk)

Where padding would matter — a tower pooling at the `last` position (SigLIP's), no causal mask, a custom, Hugging
Face or CoCa text tower — nothing is trimmed, and the run's start says so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from open_clip.model import CLIP
from open_clip.transformer import text_global_pool

from clipdist.model.class_swap import swap_class

EXACT_POOLING = ("argmax", "eos")  # pools at the end-of-text token, wherever the batch's padding ends


def trims_exactly(model: torch.nn.Module) -> str | None:
    """None where dropping a batch's trailing padding changes no text feature beyond float rounding; else why not."""
    if not isinstance(model, CLIP):
        return (
            f"a {type(model).__name__} model: its text tower ({type(getattr(model, 'text', model)).__name__}) "
            "may attend to padding or pool where it ends"
        )
    if model.attn_mask is None:
        return "its text tower attends without a causal mask (padding is attended to)"
    if model.text_pool_type not in EXACT_POOLING:
        return f"its text tower pools at '{model.text_pool_type}', which moves with the padding"
    return None


def trim(tokens: torch.Tensor, pad_id: int = 0) -> torch.Tensor:
    """`tokens` without the columns after the last non-pad token of any row (one column at least)."""
    used = (tokens != pad_id).any(0).nonzero()
    return tokens[:, : int(used.max()) + 1 if len(used) else 1]


class ShortTextCLIP(CLIP):
    """open_clip's CLIP whose encode_text takes tokens shorter than the context: its position table and causal
    mask cut to them. Otherwise open_clip's encode_text line for line (open_clip 3.3, model.py)."""

    def encode_text(self, text, normalize: bool = False):
        length = text.shape[1]
        cast_dtype = self.transformer.get_cast_dtype()
        x = self.token_embedding(text).to(cast_dtype)
        x = x + self.positional_embedding[:length].to(cast_dtype)
        x = self.transformer(x, attn_mask=self.attn_mask[:length, :length])
        x = self.ln_final(x)
        x = text_global_pool(x, text, self.text_pool_type, eos_token_id=getattr(self, "text_eos_id", None))
        if self.text_projection is not None:
            x = (
                self.text_projection(x)
                if isinstance(self.text_projection, torch.nn.Linear)
                else x @ self.text_projection
            )
        return F.normalize(x, dim=-1) if normalize else x


def allow_short_text(model: torch.nn.Module) -> bool:
    """Make `model` take trimmed tokens where that is exact (trims_exactly); whether it does."""
    if trims_exactly(model) is not None:
        return False
    return swap_class(model, CLIP, ShortTextCLIP)  # encode_text takes any length
