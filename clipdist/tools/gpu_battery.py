"""`clipdist bench gpu`: the GPU battery — one command for whoever is lent a GPU, and the same at tiny sizes on the
CPU so that CI runs it and it cannot rot.

    clipdist bench gpu                                   # on a GPU: the table, and --doc writes it into docs/
    clipdist bench gpu --tiny                            # CPU: clipdist-tiny, small batches (what CI runs)

Every row runs the run's own code — `parts.build_parts` (model, AdamW, schedule, precision, objective, the step
with its device normalisation) — on a synthetic batch of uint8 pixels and tokens already on the device, so the
figures are the step's, not the loader's:

  step        ViT-B/32, B/16, L/14 × bf16, fp16 × compile off / on (--tiny: clipdist-tiny)
  large batch disco, tiled and siglip at global batches of 16k, 32k and 64k on one device, gradient caching in
              chunks of 1,024 (--large-batches for 128k, 256k; --tiny: 512 in chunks of 64)
  naflex      NaFlex ViT-B/16 bf16 at 256, 576 and 784 patches an image under one token budget (100,352 patches:
              392, 174, 128 images), tokens/s; ViT-B/16 at fixed 224 px on the same budget (512 images)
              (--tiny: naflex_tiny at 16 and 64 patches, 1,024 patches a batch)
  recipe      NaFlex ViT-B/16 bf16 at 256 patches × 128 images: plain SigLIP, then with recipe=siglip2's decoder,
              self-distillation and masked prediction all counting (samples/s and peak memory side by side)
              (--tiny: naflex_tiny at 16 patches)
  fsdp        the B/32 bf16 step under FSDP2 at world 1 (a process group of one)
  checkpoint  how long a save in the background holds the loop (checkpoint.async_save), and its write
  compile     a compiled real run of ViT-B/16 started twice on one run directory: its first step cold, then from the
              caches beside the run (a resume or a requeued job's start; not with --tiny: CI's
              tests/integration/test_compile_cache.py)
  data        a real run, `train.py world=1gpu data=web_photos` (--tiny: `world=local data=digits`): pinned
              memory, non_blocking copies and normalisation on the device, the paths the CPU suite cannot reach;
              the loader alone on every spare core, decoding and handing over bytes; then the real run with
              data.decode_on=device (nvJPEG on CUDA)

samples/s: the batch over the median step time (CUDA synchronised); MFU: the step's FLOPs (torch's FlopCounterMode
over one step: forward, loss, backward) × steps/s over the device's dense peak in the step's dtype — from its spec
where the name is known (H100 / H200 SXM 989 TFLOPS bf16 and fp16, H100 PCIe 756, A100 312), else a large matmul
measured here; memory: max_memory_allocated (CUDA) or the rise in resident memory (CPU). A row that fails says why
in its own line and the others go on.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from torch.utils.flop_counter import FlopCounterMode

from clipdist.checkpoint.manager import Checkpointer
from clipdist.checkpoint.state import TrainState
from clipdist.config import DataConfig, to_train_config
from clipdist.data.batch import Batch, apply, zero_counts
from clipdist.data.builtin import builtin_shards
from clipdist.data.sources import expand_shards
from clipdist.data.transforms import image_transforms
from clipdist.distributed import host
from clipdist.distributed.launch import detect_env, free_port
from clipdist.files import json_of, read_bounded, write_atomic
from clipdist.model.factory import create_model, get_tokenizer, image_size, random_tokens
from clipdist.model.timm_towers import full_patches, naflex_patch_size, naflex_trunk
from clipdist.tools.limit import real_run, run_train
from clipdist.tools.loader_rate import samples_per_second, stream_rows
from clipdist.train.parts import build_parts

SPEC_TFLOPS = {
    "H200": 989.0,
    "H100 80GB HBM3": 989.0,
    "H100 SXM": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
}  # dense bf16 / fp16 tensor-core peaks, by the first name fragment that matches
MODELS = ("ViT-B-32", "ViT-B-16", "ViT-L-14")
BATCH = {"ViT-B-32": 256, "ViT-B-16": 128, "ViT-L-14": 64, "clipdist-tiny": 32}


def peak_tflops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(the device's dense peak in `dtype`, where it came from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, tflops in SPEC_TFLOPS.items():
            if fragment in name:
                return tflops, f"{name} spec"
    size = 8192 if device.type == "cuda" else 1024
    a, b = (
        torch.randn(size, size, device=device, dtype=dtype if device.type == "cuda" else torch.float32)
        for _ in range(2)
    )
    for _ in range(2):
        a @ b
    synchronize(device)
    started, repeats = time.perf_counter(), 10
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - started) / 1e12, "a matmul measured here"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def memory_peak(device: torch.device):
    """Yields a dict whose "bytes" is, after the block, its peak device memory (CUDA) or resident-memory rise."""
    found: dict = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = psutil.Process().memory_info().rss
    yield found
    found["bytes"] = (
        torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else max(psutil.Process().memory_info().rss - before, 0)
    )


def config(
    work: Path,
    model: str,
    precision: str,
    rows: int,
    *,
    loss: str = "disco",
    chunks: int = 1,
    compile: bool = False,
    compile_mode: str = "default",
    parallel: str = "ddp",
    terms: dict | None = None,
    reshard_after_forward: bool = True,
):
    """A run's config for one row; `terms`: loss term sections (RECIPE_TERMS) beside the loss, with a weight average
    for the teacher terms."""
    return to_train_config(
        {
            "name": "battery",
            "run_dir": str(work),
            "precision": precision,
            "model": {"name": model, "compile": compile, "compile_mode": compile_mode},
            "loss": {"name": loss, **(terms or {})},
            "world": {"batch_per_device": rows, "parallel": parallel, "reshard_after_forward": reshard_after_forward},
            "grad_cache": {"chunks": chunks},
            "optim": {"warmup_steps": 1, "max_steps": 10**6, "ema": {"decay": 0.999 if terms else 0.0}},
        }
    )


# recipe=siglip2's terms, every one counting from the first step (conf/recipe/siglip2.yaml starts two at 80%)
RECIPE_TERMS = {
    "decoder": {"layers": 2, "heads": 8, "parallel": 0.5},
    "self_distill": {"crops": 8, "start_at": 0.0},
    "masked": {"ratio": 0.5, "start_at": 0.0, "weight": 0.25},
}


def synthetic_batch(model, rows: int, device: torch.device, seq_len: int | None = None):
    """uint8 pixels (B, H, W, C) and random tokens on the device: what a GPU rank holds after the loader's copy (a
    NaFlex tower: float32 patches, every image filling `seq_len`)."""

    height, width = image_size(model)
    if naflex_trunk(model) is not None:
        if seq_len is None:
            raise ValueError(f"{model}: a NaFlex tower's synthetic batch needs its seq_len")
        pixels = apply(full_patches(rows, naflex_patch_size(model), seq_len), lambda tensor: tensor.to(device))
    else:
        pixels = torch.randint(0, 256, (rows, height, width, 3), dtype=torch.uint8, device=device)
    tokens = random_tokens(rows, model.context_length).to(device)
    return Batch.of(pixels, tokens, zero_counts(1))


def measured(
    device: torch.device, steps: int, model: str, precision: str, rows: int, warmup: int = 2, seq_len=None, **options
) -> Callable[[Path], dict]:
    """A row's action: `time_steps` on the config of `model` × `rows` (config's `options`), in the row's folder."""
    return lambda work: time_steps(config(work, model, precision, rows, **options), device, steps, warmup, seq_len)


