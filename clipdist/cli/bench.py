"""`clipdist bench loss|gpu|limit`: the loss backends' memory and time, the GPU battery, a run against this
machine's limit (clipdist.tools.bench, gpu_battery, limit)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from clipdist.cli.arguments import count, count_or_zero, csv, file_stem, non_negative, one_of, positive
from clipdist.cli.command import Command, arg, given
from clipdist.files import check_output, is_json, write_atomic


def run_loss(args: argparse.Namespace) -> int:
    from clipdist.tools import bench
    from clipdist.tools.plan import parse_bytes

    for name, ours in bench.outputs(args.tag):  # replaced after the benchmark: checked before it
        check_output(Path(args.out) / name, "--out", ours, kind="a benchmark's file", make_folder=True)
    names = bench.backends(args.backend)
    fits = bench.loss_fits(names)
    options = given(args, "backend", "out", "tag", "scaling_world", "scaling_batch", "scaling_dim", "budget")
    if hasattr(args, "budget"):
        options["budget_bytes"] = parse_bytes(args.budget, "--budget")
    rows = bench.run(names, fits=fits, **options)
    scaling = (
        bench.scaling(fits, names, args.scaling_world, args.scaling_batch or bench.SCALING_BATCHES, args.scaling_dim)
        if args.scaling_world
        else []
    )
    for path in bench.write(rows, Path(args.out), args.tag, scaling):
        print(f"wrote {path}")
    for world_size, global_batch in dict.fromkeys((row["world_size"], row["global_batch"]) for row in rows):
        print(f"\n{bench.markdown(rows, world_size, global_batch)}")
    if scaling:
        print(
            f"\n{bench.scaling_markdown(scaling)}\n(kept for backward; in brackets with what the backward "
            "holds on top. From the exact fits above, not run.)"
        )
    return 0


# the GPU battery's sections (clipdist.tools.gpu_battery.plan), as --sections names them
BATTERY_SECTIONS = ("step", "data", "large-batch", "naflex", "recipe", "checkpoint", "compile", "fsdp")


def run_gpu(args: argparse.Namespace) -> int:
    from clipdist.tools import gpu_battery

    if args.estimate_for is not None:
        print(gpu_battery.estimate_table(args.estimate_for, args.steps, args.large_batches, args.sections))
        return 0
    if args.out:
        check_output(args.out, "--out", is_json, make_folder=True)
    if args.doc:
        check_output(args.doc, "--doc", gpu_battery.is_page, kind="a battery page", make_folder=True)
    rows = gpu_battery.battery(
        tiny=args.tiny,
        steps=args.steps,
        large_batches=args.large_batches,
        out=args.out,
        doc=args.doc,
        budget_s=args.budget,
        resume=args.resume,
        sections=args.sections,
    )
    if args.doc:
        print(f"wrote {args.doc}")
    return 1 if any("error" in row for row in rows) else 0


def run_limit(args: argparse.Namespace) -> int:
    from clipdist.tools import limit

    if args.out:
        check_output(args.out, "--out", is_json)
    rows = limit.measure(args.data, args.ranks, args.batch, args.batches, args.steps, args.cache_dir, args.repeats)
    print(limit.markdown(rows))
    if args.out:
        write_atomic(Path(args.out), json.dumps(rows, indent=2) + "\n")
    return 0


COMMAND = Command(
    "bench",
    help="benchmarks: `clipdist bench loss`, `gpu`, `limit`",
    subcommands=(
        Command(
            "loss",
            help="memory and time of every loss backend (and open_clip's local loss) across batches and world sizes",
            description="Per-rank bytes kept for backward, peak memory and forward+backward time of each loss backend "
            "on random features, one launch of N local ranks per world size (gloo on CPU, NCCL on CUDA).",
            arguments=(
                arg(
                    "--backend",
                    type=csv(str),
                    default=None,
                    help="comma-separated backends (default: all, plus open_clip)",
                ),
                arg(
                    "--world",
                    dest="world_sizes",
                    type=csv(count),
                    help="world sizes (default 1,2,4)",
                ),
                arg(
                    "--batch",
                    dest="global_batches",
                    type=csv(count),
                    help="global batches (default 1024,4096,16384,65536)",
                ),
                arg("--dim", type=count, help="feature dim (default 128)"),
                arg("--repeats", type=count, help="default 3"),
                arg(
                    "--budget",
                    help="skip configurations predicted to need more, all ranks (default 16GB)",
                ),
                arg("--out", default="docs/bench", help="folder for the JSON and the PNG plot"),
                arg("--tag", type=file_stem, default="cpu", help="file name suffix: loss_<tag>.json"),
                arg(
                    "--scaling-world",
                    type=count_or_zero,
                    default=8,
                    help="the predicted table (Inf-CL's Table 1 shape) at this many ranks; 0: none",
                ),
                arg("--scaling-batch", type=csv(count), default=None, help="its global batches (default 32k … 1M)"),
                arg("--scaling-dim", type=count, default=768, help="its feature dim (ViT-L/14: 768)"),
            ),
            run=run_loss,
            given_only=True,
        ),
        Command(
            "gpu",
            help="the GPU battery: the run's own step for ViT-B/32, B/16, L/14 in bf16 / fp16, compiled or not, large "
            "batches with tiled and siglip, FSDP2, a background save, a real run (--tiny: on the CPU)",
            description="samples/s, MFU and peak memory of the run's own step on a synthetic batch on the device; one "
            "row per setting, a failing row says why and the rest go on (clipdist/tools/gpu_battery.py).",
            arguments=(
                arg("--tiny", action="store_true", help="clipdist-tiny on the CPU, small batches (what CI runs)"),
                arg("--steps", type=count, default=10, help="timed steps per row (after 2 warm-up steps)"),
                arg(
                    "--large-batches",
                    type=csv(count),
                    default=[16384, 32768, 65536],
                    help="global batches for disco, tiled and siglip on one device (default 16384,32768,65536)",
                ),
                arg("--out", default=None, help="write every row as JSON here (after each row)"),
                arg(
                    "--doc",
                    default=None,
                    help="write the table as Markdown here, after each row (docs/bench/gpu_battery.md)",
                ),
                arg(
                    "--budget",
                    type=non_negative,
                    default=None,
                    help="seconds the battery may take: rows run most valuable first, a row whose estimate does not "
                    "fit is "
                    "skipped and says so (default 420 on a GPU, none on the CPU)",
                ),
                arg(
                    "--resume",
                    default=None,
                    metavar="JSON",
                    help="an earlier run's --out: keep its measured rows on this device and run only the rest (a "
                    "second device "
                    "call finishes what the first did not reach)",
                ),
                arg(
                    "--sections",
                    type=one_of(BATTERY_SECTIONS),
                    default=None,
                    help=f"only the rows of these sections, comma-separated ({', '.join(BATTERY_SECTIONS)}; default "
                    "all)",
                ),
                arg(
                    "--estimate-for",
                    type=positive,
                    default=None,
                    metavar="TFLOPS",
                    help="print the default plan's rows with their time estimates for a device of this dense peak "
                    "(989: H100 "
                    "SXM bf16), run nothing",
                ),
            ),
            run=run_gpu,
        ),
        Command(
            "limit",
            help="a run as a fraction of this machine's limit: loader and step CPU cost per sample, the pipelined "
            "bound",
            description="One core's CPU seconds per sample for the loader (read, decode, augment, tokenize, collate) "
            "and "
            "the step (forward, loss, backward, optimizer), the bound C / (loader + step) for this machine's C cores, "
            "and "
            "real runs at 1 and 2 ranks as a fraction of it (clipdist/tools/limit.py).",
            arguments=(
                arg("--data", nargs="+", default=["digits", "web_photos"], choices=["digits", "web_photos"]),
                arg("--ranks", type=csv(count), default=[1, 2], help="world sizes of the real runs (default 1,2)"),
                arg("--batch", type=count, default=128, help="global batch (default 128)"),
                arg("--batches", type=count, default=12, help="batches timed for the loader's cost (default 12)"),
                arg("--steps", type=count, default=60, help="steps of each real run (default 60)"),
                arg(
                    "--repeats",
                    type=count,
                    default=3,
                    help="rounds of every measurement, real runs interleaved; the medians are reported (default 3)",
                ),
                arg("--cache-dir", default="~/.cache/clipdist", help="where the built-in shards are written"),
                arg("--out", default=None, help="write the rows as JSON here"),
            ),
            run=run_limit,
        ),
    ),
)
