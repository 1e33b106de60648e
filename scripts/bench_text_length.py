"""The text tower's step with captions cut to the batch's longest (data.trim_text) against padded to the context
length, on a model's text tower and real captions, interleaved: forward + backward time per batch, and the
captions' token lengths.

    python scripts/bench_text_length.py [--model ViT-B-32] [--batch 64] [--repeats 5] [--shards 'dir/*.tar']

Captions come from the shards' .txt members (default: the web_photos shards of the data cache, made on first use).
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import tarfile
import time

import torch

from clipdist.model.factory import create_model, get_tokenizer
from clipdist.model.short_text import allow_short_text, trim


def captions(pattern: str, count: int) -> list[str]:
    found = []
    for path in sorted(glob.glob(os.path.expanduser(pattern))):
        with tarfile.open(path) as tar:
            for member in tar:
                if member.name.endswith(".txt"):
                    found.append(tar.extractfile(member).read().decode())
                    if len(found) == count:
                        return found
    if not found:
        raise SystemExit(f"no .txt captions in {pattern}: run `python train.py data=web_photos optim.max_steps=1` once")
    return (found * (count // len(found) + 1))[:count]


def step_seconds(model, tokens: torch.Tensor) -> float:
    started = time.perf_counter()
    model.encode_text(tokens).square().sum().backward()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shards", default="~/.cache/clipdist/web_photos/train-*.tar")
    args = parser.parse_args()
    model = create_model(args.model)
    assert allow_short_text(model), "this model's text tower cannot take captions shorter than its context"
    texts = captions(args.shards, args.batch * args.repeats)
    tokenizer = get_tokenizer(args.model)
    batches = [tokenizer(texts[i * args.batch : (i + 1) * args.batch]) for i in range(args.repeats)]
    lengths = [int((row != 0).sum()) for batch in batches for row in batch]
    step_seconds(model, batches[0])  # warm-up
    padded, cut = [], []
    for batch in batches:  # interleaved: the machine's noise falls on both alike
        padded.append(step_seconds(model, batch))
        cut.append(step_seconds(model, trim(batch)))
    print(
        f"{args.model} text tower, batch {args.batch}, {args.repeats} batches of real captions: tokens a caption "
        f"median {statistics.median(lengths)}, max {max(lengths)}; batch width cut to "
        f"{[trim(batch).shape[1] for batch in batches]} of {batches[0].shape[1]}"
    )
    print(
        f"forward+backward: padded {statistics.median(padded) * 1000:.0f} ms, cut {statistics.median(cut) * 1000:.0f} "
        f"ms a batch (median): {statistics.median(padded) / statistics.median(cut):.2f}x"
    )


if __name__ == "__main__":
    main()