def time_steps(cfg, device: torch.device, steps: int, warmup: int = 2, seq_len: int | None = None) -> dict:
    """One row: the run's step on a synthetic batch — samples/s (and image tokens/s at a NaFlex `seq_len`), FLOPs
    per step, peak memory."""

    if cfg.model.compile:
        torch._dynamo.reset()  # a row of its own: no graphs, guards or recompile count left by an earlier row
    parts = build_parts(cfg, device)
    rows = cfg.world.batch_per_device
    batch = synthetic_batch(parts.model, rows, device, seq_len)
    counter = FlopCounterMode(display=False)
    # FLOPs counted on the last warm-up step, a compiled model's on one more step after the timed ones: stepped under
    # FlopCounterMode before them, a compiled ViT-B/16 ran them at 1,203 samples/s instead of 2,126 (an H200)
    count_after = cfg.model.compile
    with memory_peak(device) as memory:
        for index in range(warmup):
            with counter if index == warmup - 1 and not count_after else contextlib.nullcontext():
                parts.step(batch)
        times = []
        for _ in range(steps):
            synchronize(device)
            started = time.perf_counter()
            parts.step(batch)
            synchronize(device)
            times.append(time.perf_counter() - started)
        if count_after:
            with counter:
                parts.step(batch)
    seconds = statistics.median(times)
    return {
        "samples_per_s": rows / seconds,
        "step_s": seconds,
        "flops": counter.get_total_flops(),
        "memory_bytes": memory["bytes"],
        **({"tokens_per_s": rows * seq_len / seconds} if seq_len else {}),
    }


