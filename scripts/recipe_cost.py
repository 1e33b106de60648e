"""SigLIP 2's recipe against plain SigLIP, counted on this CPU: the FLOPs of one training step's forward and backward
(torch.utils.flop_counter.FlopCounterMode) and the bytes autograd saves for backward at their peak
(torch.autograd.graph.saved_tensors_hooks), with the recipe's defaults and every term counting, through the
training step itself (each own-forward term's graph freed by its own backward before the next is made). The
teacher is the model's own weights (as at the terms' start); its forward is counted, as a run pays it.

    python scripts/recipe_cost.py                          # ViT-B/16 at 256 px, 2 images
    python scripts/recipe_cost.py --model clipdist-tiny --batch 8
    python scripts/recipe_cost.py --model clipdist-naflex-b16 --seq-len 256   # NaFlex, the teacher terms opted in
    python scripts/recipe_cost.py --decoder-vocab 256000   # the decoder term alone: its extra peak memory
    python scripts/recipe_cost.py --draws                  # the host time of a step's view, mask and parallel draws
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch
from torch.utils.flop_counter import FlopCounterMode

from clipdist.losses import build
from clipdist.model.factory import create_model
from clipdist.objective.weighted_sum import build_objective
from clipdist.tools.memory import SavedTensorMeter, human_bytes, model_inputs
from clipdist.tools.plan import recipe_terms
from clipdist.train.step import build_step


def step_cost(model_name: str, batch: int, recipe: str | None, size: int | None, seq_len: int | None = None) -> dict:
    """FLOPs and the peak of saved bytes of one training step as the step runs it (train.step: the own-forward
    terms backpropagated one after another, then the model's forward and backward): SigLIP's loss, and with
    `recipe` its terms, every one counting."""
    torch.manual_seed(0)
    overrides = {"vision_cfg": {"image_size": size}} if size and not seq_len else None
    model = create_model(model_name, init_logit_bias=-10.0, overrides=overrides)
    terms, _ = recipe_terms(recipe, model) if recipe else ([], False)
    objective = build_objective(build("siglip"))
    objective.terms += [(term, 1.0) for term in terms]
    objective.at(1)
    inputs = model_inputs(model, batch, getattr(model, "context_length", 77), seq_len)
    step = build_step(model, objective)
    with FlopCounterMode(display=False) as flops, SavedTensorMeter(exclude=list(model.parameters())) as meter:
        step.gradients(inputs)
    return {"flops": flops.get_total_flops(), "saved_peak_bytes": meter.peak}


def decoder_peak(vocab: int, rows: int, tokens: int, width: int) -> dict:
    """The decoder term's extra peak at this vocabulary: the largest resident memory of its cross-entropy's forward
    and backward above what the decoder, its gradients and its inputs hold (measured in a fresh process)."""
    code = f"""
import resource, torch
from clipdist.objective.decoder import CaptionDecoder
from clipdist.registry.terms import DecoderOptions
torch.manual_seed(0)
decoder = CaptionDecoder({width}, {vocab}, {tokens + 1}, DecoderOptions(layers=1, width={width}, heads=8))
for parameter in decoder.parameters():
    parameter.grad = torch.zeros_like(parameter)
patches = torch.randn({rows}, 256, {width})
text = torch.randint(1, {vocab}, ({rows}, {tokens + 1}))
parallel = torch.zeros({rows}, dtype=torch.bool)
decoder.hidden(patches, text, parallel).sum().backward()  # the blocks' own memory, before the vocabulary's
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
total, count = decoder.cross_entropy(patches, text, parallel)
total.backward()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
"""
    extra_kib = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    whole = rows * tokens * vocab * 4
    return {"extra_peak_bytes": extra_kib * 1024, "whole_logits_float32_bytes": whole}


def draw_time(rows: int = 128, crops: int = 8, patches: int = 256, repeats: int = 50) -> dict:
    """A step's draws for `rows` images: the local views' boxes and flips, the patch masks, the parallel-prediction
    draws, from the images' keys (key_tensor: one elementwise product and sum over the pixels, on the device). Their
    time on this CPU, where tensors this small cost little more than their dispatch (the median of `repeats`), and
    the tensor operations they issue: each one kernel launch on a GPU, and none reads back to the host
    (tests/unit/test_views.py runs them on the meta device)."""
    import statistics
    import time

    from torch.utils._python_dispatch import TorchDispatchMode

    from clipdist.data.views import TRIES, crop_boxes, draws

    keys = torch.randint(-(2**40), 2**40, (rows,), dtype=torch.int64)

    def step(index: int) -> None:
        uniforms = draws(keys, 0, index, "view:", crops * (4 * TRIES + 1)).view(rows, crops, -1)
        crop_boxes(uniforms[..., :-1].unflatten(-1, (TRIES, 4)), 256, 256, (0.05, 0.4), (3 / 4, 4 / 3))
        _ = uniforms[..., -1] < 0.5
        scores = draws(keys, 0, index, "mask:", patches)
        _ = scores.argsort(1).argsort(1) < torch.round(0.5 * torch.full((rows,), float(patches)))[:, None]
        _ = draws(keys, 0, index, "par:", 1)[:, 0] < 0.5

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step(0)
    times = []
    for index in range(repeats):
        start = time.perf_counter()
        step(index)
        times.append(time.perf_counter() - start)
    return {"cpu_ms": 1e3 * statistics.median(times), "ops": Count.ops}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ViT-B-16")
    parser.add_argument("--size", type=int, default=256, help="the image tower's side (0: the model's own)")
    parser.add_argument("--seq-len", type=int, default=0, help="a NaFlex tower's patches an image (e.g. 256)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--decoder-vocab", type=int, default=0, help="measure the decoder term alone at this vocab")
    parser.add_argument("--draws", action="store_true", help="time a step's draws for 128 rows x 8 views")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.draws:
        found = draw_time()
        print(
            f"draws for 128 rows x 8 views and 256-patch masks: {found['cpu_ms']:.2f} ms on this CPU, "
            f"{found['ops']} tensor operations, none read back to the host"
        )
    elif args.decoder_vocab:
        found = decoder_peak(args.decoder_vocab, rows=128, tokens=64, width=768)
        print(
            f"decoder, vocabulary {args.decoder_vocab:,}, 128 rows × 64 tokens: extra peak "
            f"{human_bytes(found['extra_peak_bytes'])} (the whole logits in float32: "
            f"{human_bytes(found['whole_logits_float32_bytes'])})"
        )
    else:
        plain = step_cost(args.model, args.batch, None, args.size or None, args.seq_len or None)
        recipe = step_cost(args.model, args.batch, "siglip2", args.size or None, args.seq_len or None)
        found = {"plain": plain, "recipe": recipe}
        shape = f"{args.seq_len} patches" if args.seq_len else f"{args.size or 'its own size'} px"
        print(f"{args.model} at {shape}, {args.batch} images, one step forward and back:")
        for name, row in found.items():
            print(f"  {name:<8} {row['flops'] / 1e9:10.1f} GFLOP   saved {human_bytes(row['saved_peak_bytes'])}")
        print(
            f"  recipe / plain: {recipe['flops'] / plain['flops']:.2f}× the FLOPs, "
            f"{recipe['saved_peak_bytes'] / plain['saved_peak_bytes']:.2f}× the saved bytes at the peak"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(found, handle, indent=2)
    return found


if __name__ == "__main__":
    main()
