"""Host overhead per step: clipdist's step (`build_parts(...).step`: the batch as a Batch, the agreement's
all-reduce, the RNG kept for a stop, clipping, the schedule) against a bare PyTorch loop doing the same math on the
same tiny model, batch, loss and optimizer — interleaved rounds, medians. On a GPU the compute shrinks 50-100x; what
stays is this overhead.

    python scripts/bench_overhead.py [--batch 32] [--rounds 7] [--steps 15]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import open_clip
import torch

from clipdist.distributed import host
from clipdist.tools.gpu_battery import config, synthetic_batch
from clipdist.train.parts import build_parts


def bare_step(model, optimizer, scheduler, loss_fn, pixels, tokens, mean, std, grad_clip: float) -> None:
    """What a hand-written loop does each step."""
    optimizer.zero_grad(set_to_none=True)
    images = (pixels.permute(0, 3, 1, 2).float() / 255 - mean) / std
    image_features, text_features, logit_scale = model(images, tokens)
    loss = loss_fn(image_features, text_features, logit_scale)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    scheduler.step()
    with torch.no_grad():
        model.logit_scale.clamp_(0, 4.6052)
    float(loss.detach())  # the loop reads the loss back, as any logging loop does


def timed(action, steps: int) -> float:
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cpu")
    host.keep_freed_memory()  # as the trainer's CPU ranks do (train.startup.configure_host)
    with tempfile.TemporaryDirectory() as work:
        cfg = config(work, "clipdist-tiny", "fp32", args.batch)
        parts = build_parts(cfg, device)
        batch = synthetic_batch(parts.model, args.batch, device)
        model = copy.deepcopy(parts.model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        mean = torch.tensor(model.visual.preprocess_cfg["mean"]).view(1, 3, 1, 1)
        std = torch.tensor(model.visual.preprocess_cfg["std"]).view(1, 3, 1, 1)
        loss_fn = open_clip.ClipLoss()
        pixels, tokens = batch["image"], batch["text"]
        ours, bare = [], []
        for _ in range(2):  # warm-up
            parts.step(batch)
            bare_step(model, optimizer, scheduler, loss_fn, pixels, tokens, mean, std, cfg.optim.grad_clip)
        for _ in range(args.rounds):
            ours.append(timed(lambda: parts.step(batch), args.steps))
            bare.append(
                timed(
                    lambda: bare_step(
                        model, optimizer, scheduler, loss_fn, pixels, tokens, mean, std, cfg.optim.grad_clip
                    ),
                    args.steps,
                )
            )
    pairs = [(o - b) * 1e3 for o, b in zip(ours, bare)]
    print(
        f"clipdist step {statistics.median(ours) * 1e3:.2f} ms, bare loop {statistics.median(bare) * 1e3:.2f} ms "
        f"(clipdist-tiny, batch {args.batch}, CPU, {args.rounds} interleaved rounds of {args.steps} steps)"
    )
    rounds = ", ".join(f"{pair:+.2f}" for pair in pairs)
    print(f"overhead per step: median {statistics.median(pairs):+.2f} ms (rounds: {rounds})")


if __name__ == "__main__":
    main()