@contextmanager
def one_rank_group(device: torch.device):
    """A process group of one (FSDP2 needs a mesh), torn down after."""
    import torch.distributed as dist

    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def checkpoint_stall(cfg, device: torch.device) -> dict:
    """How long a background save holds the loop — its own time, and the next step's wait for the state's copy made
    beside that step's forward and backward — and how long its write takes until published."""

    parts = build_parts(cfg, device)
    batch = synthetic_batch(parts.model, cfg.world.batch_per_device, device)
    parts.step(batch)  # AdamW's moments exist
    state = TrainState(parts.model, parts.optimizer, parts.scheduler, scaler=parts.scaler, step=1)
    checkpointer = Checkpointer(cfg, Path(cfg.run_dir), detect_env())
    started = time.perf_counter()
    assert checkpointer.save(state)
    pending = checkpointer.pending
    parts.step(batch)  # the next step: its update waits for the copy
    synchronize(device)
    stall = pending.held_s if pending is not None else time.perf_counter() - started
    assert checkpointer.finish()
    return {"stall_s": stall, "written_s": time.perf_counter() - started}


def data_run(tiny: bool, steps: int, decode_on: str = "host") -> dict:
    """A real run (limit.real_run: a fresh interpreter): its median samples/s; `decode_on` device: the JPEGs decoded
    by the rank (nvJPEG on CUDA), the workers handing over bytes and crop boxes."""

    overrides = (
        ["world=local", "data=digits", "world.batch_per_device=64"]
        if tiny
        else ["world=1gpu", "data=web_photos", "model=vit_b32", "precision=bf16", "world.batch_per_device=256"]
    )
    return {"samples_per_s": real_run([*overrides, f"data.decode_on={decode_on}"], steps, timeout_s=600)}


FIRST_STEP = re.compile(r"step \d+: ([\d.]+) s with torch\.compile's first compile")


def compile_starts(work: Path) -> dict:
    """ViT-B/16 bf16 compiled, a real run started twice on one run directory (fresh interpreters): its first step's
    seconds with a cold compile, then resumed with the caches beside the run (checkpoint.compile_cache)."""
    overrides = ["world=1gpu", "data=digits", "model=vit_b16", "precision=bf16", "model.compile=true"]
    said = [run_train(work / "run", [*overrides, "world.batch_per_device=128"], steps, 900) for steps in (2, 3)]
    cold, warm = (first_step_seconds(text) for text in said)
    return {"cold_s": cold, "warm_s": warm}


def first_step_seconds(said: str) -> float:
    """The first step's seconds a compiled run's log says (its compile, or its cache's read)."""
    found = FIRST_STEP.search(said)
    if found is None:
        raise RuntimeError("the run said no first compiled step")
    return float(found.group(1))


