"""`clipdist plan`: per-device memory, communication and the largest batch of a run, before launching it
(clipdist.tools.plan)."""

from __future__ import annotations

import argparse
import json

from clipdist.cli.arguments import chunk_counts, count, count_or_zero, csv
from clipdist.cli.command import Command, arg


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from clipdist.tools import plan
    from clipdist.tools.memory import human_bytes

    model_name, checkpointing = plan.resolve_model(args.model)
    checkpointing = checkpointing or args.grad_checkpointing
    world_size, ranks_per_node = plan.resolve_world(args.world)
    if args.max_tokens is not None:  # a NaFlex token budget: the batch at the planned sequence length
        if args.global_batch is not None or args.seq_len is None:
            raise ValueError(
                "--max-tokens plans a NaFlex budget's batch at --seq-len (its longest length): give "
                "--seq-len, and not --global-batch"
            )
        args.global_batch = args.max_tokens // args.seq_len
    if args.global_batch is None:  # the preset's own (8gpu: 8 × 256), as `python train.py world=8gpu` trains
        args.global_batch = plan.preset_global_batch(args.world)
    device_bytes = plan.parse_bytes(args.memory, "--memory")
    host_bytes = plan.parse_bytes(args.host_memory, "--host-memory")
    host = plan.Host(args.ranks_per_node or ranks_per_node, args.loader_workers, host_bytes)
    plan.check_request(args.backend, args.chunks, world_size, args.global_batch, args.parallel)
    console = Console(stderr=args.json, width=max(Console().width, 100))  # the tables fit 100 columns
    measured = plan.measure(
        model_name,
        args.backend,
        args.precision,
        checkpointing,
        progress=lambda text: console.print(f"[dim]{text}[/dim]"),
        teacher=args.distill,
        seq_len=args.seq_len,
        recipe=args.recipe,
    )
    measured.ema = measured.ema or args.ema
    measured.reshard_after_forward = args.reshard_after_forward
    rows = plan.plan(
        measured, args.backend, args.chunks, world_size, args.global_batch, device_bytes, args.parallel, host
    )
    if args.json:
        print(json.dumps(_as_json(args, model_name, world_size, device_bytes, host, checkpointing, rows), indent=2))
        return 0
    console.print(
        f"{model_name}{' (grad checkpointing)' if checkpointing else ''}, world size {world_size}, global batch "
        f"{args.global_batch:,} ({rows[0].local_batch:,}/device), {args.precision}, device "
        f"{human_bytes(device_bytes)}, host {human_bytes(host.memory)}/node ({host.ranks_per_node} ranks × "
        f"{host.loader_workers} loader workers)"
    )
    console.print(*_tables(args, rows))
    inputs = "NaFlex float32 patches at --seq-len" if args.seq_len else "uint8 pixels"
    console.print(
        f"[dim]activations measured on CPU: {human_bytes(measured.activations.per_sample)}/sample + "
        f"{human_bytes(measured.activations.per_step)}/step; CUDA attention kernels may keep a little "
        f"less. Inputs: {human_bytes(measured.input_bytes)}/sample ({inputs} + int64 tokens). "
        "Allocator fragmentation and the CUDA context (~0.5–1 GB) are not included. With gradient caching, "
        "run with grad_cache.micro_batch=<per chunk> and data.pieces=<chunks> (the loader reads the batch "
        "in chunks into host memory).[/dim]"
    )
    return 0


def _as_json(args, model_name, world_size, device_bytes, host, checkpointing, rows) -> dict:
    from clipdist.tools import plan

    return {
        "model": model_name,
        "world_size": world_size,
        "device_bytes": device_bytes,
        "host": {"ranks_per_node": host.ranks_per_node, "loader_workers": host.loader_workers, "memory": host.memory},
        "precision": args.precision,
        "grad_checkpointing": checkpointing,
        "distill": args.distill,
        "reshard_after_forward": args.reshard_after_forward,
        "rows": plan.rows_as_dicts(rows),
    }


