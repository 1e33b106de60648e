"""On a GPU: where the battery's slow rows spend their step (run by scripts/gpu/profile.sh, after the kit's install).

For each case: the run's own step (`build_parts`, as `clipdist bench gpu` times it) on a synthetic batch on the
device — the median of timed steps, then torch.profiler over a few steps: the device's busy time against the wall
time (the rest is the GPU waiting for the host), the kernels that take the most device time, and the step's own
ranges (forward_and_loss, backward, optimizer). Variants in the same call answer one question each:

  b16 / b16_pure   ViT-B/16 × 128: bf16 autocast, then pure_bf16 (no autocast casts, LayerNorms in bf16)
  b16_compiled     the same with model.compile=true (`_battery`: as the battery times them)
  b16_model        the open_clip model's own forward and backward under autocast, a plain CLIP loss, no optimizer:
                   what clipdist's step adds
  b32 / b32_fsdp   ViT-B/32 × 256: DDP-less plain step, then FSDP2 at world 1 (0.40x in the battery; cProfile'd)
  recipe_*         NaFlex B/16 × 128 at 256 patches: plain SigLIP, then each of recipe=siglip2's terms alone

Usage: python scripts/gpu/profile_step.py [case ...] --out DIR   (default: every case)
DIR gets a JSON of the timings, the kernel tables and, for b16, a chrome trace.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gzip
import io
import json
import math
import pstats
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from clipdist.tools.gpu_battery import RECIPE_TERMS, config, one_rank_group, synchronize, synthetic_batch, time_steps
from clipdist.train.parts import build_parts

CASES: dict[str, dict] = {
    "b16": {"model": "ViT-B-16", "precision": "bf16", "rows": 128, "trace": True},
    "b16_pure": {"model": "ViT-B-16", "precision": "pure_bf16", "rows": 128},
    "b16_compiled": {"model": "ViT-B-16", "precision": "bf16", "rows": 128, "compile": True, "trace": True},
    "b16_battery": {"model": "ViT-B-16", "precision": "bf16", "rows": 128, "battery": True},
    "b16_compiled_battery": {"model": "ViT-B-16", "precision": "bf16", "rows": 128, "compile": True, "battery": True},
    "b16_model": {"model": "ViT-B-16", "precision": "bf16", "rows": 128, "raw": True},
    "b32": {"model": "ViT-B-32", "precision": "bf16", "rows": 256},
    "b32_fsdp": {"model": "ViT-B-32", "precision": "bf16", "rows": 256, "parallel": "fsdp", "cprofile": True},
    "recipe_siglip": {
        "model": "clipdist-naflex-b16",
        "precision": "bf16",
        "rows": 128,
        "seq_len": 256,
        "loss": "siglip",
    },
    **{
        f"recipe_{name}": {
            "model": "clipdist-naflex-b16",
            "precision": "bf16",
            "rows": 128,
            "seq_len": 256,
            "loss": "siglip",
            "terms": {name: RECIPE_TERMS[name]},
        }
        for name in RECIPE_TERMS
    },
    "recipe_all": {
        "model": "clipdist-naflex-b16",
        "precision": "bf16",
        "rows": 128,
        "seq_len": 256,
        "loss": "siglip",
        "terms": RECIPE_TERMS,
    },
}


def kernel_busy_us(trace: dict) -> float:
    """The time the device ran anything (the union of its kernels' and copies' intervals), in µs."""
    spans = sorted(
        (event["ts"], event["ts"] + event["dur"])
        for event in trace["traceEvents"]
        if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def raw_step(parts, batch, device):
    """open_clip's forward and backward alone: normalised pixels, autocast, a plain CLIP loss."""
    model = parts.model
    pixels = parts.step.normalize(batch["image"])
    text = batch["text"]

    def step():
        model.zero_grad(set_to_none=True)
        with parts.autocast:
            out = model(image=pixels, text=text)
            image, texts, scale = out[:3]  # (image features, text features, logit scale)
            logits = scale * image @ texts.T
            labels = torch.arange(len(logits), device=device)
            loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        loss.backward()

    return step