def loader_rates(tiny: bool, workers: int, batches: int) -> dict:
    """The loader alone, no step: samples/s a rank's `workers` make of ViT-B/32's 224-px training batches from
    web_photos (--tiny: clipdist-tiny's from the digits), decoding on the host, then handing over JPEG bytes and crop
    boxes for the device to decode (data.decode_on=device); two batches of warm-up each."""
    model, source, batch = ("clipdist-tiny", "digits", 64) if tiny else ("ViT-B-32", "web_photos", 128)
    shards = expand_shards(builtin_shards(source, str(Path("~/.cache/clipdist").expanduser()))[0])
    transform = image_transforms(create_model(model, device="meta"), DataConfig())[0]
    tokenizer = get_tokenizer(model)
    rates = {
        decode_on: samples_per_second(
            stream_rows(
                shards, batch, workers, transform, tokenizer, pixels=True, decode_on=decode_on, shuffle_buffer=256
            ),
            skip=2,
            count=batches,
        )
        for decode_on in ("host", "device")
    }
    return {"samples_per_s": rates["host"], "bytes_per_s": rates["device"], "workers": workers}


def loader_row(tiny: bool) -> Planned:
    """The loader's rate per core on this machine, decoding on the host and handing over bytes (decode_on=device)."""
    workers = 0 if tiny else max(1, (os.cpu_count() or 2) - 1)  # --tiny: in the process, no worker to start
    batches = 3 if tiny else 40
    return Planned(
        "data",
        f"the loader alone, {workers} worker(s): decoded on the host, then bytes and boxes (data.decode_on=device)",
        lambda work: loader_rates(tiny, workers, batches),
        20.0,  # two streams of 42 batches: 10,752 images at ~300 a core decoded, ~2,400 handed over
    )


FORWARD_GFLOPS = {  # one sample's forward, image + text towers (224 px, 77 tokens), FlopCounterMode's count (two
    # a multiply-add; open_clip's tables give multiply-adds: half these): the plan's time estimates
    "ViT-B-32": 14.8,
    "ViT-B-16": 41.3,
    "ViT-L-14": 175.2,
    "clipdist-tiny": 0.04,
    "clipdist-naflex-tiny": 0.04,
    "clipdist-naflex-b16": 41.3,
}
ASSUMED_MFU = 0.18  # for estimates only: the bf16 rows measured 15-20% on an H200 (docs/bench/gpu_battery.md)
SETUP_S, COMPILE_S = 8.0, 60.0  # building the parts; torch.compile's first steps
DEFAULT_BUDGET_S = 420.0  # 7 minutes: fits one 10-minute device call with the machine's start and the kit's install


@dataclass
class Planned:
    """One row of the plan: what it runs and how long it is expected to take."""

    section: str
    what: str
    action: Callable[[Path], dict]
    estimate_s: float
    peak: tuple[float, str] | None = None


def step_estimate(
    model: str, rows: int, steps: int, peak_tflops: float, compiled: bool = False, passes=3.0, warmup: int = 2
) -> float:
    """Seconds for a row of `time_steps`: `warmup` steps, then `steps` timed ones (and a compiled row's FLOP count), of
    `rows` samples; 3 forwards' FLOPs a sample (forward and backward; gradient caching's re-forward: 4) at
    ASSUMED_MFU of the peak, plus building (and compiling)."""
    flops = FORWARD_GFLOPS.get(model, 40.0) * 1e9 * passes * rows * (warmup + steps + compiled)
    return SETUP_S + (COMPILE_S if compiled else 0.0) + flops / (peak_tflops * 1e12 * ASSUMED_MFU)


def save_row(base: str, precision: str, device: torch.device) -> Planned:
    """A background save's stall (the loop held for the copy to host memory) and its write time."""

    def work(folder):
        return checkpoint_stall(config(folder, base, precision, BATCH[base]), device)

    return Planned("checkpoint", f"{base} background save", work, SETUP_S + 10.0)


