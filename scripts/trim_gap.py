"""How far cutting captions to the batch's longest (data.trim_text) moves text features, per compute dtype.

    python scripts/trim_gap.py [model]      # default ViT-B-32, random init (no download)

Prints, for fp32 and for fp16 / bf16 autocast on the CPU, the largest absolute and the relative (Frobenius) gap
between a batch's text features from the context-length tokens and from the trimmed ones.
"""

import sys

import open_clip
import torch

from clipdist.model.short_text import allow_short_text, trim


def main(name: str = "ViT-B-32") -> None:
    torch.manual_seed(0)
    model = open_clip.create_model(name).eval()
    allow_short_text(model)
    colours = ["red", "green", "blue", "large yellow"]
    tokens = open_clip.get_tokenizer(name)([f"a photo of a {colours[i % 4]} thing number {i}" for i in range(32)])
    print(f"{name}: {tokens.shape[1]} tokens cut to {trim(tokens).shape[1]}")
    for label, dtype in (("fp32", None), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            whole, cut = model.encode_text(tokens).float(), model.encode_text(trim(tokens)).float()
        gap = whole - cut
        print(f"{label}: max |gap| {gap.abs().max():.2e}, relative {gap.norm() / whole.norm():.2e}")


if __name__ == "__main__":
    main(*sys.argv[1:])