def measure(name: str, case: dict, device: torch.device, out: Path, steps: int, profiled: int) -> dict:
    own = ("model", "precision", "rows", "raw", "seq_len", "trace", "battery", "cprofile")
    options = {k: v for k, v in case.items() if k not in own}
    with tempfile.TemporaryDirectory() as work:
        cfg = config(Path(work), case["model"], case["precision"], case["rows"], **options)
        if case.get("battery"):  # the battery's own timing (FLOPs counted on its last warm-up step)
            row = {"case": name, **time_steps(cfg, device, 10)}
            print(json.dumps(row), flush=True)
            return row
        parts = build_parts(cfg, device)
        batch = synthetic_batch(parts.model, case["rows"], device, case.get("seq_len"))
        step = raw_step(parts, batch, device) if case.get("raw") else (lambda: parts.step(batch))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(3):
            step()
        synchronize(device)
        times, profiler = [], cProfile.Profile() if case.get("cprofile") else None
        for _ in range(steps):
            started = time.perf_counter()
            with profiler or contextlib.nullcontext():
                step()
                synchronize(device)
            times.append(time.perf_counter() - started)
        median = statistics.median(times)
        if profiler is not None:  # the host's side: where the step's Python time goes
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
            with open(out / "tables.txt", "a") as tables:
                tables.write(f"== {name}: cProfile over {steps} steps\n{text.getvalue()}\n")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=False) as prof:
            started = time.perf_counter()
            for _ in range(profiled):
                step()
            synchronize(device)
            wall = time.perf_counter() - started
        events = prof.key_averages()
        device_us = sum(
            event.self_device_time_total for event in events if event.device_type == torch.autograd.DeviceType.CUDA
        )
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        table = events.table(sort_by=key, row_limit=30, max_name_column_width=90)
        ranges = {
            event.key: {
                "cpu_ms": event.cpu_time_total / 1e3 / profiled,
                "device_ms": event.device_time_total / 1e3 / profiled,
            }
            for event in events
            if event.key in ("forward_and_loss", "backward", "optimizer")
        }
        trace = out / f"trace_{name}.json"
        prof.export_chrome_trace(str(trace))
        busy_us = kernel_busy_us(json.loads(trace.read_text()))
        if case.get("trace"):
            with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
                shutil.copyfileobj(raw, packed)
        trace.unlink()
    row = {
        "case": name,
        **{k: v for k, v in case.items() if k != "terms"},
        "terms": list(case.get("terms", {})),
        "samples_per_s": case["rows"] / median,
        "step_ms": median * 1e3,
        "spread_ms": [min(times) * 1e3, max(times) * 1e3],
        "profiled_wall_ms": wall * 1e3 / profiled,
        "device_busy_ms": busy_us / 1e3 / profiled,  # the union of the kernels' and copies' intervals
        "device_kernel_sum_ms": device_us / 1e3 / profiled,
        "dynamo": {key: dict(counters[key]) for key in ("stats", "graph_break", "recompiles") if counters[key]},
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
        "ranges": ranges,
    }
    with open(out / "tables.txt", "a") as tables:  # one file: a device call brings back at most 8
        tables.write(f"== {name}: {row['samples_per_s']:.0f} samples/s\n{table}\n")
    print(json.dumps(row), flush=True)
    print(table[:6000], flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="*", default=list(CASES))
    parser.add_argument("--out", type=Path, default=Path("profile_out"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profiled", type=int, default=3)
    parser.add_argument("--budget", type=float, default=300.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(torch.__version__, torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", flush=True)
    if device.type == "cpu":  # a smoke test of the script itself: tiny towers, fp32
        for case in CASES.values():
            case.update(
                model="clipdist-naflex-tiny" if "seq_len" in case else "clipdist-tiny",
                precision="fp32",
                rows=8,
                **({"seq_len": 16} if "seq_len" in case else {}),
            )
    started, rows = time.perf_counter(), []
    for name in args.cases:
        if time.perf_counter() - started > args.budget:
            print(f"{name}: skipped, budget spent", flush=True)
            continue
        began = time.perf_counter()
        counters.clear()
        if CASES[name].get("compile"):
            torch._dynamo.reset()
        try:
            if CASES[name].get("parallel") == "fsdp":
                with one_rank_group(device):
                    rows.append(measure(name, CASES[name], device, args.out, args.steps, args.profiled))
            else:
                rows.append(measure(name, CASES[name], device, args.out, args.steps, args.profiled))
        except Exception:  # noqa: BLE001 -- one case's failure is reported; the others go on
            traceback.print_exc()
            rows.append({"case": name, "error": traceback.format_exc()[-800:]})
        rows[-1]["took_s"] = time.perf_counter() - began
        (args.out / "profile.json").write_text(json.dumps(rows, indent=1))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("\ncase              samples/s  step ms  busy ms  wall ms  peak GiB", flush=True)
    for row in rows:
        if "error" in row:
            print(f"{row['case']:<17} error")
            continue
        step_ms = row.get("step_ms", row.get("step_s", math.nan) * 1e3)
        busy, wall, peak = (row.get(key, math.nan) for key in ("device_busy_ms", "profiled_wall_ms", "peak_gib"))
        print(f"{row['case']:<17} {row['samples_per_s']:9.0f} {step_ms:8.1f} {busy:8.1f} {wall:8.1f} {peak:9.2f}")


if __name__ == "__main__":
    sys.exit(main())