def _tables(args, rows) -> tuple:
    """The plan's two tables: memory per device, and the run (host memory, bytes sent, the largest batch)."""
    from clipdist.tools.memory import human_bytes

    teacher = ("teacher",) if args.distill else ()
    memory = _table("memory per device", ("backend", "chunks", "params\n+optim", "activ-\nations", "cached\nfeat."))
    for column in ("loss", "inputs", "comm\nbuf.", *teacher, "peak", "fits"):
        memory.add_column(column, justify="right", no_wrap=True)
    run = _table("the run", ("backend", "chunks", "host/\nnode", "sent/\nstep", "max global\nbatch", "limited by"))
    for row in rows:
        kept = ", kept" if row.parallel == "fsdp" and not args.reshard_after_forward else ""
        name = row.backend + (f" ({row.parallel}{kept})" if len(args.parallel) > 1 or row.parallel != "ddp" else "")
        chunks = f"{row.chunks:,}×{row.micro_batch:,}" if row.chunks > 1 else "1"
        largest = f"{row.max_global_batch:,}"
        if row.chunk_size:  # --chunks auto: say the size, and that the largest batch is in chunks of it too
            chunks = f"auto: {row.chunks:,}×{min(row.chunk_size, row.local_batch):,}"
            per_rank = row.max_global_batch // max(row.global_batch // row.local_batch, 1)
            largest += f" ({-(-per_rank // row.chunk_size):,}×{row.chunk_size:,})"
        sizes = (
            row.parameters_optimizer,
            row.activations,
            row.cached_features,
            row.loss_buffers,
            row.inputs,
            row.communication_buffers,
            *((row.teacher,) if teacher else ()),
            row.peak,
        )
        fits = "[green]yes[/green]" if row.fits else "[red]no[/red]"
        memory.add_row(name, chunks, *(human_bytes(x) for x in sizes), fits)
        run.add_row(
            name, chunks, human_bytes(row.host_per_node), human_bytes(row.sent_bytes_per_step), largest, row.limit
        )
    return memory, run


def _table(title: str, columns: tuple[str, ...]):
    """A plan table (two-line headers: it fits 100 columns), its first columns named; left-aligned names."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    for column in columns:
        table.add_column(column, justify="left" if column in ("backend", "limited by") else "right", no_wrap=True)
    return table


COMMAND = Command(
    "plan",
    help="per-device memory, communication and largest batch of a run, before launching it",
    description="Measure the towers and loss backends small on CPU, scale to the requested run, and print the "
    "per-device memory breakdown, bytes sent per step and the largest global batch that fits.",
    arguments=(
        arg("--model", default="vit_b32", help="conf/model preset (vit_b32) or open_clip name (ViT-B-32)"),
        arg("--world", default="64gpu", help="conf/world preset (8gpu, 64gpu) or a number of ranks"),
        arg(
            "--global-batch",
            type=count,
            default=None,
            help="default: the world preset's (batch_per_device × ranks), 32768 for a number of ranks",
        ),
        arg("--backend", type=csv(str), default=["disco", "tiled"], help="comma-separated: disco,tiled"),
        arg(
            "--chunks",
            type=chunk_counts,
            default=[1],
            help="gradient-caching chunks, comma-separated: 1,8; auto: the chunk size that reaches the "
            "largest batch (within 5%%) in the fewest chunks",
        ),
        arg("--memory", default="40GB", help="device memory (40GB, 80GiB) or a device (a100-40gb, h100-80gb)"),
        arg(
            "--parallel",
            type=csv(str),
            default=["ddp"],
            help="ddp, fsdp, or both to compare: ddp,fsdp (FSDP shards weights, gradients, AdamW state)",
        ),
        arg(
            "--no-reshard-after-forward",
            dest="reshard_after_forward",
            action="store_false",
            help="FSDP with world.reshard_after_forward=false: every block's gathered weights kept from forward "
            "to backward (one all-gather a step fewer)",
        ),
        arg(
            "--host-memory",
            default="2TB",
            help="host memory per node, for the batch's inputs (default 2TB: a DGX H100 node)",
        ),
        arg(
            "--loader-workers",
            type=count_or_zero,
            default=8,
            help="loader workers per rank (each reads 2 loader batches ahead)",
        ),
        arg(
            "--ranks-per-node",
            type=count,
            default=None,
            help="default: the world preset's procs_per_node (8 at most for a number of ranks)",
        ),
        arg(
            "--seq-len",
            type=count,
            default=None,
            help="a NaFlex tower: plan its images at this many "
            "patches (the longest of data.seq_lens; default its image_size grid)",
        ),
        arg(
            "--max-tokens",
            type=count,
            default=None,
            help="a NaFlex run's data.max_tokens_per_batch: the global batch is max_tokens // seq_len",
        ),
        arg("--precision", choices=["bf16", "fp32"], default="bf16"),
        arg("--grad-checkpointing", action="store_true"),
        arg(
            "--distill",
            metavar="TEACHER",
            help="count a distillation teacher (loss.distill.model): "
            "an open_clip name, hf-hub:, local-dir:, an export or a run",
        ),
        arg(
            "--ema", action="store_true", help="count optim.ema's weight average (an fp32 copy of the weights per rank)"
        ),
        arg(
            "--recipe",
            help="count a conf/recipe entry (siglip2): its terms' heads and decoder, their forwards' activations "
            "(local views, the masked image, the decoder's logits) and its weight average",
        ),
        arg("--json", action="store_true", help="print a JSON object instead of the table"),
    ),
    run=run,
)