def battery_device(tiny: bool) -> torch.device:
    """The CPU for the tiny battery, the GPU for the full one (its rows, ViT-B/16 and L/14 in bf16, are a GPU's)."""
    if tiny:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            "no CUDA device here: the battery's rows (ViT-B/16 and L/14 in bf16, real runs) are a GPU's; --tiny runs "
            "its small version on the CPU"
        )
    return torch.device("cuda")


def plan(tiny: bool, steps: int, large_batches, device: torch.device, peaks: dict) -> list[Planned]:
    """Every row, most valuable first (estimates from an H200's measured rows): the B/16 and B/32 bf16 step, a real
    run's loader feeding the device and the loader alone, the loss backends at the smallest and largest global batch
    on one device with gradient caching, NaFlex at one token budget, the recipe's terms, a background save's stall;
    then the compiled B/16 step, FSDP2 at world 1, L/14 compiled, B/16 with CUDA graphs and at × 256, a compiled run's
    second start, the real run decoding on the device, the rest of compile, fp16 and L/14, the batch curve's middle."""
    precision = "fp32" if device.type == "cpu" else "bf16"
    peak = peaks[precision]
    models = ("clipdist-tiny",) if tiny else ("ViT-B-16", "ViT-B-32")
    base = "clipdist-tiny" if tiny else "ViT-B-32"

    def step_row(model: str, prec: str, compiled: bool, size: int | None = None, mode: str = "default") -> Planned:
        size = size or BATCH[model]
        label = f"{' compiled' if compiled else ''}{f' {mode}' if mode != 'default' else ''}"
        return Planned(
            "step",
            f"{model} {prec}{label} × {size}",
            measured(device, steps, model, prec, size, compile=compiled, compile_mode=mode),
            step_estimate(model, size, steps, peaks[prec][0], compiled),
            peaks[prec],
        )

    def large_rows(size: int, micro: int) -> list[Planned]:
        return [
            Planned(
                "large batch",
                f"{base} {precision} {loss} × {size:,} in chunks of {micro}",
                measured(device, 1, base, precision, size, warmup=1, loss=loss, chunks=size // micro),
                step_estimate(base, size, 1, peak[0], passes=4.0, warmup=1),
                peak,
            )
            for loss in ("disco", "tiled", "siglip")
        ]

    sizes, micro = ((512,), 64) if tiny else (sorted(large_batches), 1024)
    ends = sorted({sizes[0], sizes[-1]})
    first = [step_row(model, precision, False) for model in models]
    first += [data_row(tiny, peak[0]), loader_row(tiny)]
    first += [row for size in ends for row in large_rows(size, micro)]
    first += naflex_rows(tiny, steps, precision, peak, device)
    first.append(save_row(base, precision, device))
    fsdp = fsdp_row(base, precision, device, steps, peak)
    later = [fsdp]
    if not tiny:  # the chip's limit first: the compiled step (the run's default on CUDA), FSDP2, L/14, a second start
        later = [
            step_row("ViT-B-16", precision, True),
            fsdp,
            step_row("ViT-L-14", "bf16", True),
            step_row("ViT-B-16", precision, True, mode="reduce_overhead"),  # CUDA graphs: blind until measured
            fsdp_row(base, precision, device, steps, peak, kept=True),
            step_row("ViT-B-16", precision, True, size=256),
            Planned("compile", "ViT-B-16 bf16 × 128, train.py started twice", compile_starts, 150.0),
            data_row(tiny, peak[0], "device"),  # built without a GPU (tests/integration/test_device_decode.py)
            step_row("ViT-B-32", precision, True),
            step_row("ViT-B-16", precision, False, size=256),
            step_row("ViT-L-14", "bf16", False),
            *(step_row(model, "fp16", False) for model in ("ViT-B-16", "ViT-B-32")),
        ]
    later += [row for size in sizes if size not in ends for row in large_rows(size, micro)]
    return first + later


def fsdp_row(base: str, precision: str, device: torch.device, steps: int, peak, kept: bool = False) -> Planned:
    """The step under FSDP2 at world 1 (a process group of one), against the DDP step's row; `kept`: with
    world.reshard_after_forward=false."""
    label = ", gathered weights kept" if kept else ""
    return Planned(
        "fsdp",
        f"{base} {precision} FSDP2 × {BATCH[base]}, world 1{label}",
        lambda work: with_one_rank_group(
            device,
            lambda: measured(
                device, steps, base, precision, BATCH[base], parallel="fsdp", reshard_after_forward=not kept
            )(work),
        ),
        step_estimate(base, BATCH[base], steps, peak[0]) + 5.0,
        peak,
    )


def data_row(tiny: bool, peak_tflops: float, decode_on: str = "host") -> Planned:
    """A real run's loader feeding the device (the paths the CPU suite cannot reach); data.decode_on=`decode_on`."""
    data_steps = 8 if tiny else 200
    return Planned(
        "data",
        "train.py "
        + ("world=local data=digits" if tiny else "world=1gpu data=web_photos vit_b32 bf16")
        + ("" if decode_on == "host" else f" data.decode_on={decode_on}")
        + f", {data_steps} steps",
        lambda work: data_run(tiny, data_steps, decode_on),
        30.0 if tiny else 45.0 + step_estimate("ViT-B-32", 256, data_steps, peak_tflops),
    )


def naflex_rows(tiny: bool, steps: int, precision: str, peak, device: torch.device) -> list[Planned]:
    """NaFlex at one token budget, then the recipe's terms against plain SigLIP on the same NaFlex batch."""
    rows: list[Planned] = []
    naflex, lengths, budget = (
        ("clipdist-naflex-tiny", (16, 64), 1024) if tiny else ("clipdist-naflex-b16", (576,), 128 * 784)
    )
    for length in lengths:
        rows.append(
            Planned(
                "naflex",
                f"{naflex} {precision} × {budget // length} at {length} patches ({budget:,} a batch)",
                measured(device, steps, naflex, precision, budget // length, seq_len=length),
                step_estimate(naflex, budget // 196, steps, peak[0]),
                peak,
            )
        )
    recipe_length = 16 if tiny else 256  # SigLIP 2's NaFlex B/16 at 256 patches
    recipe_rows = budget // (4 * recipe_length) if tiny else 128
    for label, terms in (("siglip", None), ("recipe=siglip2 terms", RECIPE_TERMS)):
        rows.append(
            Planned(
                "recipe",
                f"{naflex} {precision} {label} × {recipe_rows} at {recipe_length} patches",
                measured(
                    device, steps, naflex, precision, recipe_rows, seq_len=recipe_length, loss="siglip", terms=terms
                ),
                step_estimate(
                    naflex,
                    recipe_rows * recipe_length // 196,
                    steps,
                    peak[0],
                    passes=24.0 if terms else 3.0,  # the terms: 7.8× the plain step on an H200
                ),
                peak,
            )
        )
    return rows


def chosen(items: list[Planned], sections: list[str] | None) -> list[Planned]:
    """The plan's rows of `sections` (all where None); a ValueError where none is left (--tiny has no compile row)."""
    kept = [item for item in items if sections is None or item.section.replace(" ", "-") in sections]
    if not kept:
        present = sorted({item.section.replace(" ", "-") for item in items})
        asked = ",".join(sections or [])
        raise ValueError(f"--sections {asked}: this plan has none of those rows ({', '.join(present)})")
    return kept


def with_one_rank_group(device: torch.device, action: Callable[[], dict]) -> dict:
    with one_rank_group(device):
        return action()


def battery(
    tiny: bool = False,
    steps: int = 10,
    large_batches=(16384, 32768, 65536),
    out=None,
    doc=None,
    budget_s: float | None = None,
    resume=None,
    sections: list[str] | None = None,
) -> list[dict]:
    """Run the plan within `budget_s` (default: DEFAULT_BUDGET_S on a GPU, none on the CPU): a row whose estimate
    does not fit what is left is skipped and says so; every finished row is written to `out` (JSON) and `doc`
    (Markdown) at once, so a battery stopped midway leaves every row it finished. `resume`: an earlier run's JSON —
    its measured rows (same section and label on the same device) are kept as they are, the rest run. `sections`:
    only the rows of these sections (a space in a name is a hyphen: large-batch)."""
    device = battery_device(tiny)
    kept = finished_rows(resume, device_name(device))  # a bad file: one line before anything runs
    if device.type == "cpu":
        host.keep_freed_memory()  # as the trainer's CPU ranks do (train.startup.configure_host)
    precisions = ("fp32",) if device.type == "cpu" else ("bf16", "fp16")
    peaks = {
        name: peak_tflops(device, dtype)
        for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32))
        if name in precisions
    }
    if budget_s is None:
        budget_s = DEFAULT_BUDGET_S if device.type == "cuda" else float("inf")
    items = chosen(plan(tiny, steps, large_batches, device, peaks), sections)  # a bad choice: before any row
    print(HEADER, flush=True)
    started, rows = time.perf_counter(), []
    for name, (tflops, source) in peaks.items():
        rows.append(
            {
                "section": "peak",
                "what": f"{name} dense peak",
                "device": device_name(device),
                "tflops": tflops,
                "source": source,
            }
        )
    for item in items:
        left = budget_s - (time.perf_counter() - started)
        if (item.section, item.what) in kept:
            row = kept[item.section, item.what]
        elif item.estimate_s > left:
            row = {
                "section": item.section,
                "what": item.what,
                "device": device_name(device),
                "skipped": f"needs ~{item.estimate_s:.0f} s, {max(left, 0):.0f} s of the budget left",
            }
        else:
            row = run_row(item, device)
        rows.append(row)
        print(format_row(row), flush=True)
        publish(rows, out, doc)
    return rows


def finished_rows(path, device: str) -> dict[tuple[str, str], dict]:
    """The measured rows of an earlier run's JSON on this device, by (section, label): none skipped or failed."""
    if path is None:
        return {}
    rows = json_of(read_bounded(path, 64 << 20))  # a JSON error is a ValueError: one line
    if not isinstance(rows, list) or not all(map(_is_row, rows)):
        raise ValueError(
            f"--resume {path}: not a battery's rows (a JSON list of rows, each with its section and what as text and "
            f"its figures as numbers: {', '.join(FIGURES)})"
        )
    return {
        (row["section"], row["what"]): row
        for row in rows
        if row["section"] != "peak" and row.get("device") == device and not {"skipped", "error"} & row.keys()
    }


FIGURES = (
    "samples_per_s",
    "mfu",
    "memory_bytes",
    "stall_s",
    "written_s",
    "cold_s",
    "warm_s",
    "tflops",
    "tokens_per_s",
    "flops",
    "step_s",
    "bytes_per_s",
    "workers",
)


def _is_row(row) -> bool:
    """A row as run_row writes it: section, what (and device, source, error, skipped) text, its figures numbers."""
    if not isinstance(row, dict) or not all(isinstance(row.get(key), str) for key in ("section", "what")):
        return False
    texts = all(isinstance(row.get(key, ""), str) for key in ("device", "source", "error", "skipped"))
    return texts and all(type(row[key]) in (int, float) and math.isfinite(row[key]) for key in FIGURES if key in row)


def run_row(item: Planned, device: torch.device) -> dict:
    """One planned row, measured (or the reason it failed), with its estimate and what it took."""
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        try:
            figures = item.action(Path(work))
        except Exception as error:  # noqa: BLE001 -- a row that fails says why; the battery goes on
            figures = {"error": " ".join(f"{type(error).__name__}: {error}".split())[:300]}
    if item.peak and "flops" in figures:
        figures["mfu"] = figures["flops"] / figures["step_s"] / 1e12 / item.peak[0]
    return {
        "section": item.section,
        "what": item.what,
        "device": device_name(device),
        **figures,
        "estimate_s": item.estimate_s,
        "took_s": time.perf_counter() - began,
    }


def publish(rows: list[dict], out, doc) -> None:
    """Every row so far, to the JSON file `out` and the Markdown page `doc` (each replaced whole, atomically)."""
    for path, text in ((out, json.dumps(rows, indent=2) + "\n"), (doc, doc and page(rows))):
        if path:
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(target, text)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"


def format_row(row: dict) -> str:
    """One line of the table (Markdown)."""
    if "error" in row:
        return f"| {row['section']} | {row['what']} | failed: {row['error']} | | | |"
    if "skipped" in row:
        return f"| {row['section']} | {row['what']} | skipped: {row['skipped']} | | | |"
    samples = f"{row['samples_per_s']:,.0f}" if "samples_per_s" in row else ""
    mfu = f"{row['mfu']:.1%}" if "mfu" in row else ""
    memory = f"{row['memory_bytes'] / 2**30:.2f} GiB" if "memory_bytes" in row else ""
    other = (
        f"stall {row['stall_s'] * 1e3:.0f} ms, written in {row['written_s']:.2f} s"
        if "stall_s" in row
        else f"first step {row['cold_s']:.1f} s cold, {row['warm_s']:.1f} s from the cache beside the run"
        if "cold_s" in row
        else f"{row['samples_per_s'] / max(row['workers'], 1):,.0f} a worker; bytes and boxes "
        f"{row['bytes_per_s']:,.0f} ({row['bytes_per_s'] / max(row['workers'], 1):,.0f} a worker)"
        if "bytes_per_s" in row
        else f"{row['tflops']:.0f} TFLOPS ({row['source']})"
        if "tflops" in row
        else f"{row['tokens_per_s']:,.0f} image tokens/s"
        if "tokens_per_s" in row
        else ""
    )
    return f"| {row['section']} | {row['what']} | {samples} | {mfu} | {memory} | {other} |"


HEADER = "| section | what | samples/s | MFU | memory | other |\n|---|---|---:|---:|---:|---|"


PAGE_TITLE = "# GPU battery: "


def is_page(data: bytes) -> bool:
    """Whether `data` is a page `page` wrote (what `--doc` may replace)."""
    return data.startswith(PAGE_TITLE.encode())


def page(rows: list[dict]) -> str:
    """The table as a Markdown page (docs/bench/gpu_battery.md when run on a GPU)."""
    when = time.strftime("%Y-%m-%d")
    lines = [
        f"{PAGE_TITLE}{rows[0]['device']} ({when})",
        "",
        "`clipdist bench gpu` (clipdist/tools/gpu_battery.py"
        "): the run's own step on a synthetic batch on the device, torch " + torch.__version__ + ".",
        "",
        HEADER,
        *map(format_row, rows),
        "",
    ]
    return "\n".join(lines)


def estimate_table(
    peak_tflops: float, steps: int = 10, large_batches=(16384, 32768, 65536), sections: list[str] | None = None
) -> str:
    """The plan's rows (of `sections`: all where None) and their estimates on a device of this dense peak (e.g. 989:
    H100 SXM bf16), without running anything: what `--budget` will fit."""
    device = torch.device("cuda")
    peaks = {"bf16": (peak_tflops, "spec"), "fp16": (peak_tflops, "spec")}
    rows = chosen(plan(False, steps, large_batches, device, peaks), sections)
    total, lines = 0.0, ["| row | estimate | running total |", "|---|---:|---:|"]
    for item in rows:
        total += item.estimate_s
        lines.append(f"| {item.section}: {item.what} | {item.estimate_s:.0f} s | {total:.0f} s |")
    return "\n".join(lines)
