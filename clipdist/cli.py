"""`clipdist` command line: train, torchrun, gradcheck, plan, bench (loss, gpu, limit), make-shards, export, eval,
trust, report."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path

from clipdist.compat import floor_problem
from clipdist.defaults import TABLE_CAPTION_KEY, TABLE_IMAGE_KEY, TABLE_SEPARATOR
from clipdist.distributed import host
from clipdist.errors import printable
from clipdist.files import discard_stdout, read_bounded, write_atomic
from clipdist.objective.specs import TERMS


def _csv(cast):
    return lambda text: [cast(part) for part in text.split(",")]


def _chunk_counts(text: str) -> list[int]:
    """--chunks: counts, or 'auto' (plan.AUTO, 0)."""
    return [0 if part.strip() == "auto" else int(part) for part in text.split(",")]


def _batch_sizes(text: str) -> int | list[int]:
    sizes = _csv(int)(text)
    return sizes[0] if len(sizes) == 1 else sizes


def _given(args: argparse.Namespace, *names: str) -> dict:
    """The options the user gave (argparse.SUPPRESS leaves the others out): the called function's own
    defaults apply to the rest, so no default is written twice."""
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def _gradcheck(args: argparse.Namespace) -> int:
    from clipdist.tools.gradcheck import run_gradcheck

    options = _given(
        args,
        "world_size",
        "local_batch",
        "dtype",
        "model",
        "seed",
        "timeout_s",
        "chunks",
        "parallel",
        "lock_image",
        "lock_text",
        "scaler",
        "distill",
        "terms",
    )
    if args.loss or hasattr(args, "backend"):
        options["loss"] = args.loss or args.backend
    report = run_gradcheck(**options)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        _print_report(report, verbose=args.verbose)
    return 0 if report.exact else 1


def _print_report(report, verbose: bool) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from clipdist.tools.gradcheck import SCALAR_PARAMETERS, SCALE

    console = Console()
    cached = f", grad cache ×{report.chunks}" if report.chunks > 1 else ""
    cached += "".join(f", {tower} tower locked ({n} unlocked)" for tower, n in report.locks.items())
    cached += f", gradient scaler ×{SCALE:g}" if report.scaler else ""
    cached += ", distilled from a teacher" if report.distill else ""
    cached += "".join(f", with loss.{name}" for name in report.terms)
    table = Table(
        title=f"gradcheck: {report.backend}, world size {report.world_size}, {report.parallel}, {report.dtype}{cached}"
    )
    table.add_column("parameter")
    table.add_column("rel. error", justify="right")
    table.add_column("verdict")
    table.add_row(
        "loss value", f"{report.loss_rel_err:.2e}", "exact" if report.loss_rel_err <= report.tolerance else "wrong"
    )
    failing = [c for c in report.parameters if c.verdict != "exact"]
    always = [c for c in report.parameters if c.name in SCALAR_PARAMETERS]
    shown = report.parameters if verbose else (failing[:40] + [c for c in always if c not in failing])
    for check in shown:
        style = "green" if check.verdict == "exact" else "red"
        table.add_row(check.name, f"{check.rel_err:.2e}", f"[{style}]{check.verdict}[/{style}]")
    rest = [c for c in report.parameters if c not in shown]
    if rest:
        worst = max(c.rel_err for c in rest)
        verdicts = ", ".join(sorted({c.verdict for c in rest}))
        table.add_row(f"{len(rest)} more parameters (--verbose lists them)", f"≤ {worst:.2e}", verdicts)
    console.print(table)
    for note in report.diagnosis:
        console.print(f"[yellow]•[/yellow] {escape(note)}")
    verdict = "[green]EXACT[/green]" if report.exact else "[red]NOT EXACT[/red]"
    console.print(
        f"{verdict}: {report.backend} on {report.world_size} ranks, max relative error "
        f"{report.max_rel_err:.2e} (tolerance {report.tolerance:.0e}), "
        f"{len(report.parameters) - len(failing)}/{len(report.parameters)} parameters exact"
        + (
            f" ({report.locked_parameters} locked: no gradient, as in the reference)"
            if report.locked_parameters
            else ""
        )
    )


def _make_shards(args: argparse.Namespace) -> int:
    from clipdist.data.shard_writer import make_shards, pairs_from_csv, pairs_from_folder

    pairs = (
        pairs_from_folder(args.images)
        if args.images
        else pairs_from_csv(args.csv, args.path_column, args.caption_column, args.separator)
    )
    unreadable = []

    def skip(message: str) -> None:
        unreadable.append(message)
        print(f"warning: skipped {message}", file=sys.stderr)

    written = make_shards(
        pairs, args.out, args.prefix, args.samples_per_shard, overwrite=args.overwrite, on_unreadable=skip
    )
    print(
        f"wrote {len(written)} shard(s) to {args.out}: "
        f"{args.out}/{args.prefix}-{{000000..{len(written) - 1:06d}}}.tar"
        + (f" ({len(unreadable)} unreadable image(s) left out)" if unreadable else "")
    )
    return 0


def _export(args: argparse.Namespace) -> int:
    from clipdist.tools.export import export

    said = export(
        args.source,
        args.out,
        format=args.format,
        overwrite=args.overwrite,
        pretrained=args.pretrained,
        model_name=args.model,
        ema=args.ema,
        parts=args.parts,
    )
    if args.format == "transformers":
        print(
            f"exported {said} to {args.out}: transformers.CLIPModel.from_pretrained('{args.out}'), "
            f"CLIPProcessor.from_pretrained('{args.out}'), or pipeline('zero-shot-image-classification', "
            f"model='{args.out}')"
        )
    elif (Path(args.out) / "image_tower").is_dir():  # a NaFlex tower (tools.export.IMAGE_TOWER)
        print(
            f"exported {said} to {args.out}: clipdist eval {args.out}, open_clip main's "
            f"create_model_and_transforms('local-dir:{args.out}') (open_clip 3.3 cannot read its timm_model_kwargs), "
            f"or the image tower alone: timm.create_model('local-dir:{args.out}/image_tower', pretrained=True)"
        )
    else:
        print(
            f"exported {said} to {args.out}: open_clip.create_model_and_transforms('local-dir:{args.out}'), "
            f"or clip_benchmark eval --model local-dir:{args.out} --pretrained ''"
        )
    return 0


def _eval(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from clipdist.tools.evaluation import run_eval, write_metrics

    metrics = run_eval(
        args.target,
        dict(args.sets or []),
        pretrained=args.pretrained,
        model_name=args.model,
        classnames=args.classnames or [],
        templates=args.templates or [],
        world_size=args.world,
        batch_size=args.batch,
        precision=args.precision,
        cache_dir=args.cache_dir,
        retrieval_ties=args.retrieval_ties,
        ema=args.ema,
        dense=args.dense,
    )
    if args.out:
        write_metrics(metrics, args.out)
    if args.json:
        print(json.dumps(metrics, indent=2))
        return 0
    table = Table(title=f"clipdist eval: {args.target}" + (f" ({args.world} ranks)" if args.world > 1 else ""))
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)
    if args.out:
        print(f"written to {args.out}")
    return 0


def _trust(args: argparse.Namespace) -> int:
    from clipdist.tools.trust import trust

    out = trust(args.source, args.out)
    print(
        f"converted {args.source} to {out}: tensors and plain values only, read without running anything "
        f"(model.checkpoint={out}, resume={out}, clipdist export {out})"
    )
    return 0


def _plan(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

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
    device_bytes = plan.parse_bytes(args.memory)
    host = plan.Host(args.ranks_per_node or ranks_per_node, args.loader_workers, plan.parse_bytes(args.host_memory))
    plan.check_request(args.backend, args.chunks, world_size, args.global_batch, args.parallel)
    console = Console(stderr=args.json, width=max(Console().width, 200))
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
    rows = plan.plan(
        measured, args.backend, args.chunks, world_size, args.global_batch, device_bytes, args.parallel, host
    )
    if args.json:
        print(
            json.dumps(
                {
                    "model": model_name,
                    "world_size": world_size,
                    "device_bytes": device_bytes,
                    "host": {
                        "ranks_per_node": host.ranks_per_node,
                        "loader_workers": host.loader_workers,
                        "memory": host.memory,
                    },
                    "precision": args.precision,
                    "grad_checkpointing": checkpointing,
                    "distill": args.distill,
                    "rows": plan.rows_as_dicts(rows),
                },
                indent=2,
            )
        )
        return 0
    table = Table(
        title=f"{model_name}{' (grad checkpointing)' if checkpointing else ''}, world size {world_size}, "
        f"global batch {args.global_batch:,} ({rows[0].local_batch:,}/device), {args.precision}, "
        f"device {human_bytes(device_bytes)}, host {human_bytes(host.memory)}/node "
        f"({host.ranks_per_node} ranks × {host.loader_workers} loader workers)"
    )
    teacher = ("teacher",) if args.distill else ()
    for column in (
        "backend",
        "chunks",
        "params+optim",
        "activations",
        "cached feat.",
        "loss",
        "inputs",
        "comm buf.",
        *teacher,
        "peak",
        "fits",
        "host/node",
        "sent/step",
        "max global batch",
        "limited by",
    ):
        table.add_column(column, justify="left" if column in ("backend", "limited by") else "right", no_wrap=True)
    for row in rows:
        name = row.backend + (f" ({row.parallel})" if len(args.parallel) > 1 or row.parallel != "ddp" else "")
        chunks = f"{row.chunks:,}×{row.micro_batch:,}" if row.chunks > 1 else "1"
        largest = f"{row.max_global_batch:,}"
        if row.chunk_size:  # --chunks auto: say the size, and that the largest batch is in chunks of it too
            chunks = f"auto: {row.chunks:,}×{min(row.chunk_size, row.local_batch):,}"
            per_rank = row.max_global_batch // max(row.global_batch // row.local_batch, 1)
            largest += f" ({-(-per_rank // row.chunk_size):,}×{row.chunk_size:,})"
        fits = "[green]yes[/green]" if row.fits else "[red]no[/red]"
        table.add_row(
            name,
            chunks,
            *(
                human_bytes(x)
                for x in (
                    row.parameters_optimizer,
                    row.activations,
                    row.cached_features,
                    row.loss_buffers,
                    row.inputs,
                    row.communication_buffers,
                    *((row.teacher,) if teacher else ()),
                    row.peak,
                )
            ),
            fits,
            human_bytes(row.host_per_node),
            human_bytes(row.sent_bytes_per_step),
            largest,
            row.limit,
        )
    console.print(table)
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


def _bench_limit(args: argparse.Namespace) -> int:
    from clipdist.tools import limit

    rows = limit.measure(args.data, args.ranks, args.batch, args.batches, args.steps, args.cache_dir, args.repeats)
    print(limit.markdown(rows))
    if args.out:
        write_atomic(Path(args.out), json.dumps(rows, indent=2) + "\n")
    return 0


def _bench_gpu(args: argparse.Namespace) -> int:
    from clipdist.tools import gpu_battery

    if args.estimate_for is not None:
        print(gpu_battery.estimate_table(args.estimate_for, args.steps, args.large_batches))
        return 0
    print(gpu_battery.HEADER)
    rows = gpu_battery.battery(
        tiny=args.tiny,
        steps=args.steps,
        large_batches=args.large_batches,
        out=args.out,
        doc=args.doc,
        budget_s=args.budget,
    )
    if args.doc:
        print(f"wrote {args.doc}")
    return 1 if any("error" in row for row in rows) else 0


def _bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from clipdist.tools import bench
    from clipdist.tools.plan import parse_bytes

    names = bench.backends(args.backend)
    fits = bench.loss_fits(names)
    options = _given(args, "world_sizes", "global_batches", "dim", "repeats")
    if hasattr(args, "budget"):
        options["budget_bytes"] = parse_bytes(args.budget)
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


def _created_by_hydra(run_dir: str) -> bool:
    """Whether the run directory holds nothing yet (Hydra made it as it started; the run log opens at its first
    line)."""
    return not os.path.isdir(run_dir) or not any(os.scandir(run_dir))


def _run_composed(cfg) -> None:
    """Hydra's task: the composed config → clipdist.train.trainer.run in Hydra's output directory, which is
    the run directory; a ClipdistError is one `error:` line (HYDRA_FULL_ERROR=1 for the traceback), any
    other failure its traceback, both on stderr and, once the run has started, at the end of train.log."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    from clipdist import console
    from clipdist.distributed.launch import detect_env
    from clipdist.errors import ClipdistError, ConfigError

    hydra = HydraConfig.get()
    run_dir = hydra.runtime.output_dir  # resolved once by Hydra: ${now:...} can not differ from it
    created = _created_by_hydra(run_dir)
    console.configure(main=detect_env().is_main)
    with open_dict(cfg):
        if OmegaConf.is_interpolation(cfg, "name"):
            multirun = hydra.mode is not None and hydra.mode.name == "MULTIRUN"
            cfg.name = (
                f"{os.path.basename(os.path.dirname(run_dir))}-{hydra.job.num}"
                if multirun
                else os.path.basename(run_dir)
            )
        cfg.run_dir = run_dir
    try:
        complete = _quick_checks(cfg)  # the schema, the world against the launch: before the towers' libraries load
        if complete:
            logging.getLogger("clipdist").info("%s", complete)
            return
        from clipdist.train.trainer import run

        run(cfg, overrides=OmegaConf.to_container(hydra.overrides.task, resolve=False))  # as typed: ${...} kept
        if cfg.logging.report:
            _write_report(run_dir)
    except ClipdistError as error:
        if created and _created_by_hydra(run_dir):  # refused before the run began: leave nothing behind
            shutil.rmtree(run_dir, ignore_errors=True)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if not isinstance(error, ConfigError) or detect_env().is_main:  # a config refusal: every rank's is the same
            logging.getLogger("clipdist").error("%s", error)
        sys.exit(2 if isinstance(error, ValueError) else 1)
    except Exception as error:  # noqa: BLE001 -- logged where the run's reader looks, then raised as ever
        logging.getLogger("clipdist").exception("%s: %s", type(error).__name__, error)
        raise SystemExit(1) from None


def _quick_checks(cfg) -> str | None:
    """What can be said with torch alone loaded (a few seconds, not the ~10 s open_clip, timm and transformers take
    and the minute a run's start takes): the schema's values, the world preset against the launch, a checkpoint
    that cannot be read, and a run that is already complete (returned: the line to say; nothing else runs).
    preflight repeats the checks with the rest."""
    from clipdist.checkpoint.manager import Checkpointer
    from clipdist.checkpoint.run_dir import check_run_dir
    from clipdist.config import to_train_config, validate
    from clipdist.distributed.launch import check_launch, detect_env

    checked = to_train_config(cfg)
    validate(checked)
    check_launch(checked.world, detect_env())
    check_run_dir(checked.run_dir)  # a record that is a link or a FIFO: said before anything in it is read
    found = Checkpointer.resume_point(checked)
    step = found[1].get("step") if found else None
    if isinstance(step, int) and step >= checked.optim.max_steps:
        return (
            f"run {checked.run_dir} is already complete at step {step} (optim.max_steps={checked.optim.max_steps}); "
            "raise optim.max_steps to train on, or set name= for a new run"
        )
    return None


def _write_report(run_dir: str) -> None:
    """report.png / report.txt at the end of a run or a stop, from the main rank; a failure is a warning only."""
    from clipdist.distributed.launch import detect_env
    from clipdist.tools.report import write_report

    if not detect_env().is_main or not os.path.isfile(os.path.join(run_dir, "train_log.jsonl")):
        return
    try:
        picture, _ = write_report(run_dir)
    except Exception as error:  # noqa: BLE001 -- the run is done either way
        logging.getLogger("clipdist").warning(
            "the run's report could not be written (%s: %s)", type(error).__name__, error
        )
    else:
        logging.getLogger("clipdist").info("report: %s", picture)


ENVIRONMENT_RESOLVERS = ("${oc.env:", "${env:", "${oc.decode:")  # read the environment, or parse text as YAML
TARGET_PREFIXES = ("clipdist.", "hydra_plugins.hydra_submitit_launcher.")  # the only _target_s a config may name


def closed_door(arguments: list[str]) -> str | None:
    """One line for a Hydra door that would run or leak something, before Hydra opens it; None if all closed:
    `--experimental-rerun` (unpickles its file), a `--config-dir` / `--config-path` folder whose YAML names callbacks
    or a `_target_` outside clipdist's own (Hydra would instantiate it), an override that reads the environment
    (`${oc.env:...}`: a secret resolved into errors, logs and the saved config) or sets a `_target_` / callback."""
    for index, argument in enumerate(arguments):
        flag, _, attached = argument.partition("=")
        if flag == "--experimental-rerun":
            return (
                "--experimental-rerun unpickles its file (a pickle can run code): refused. Re-run a run with the "
                "overrides it saved in <run_dir>/hydra/overrides.yaml (python train.py name=<its name> resumes it)"
            )
        if flag in ("--config-dir", "-cd", "--config-path", "-cp"):
            folder = attached or (arguments[index + 1] if index + 1 < len(arguments) else "")
            problem = _config_folder_runs_code(Path(folder))
            if problem:
                return f"{flag} {printable(folder)}: {problem}; clipdist reads config folders as data only"
        if flag.startswith("-") or "=" not in argument:
            continue
        key, value = argument.split("=", 1)
        if any(resolver in value for resolver in ENVIRONMENT_RESOLVERS):
            return (
                f"{printable(key.lstrip('+~'))}: an override may not read the environment (${{oc.env:...}}): its value "
                "would be resolved into errors, logs and the saved config; write the value itself"
            )
        if "_target_" in key or "callbacks" in key.split("."):
            return f"{printable(key.lstrip('+~'))}: an override may not name code to run (_target_, callbacks)"
    return None


def _config_folder_runs_code(folder: Path) -> str | None:
    """Why a user's config folder would run code (a Hydra callback, a `_target_` outside clipdist's own), or None."""
    if not folder.is_dir():
        return None  # Hydra says it is missing
    for path in sorted(folder.rglob("*.y*ml"))[:10_000]:
        try:
            text = read_bounded(path, 1 << 20).decode("utf-8", "replace")
        except (OSError, ValueError) as error:
            return f"{path.name} cannot be read ({error})"
        if re.search(r"(?m)^\s*callbacks\s*:", text):
            return f"{path.relative_to(folder)} names Hydra callbacks (code Hydra runs at the start of a job)"
        for target in re.findall(r"_target_\s*:\s*['\"]?([^\s'\"#]+)", text):
            if not target.startswith(TARGET_PREFIXES):
                return f"{path.relative_to(folder)} names _target_ {printable(target)[:80]} (code Hydra would build)"
    return None


def train_help() -> str:
    """`python train.py --help`: the config groups and their options, then every key with its default and what it
    is (from the schema's own comments: clipdist.config.describe_keys)."""
    from clipdist.config import CONF, describe_keys

    chosen = dict(
        re.findall(r"(?m)^\s*-\s*(\w+):\s*(\w+)\s*$", read_bounded(CONF / "config.yaml", 1 << 20).decode())
    )  # the defaults list: group -> option
    groups = []
    for folder in sorted(
        path for path in CONF.iterdir() if path.is_dir() and path.name not in ("hydra", "__pycache__")
    ):
        options = sorted(path.stem for path in folder.glob("*.yaml"))
        shown = [f"{name} (default)" if name == chosen.get(folder.name) else name for name in options]
        groups.append(f"  {folder.name}=: {', '.join(shown)}")
    return "\n".join(
        [
            "python train.py [group=option ...] [key=value ...]    e.g. python train.py loss=disco world=cpu2",
            "",
            "Config groups (clipdist/conf/<group>/<option>.yaml):",
            *groups,
            "",
            "Keys (key = default  — what it is); a misspelt key is refused with the nearest ones:",
            *describe_keys(),
            "",
            "The composed config: python train.py --cfg job [overrides]; Hydra's help: python train.py --hydra-help.",
        ]
    )


def unwritable_run_dir(arguments: list[str]) -> str | None:
    """One line where the run directory the overrides name (runs/<name> under the working directory by default)
    cannot be made or written — a read-only file system, no permission — else None. Checked on the nearest folder
    that exists; a value with an interpolation is checked up to it."""
    given = [a.split("=", 1)[1] for a in arguments if a.lstrip("+").startswith("run_dir=")]
    value = given[-1].strip("'\"") if given else "runs/x"
    literal = value.split("${", 1)[0]
    folder = Path(literal if literal.endswith("/") or not literal else os.path.dirname(literal) or ".")
    if given and "${" not in value:
        folder = Path(value)
    folder = folder.expanduser().absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if folder.is_dir() and os.access(folder, os.W_OK | os.X_OK):
        return None
    what = "is not a folder" if not folder.is_dir() else "cannot be written (a read-only file system or no permission)"
    return (
        f"run_dir={value}: {folder} {what}; choose a run directory on a writable file system "
        "(run_dir=/path/to/runs/<name>)"
    )


def train_main(overrides: list[str] | None = None) -> None:
    """`python train.py [overrides]`, `clipdist train [overrides]`: Hydra composes clipdist/conf and trains."""
    host.spin_briefly()  # before torch loads libgomp
    problem = floor_problem()
    if problem:
        sys.exit(f"clipdist: error: {problem}")
    import hydra

    from clipdist.config import register

    register()
    if overrides is not None:
        sys.argv = [f"{os.path.basename(sys.argv[0])} train", *overrides]
    from clipdist.config import unknown_override

    if (
        "--help" in sys.argv[1:] or "-h" in sys.argv[1:]
    ):  # every key with its default and meaning; Hydra's own: --hydra-help
        try:
            print(train_help())
        except BrokenPipeError:  # `| head`
            discard_stdout()
        return
    problem = closed_door(sys.argv[1:]) or unknown_override(sys.argv[1:]) or unwritable_run_dir(sys.argv[1:])
    if problem:  # before Hydra makes the directory (its traceback otherwise)
        print(f"error: {printable(problem)}", file=sys.stderr)
        sys.exit(2)
    hydra.main(version_base=None, config_path="conf", config_name="config")(_run_composed)()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clipdist", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "train",
        add_help=False,
        help="train: Hydra overrides follow (clipdist train loss=disco world=cpu2; --help lists groups)",
    )
    commands.add_parser(
        "torchrun",
        add_help=False,
        help="torchrun's launch (its options, then train.py and overrides), a failed rank ending it in one line",
    )
    for add in (
        _add_gradcheck,
        _add_plan,
        _add_bench,
        _add_make_shards,
        _add_export,
        _add_eval,
        _add_trust,
        _add_report,
    ):
        add(commands)
    return parser


def _add_gradcheck(commands) -> None:
    check = commands.add_parser(
        "gradcheck",
        help="prove a distributed loss exact against one process on the global batch",
        description="Spawn N local gloo ranks, run one DDP (or FSDP) step of a tiny two-tower model with the loss, and "
        "compare the loss and every parameter's gradient with one process on the whole batch.",
    )
    # Defaults: run_gradcheck's (argparse.SUPPRESS: an option not given is not passed).
    check.argument_default = argparse.SUPPRESS
    check.add_argument(
        "--backend", help="registered backend (naive, gather_layer, disco, tiled, siglip; default disco)"
    )
    check.add_argument("--loss", default=None, help="your own loss instead: 'package.module:name', same call signature")
    check.add_argument("--world", dest="world_size", type=int, help="number of local ranks (default 2)")
    check.add_argument(
        "--batch",
        dest="local_batch",
        type=_batch_sizes,
        help="local batch per rank, or one per rank: 4,3,5 (default 4)",
    )
    check.add_argument("--chunks", type=int, help="gradient caching: split each rank's batch into K chunks")
    check.add_argument(
        "--parallel",
        choices=["ddp", "fsdp"],
        help="how the model is distributed: DDP (default), or FSDP2 (fully_shard per block)",
    )
    check.add_argument(
        "--lock-image",
        type=int,
        nargs="?",
        const=0,
        metavar="UNLOCKED_GROUPS",
        help="lock the image tower (open_clip's lock_image_tower), its last N groups left trainable",
    )
    check.add_argument(
        "--lock-text",
        type=int,
        nargs="?",
        const=0,
        metavar="UNLOCKED_LAYERS",
        help="lock the text tower (open_clip's lock_text_tower), its last N layers left trainable",
    )
    check.add_argument(
        "--scaler",
        action="store_true",
        help="scale the loss and unscale the gradients as precision=fp16 does (ShardedGradScaler)",
    )
    check.add_argument(
        "--distill",
        action="store_true",
        help="add loss.distill's term against a teacher (the same model, other weights), checked "
        "against open_clip's DistillClipLoss on the whole batch",
    )
    check.add_argument(
        "--term",
        dest="terms",
        action="append",
        choices=[name for name, spec in TERMS.items() if spec.part],
        help="add a term that trains a module of its own (loss.self_distill, loss.masked, loss.decoder; repeat for "
        "more): the module on the model, the EMA teacher another model's weights, checked against the term's own "
        "definition",
    )
    check.add_argument("--dtype", choices=["float64", "float32"], help="default float64")
    check.add_argument("--model", help="open_clip model config (random init; default the tiny model)")
    check.add_argument("--seed", type=int)
    check.add_argument("--timeout", dest="timeout_s", type=float, help="seconds before a stuck collective fails")
    check.add_argument("--json", action="store_true", default=False, help="print a JSON object instead of the table")
    check.add_argument("--verbose", action="store_true", default=False, help="list every parameter")
    check.set_defaults(run=_gradcheck)


def _add_plan(commands) -> None:
    planner = commands.add_parser(
        "plan",
        help="per-device memory, communication and largest batch of a run, before launching it",
        description="Measure the towers and loss backends small on CPU, scale to the requested run, and print the "
        "per-device memory breakdown, bytes sent per step and the largest global batch that fits.",
    )
    planner.add_argument("--model", default="vit_b32", help="conf/model preset (vit_b32) or open_clip name (ViT-B-32)")
    planner.add_argument("--world", default="64gpu", help="conf/world preset (8gpu, 64gpu) or a number of ranks")
    planner.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="default: the world preset's (batch_per_device × ranks), 32768 for a number of ranks",
    )
    planner.add_argument("--backend", type=_csv(str), default=["disco", "tiled"], help="comma-separated: disco,tiled")
    planner.add_argument(
        "--chunks",
        type=_chunk_counts,
        default=[1],
        help="gradient-caching chunks, comma-separated: 1,8; auto: the chunk size that reaches the "
        "largest batch (within 5%%) in the fewest chunks",
    )
    planner.add_argument(
        "--memory", default="40GB", help="device memory (40GB, 80GiB) or a device (a100-40gb, h100-80gb)"
    )
    planner.add_argument(
        "--parallel",
        type=_csv(str),
        default=["ddp"],
        help="ddp, fsdp, or both to compare: ddp,fsdp (FSDP shards weights, gradients, AdamW state)",
    )
    planner.add_argument(
        "--host-memory",
        default="2TB",
        help="host memory per node, for the batch's inputs (default 2TB: a DGX H100 node)",
    )
    planner.add_argument(
        "--loader-workers", type=int, default=8, help="loader workers per rank (each reads 2 loader batches ahead)"
    )
    planner.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="default: the world preset's procs_per_node (8 at most for a number of ranks)",
    )
    planner.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="a NaFlex tower: plan its images at this many "
        "patches (the longest of data.seq_lens; default its image_size grid)",
    )
    planner.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="a NaFlex run's data.max_tokens_per_batch: the global batch is max_tokens // seq_len",
    )
    planner.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    planner.add_argument("--grad-checkpointing", action="store_true")
    planner.add_argument(
        "--distill",
        metavar="TEACHER",
        help="count a distillation teacher (loss.distill.model): "
        "an open_clip name, hf-hub:, local-dir:, an export or a run",
    )
    planner.add_argument(
        "--ema", action="store_true", help="count optim.ema's weight average (an fp32 copy of the weights per rank)"
    )
    planner.add_argument(
        "--recipe",
        help="count a conf/recipe entry (siglip2): its terms' heads and decoder, their forwards' activations "
        "(local views, the masked image, the decoder's logits) and its weight average",
    )
    planner.add_argument("--json", action="store_true", help="print a JSON object instead of the table")
    planner.set_defaults(run=_plan)


def _add_bench(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks: `clipdist bench loss`, `gpu`, `limit`")
    bench_kinds = bench.add_subparsers(dest="kind", required=True)
    loss_bench = bench_kinds.add_parser(
        "loss",
        help="memory and time of every loss backend (and open_clip's local loss) across batches and world sizes",
        description="Per-rank bytes kept for backward, peak memory and forward+backward time of each loss backend "
        "on random features, one launch of N local ranks per world size (gloo on CPU, NCCL on CUDA).",
    )
    loss_bench.add_argument(
        "--backend", type=_csv(str), default=None, help="comma-separated backends (default: all, plus open_clip)"
    )
    # Defaults: bench.run's (argparse.SUPPRESS: an option not given is not passed).
    loss_bench.add_argument(
        "--world", dest="world_sizes", type=_csv(int), default=argparse.SUPPRESS, help="world sizes (default 1,2,4)"
    )
    loss_bench.add_argument(
        "--batch",
        dest="global_batches",
        type=_csv(int),
        default=argparse.SUPPRESS,
        help="global batches (default 1024,4096,16384,65536)",
    )
    loss_bench.add_argument("--dim", type=int, default=argparse.SUPPRESS, help="feature dim (default 128)")
    loss_bench.add_argument("--repeats", type=int, default=argparse.SUPPRESS, help="default 3")
    loss_bench.add_argument(
        "--budget",
        default=argparse.SUPPRESS,
        help="skip configurations predicted to need more, all ranks (default 16GB)",
    )
    loss_bench.add_argument("--out", default="docs/bench", help="folder for the JSON and the PNG plot")
    loss_bench.add_argument("--tag", default="cpu", help="file name suffix: loss_<tag>.json")
    loss_bench.add_argument(
        "--scaling-world",
        type=int,
        default=8,
        help="the predicted table (Inf-CL's Table 1 shape) at this many ranks; 0: none",
    )
    loss_bench.add_argument(
        "--scaling-batch", type=_csv(int), default=None, help="its global batches (default 32k … 1M)"
    )
    loss_bench.add_argument("--scaling-dim", type=int, default=768, help="its feature dim (ViT-L/14: 768)")
    loss_bench.set_defaults(run=_bench)
    gpu = bench_kinds.add_parser(
        "gpu",
        help="the GPU battery: the run's own step for ViT-B/32, B/16, L/14 in bf16 / fp16, compiled or not, large "
        "batches with tiled and siglip, FSDP2, a background save, a real run (--tiny: on the CPU)",
        description="samples/s, MFU and peak memory of the run's own step on a synthetic batch on the device; one "
        "row per setting, a failing row says why and the rest go on (clipdist/tools/gpu_battery.py).",
    )
    gpu.add_argument("--tiny", action="store_true", help="clipdist-tiny on the CPU, small batches (what CI runs)")
    gpu.add_argument("--steps", type=int, default=10, help="timed steps per row (after 2 warm-up steps)")
    gpu.add_argument(
        "--large-batches",
        type=_csv(int),
        default=[16384, 32768, 65536],
        help="global batches for disco, tiled and siglip on one device (default 16384,32768,65536)",
    )
    gpu.add_argument("--out", default=None, help="write every row as JSON here (after each row)")
    gpu.add_argument(
        "--doc", default=None, help="write the table as Markdown here, after each row (docs/bench/gpu_battery.md)"
    )
    gpu.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds the battery may take: rows run most valuable first, a row whose estimate does not fit is "
        "skipped and says so (default 420 on a GPU, none on the CPU)",
    )
    gpu.add_argument(
        "--estimate-for",
        type=float,
        default=None,
        metavar="TFLOPS",
        help="print the default plan's rows with their time estimates for a device of this dense peak (989: H100 "
        "SXM bf16), run nothing",
    )
    gpu.set_defaults(run=_bench_gpu)
    limit = bench_kinds.add_parser(
        "limit",
        help="a run as a fraction of this machine's limit: loader and step CPU cost per sample, the pipelined bound",
        description="One core's CPU seconds per sample for the loader (read, decode, augment, tokenize, collate) and "
        "the step (forward, loss, backward, optimizer), the bound C / (loader + step) for this machine's C cores, and "
        "real runs at 1 and 2 ranks as a fraction of it (clipdist/tools/limit.py).",
    )
    limit.add_argument("--data", nargs="+", default=["digits", "web_photos"], choices=["digits", "web_photos"])
    limit.add_argument("--ranks", type=_csv(int), default=[1, 2], help="world sizes of the real runs (default 1,2)")
    limit.add_argument("--batch", type=int, default=128, help="global batch (default 128)")
    limit.add_argument("--batches", type=int, default=12, help="batches timed for the loader's cost (default 12)")
    limit.add_argument("--steps", type=int, default=60, help="steps of each real run (default 60)")
    limit.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds of every measurement, real runs interleaved; the medians are reported (default 3)",
    )
    limit.add_argument("--cache-dir", default="~/.cache/clipdist", help="where the built-in shards are written")
    limit.add_argument("--out", default=None, help="write the rows as JSON here")
    limit.set_defaults(run=_bench_limit)


def _add_make_shards(commands) -> None:
    shards = commands.add_parser(
        "make-shards",
        help="write an image folder or a CSV of (path, caption) as WebDataset shards",
        description="Write image/caption pairs as WebDataset shards in the img2dataset layout "
        "(.jpg/.png + .txt + .json).",
    )
    source = shards.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--images", help="folder of images; caption from a same-name .txt, else the parent folder's name"
    )
    source.add_argument(
        "--csv", help="a table of image paths (relative to it) and captions; by default open_clip's TSV layout"
    )
    shards.add_argument(
        "--separator", default=TABLE_SEPARATOR, help="--csv's column separator: \\t / tab (default, open_clip's) or ,"
    )
    shards.add_argument("--path-column", default=TABLE_IMAGE_KEY, help="default: filepath (open_clip's)")
    shards.add_argument("--caption-column", default=TABLE_CAPTION_KEY, help="default: title (open_clip's)")
    shards.add_argument("--out", required=True, help="output folder")
    shards.add_argument("--prefix", default="shard")
    shards.add_argument("--samples-per-shard", type=int, default=1000)
    shards.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --out folder (as a whole, once the new shards are written)",
    )
    shards.set_defaults(run=_make_shards)


def _add_export(commands) -> None:
    exporter = commands.add_parser(
        "export",
        help="a trained model as open_clip or Hugging Face transformers loads it, for sharing and downstream use",
        description="Write a model as a folder: in open_clip's hub layout (open_clip_config.json + "
        "open_clip_model.safetensors, a run's checkpoint as it is; open_clip's 'local-dir:<out>', clip_benchmark) "
        "or, with --format transformers, as transformers' CLIPModel + CLIPProcessor (from_pretrained, pipelines).",
    )
    exporter.add_argument(
        "source",
        help="a run directory or a .pt / .dcp checkpoint; for --format transformers also "
        "an export folder or an open_clip model name (with --pretrained)",
    )
    exporter.add_argument("--out", required=True, help="output folder")
    exporter.add_argument(
        "--format",
        choices=["open_clip", "transformers"],
        default="open_clip",
        help="open_clip's hub layout (default) or transformers' CLIPModel",
    )
    exporter.add_argument("--pretrained", default=None, help="open_clip pretrained tag of a model name (transformers)")
    exporter.add_argument("--model", default=None, help="the model a bare weights file fits (transformers)")
    exporter.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    exporter.add_argument("--ema", action="store_true", help="a run's weight average (optim.ema) as the weights")
    exporter.add_argument(
        "--parts",
        action="store_true",
        help="also the modules only a loss term trains (loss.decoder's caption decoder, the teacher terms' heads), "
        "in training_parts.safetensors beside the model (open_clip's layout; left out by default)",
    )
    exporter.set_defaults(run=_export)


def _named_set(text: str) -> tuple[str, str]:
    name, separator, spec = text.partition("=")
    if not separator or not name or not spec:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=SPEC, e.g. --set val=/data/val")
    return name, spec


def _add_eval(commands) -> None:
    evaluator = commands.add_parser(
        "eval",
        help="evaluate a run, checkpoint, export or open_clip model on evaluation sets, without training",
        description="Zero-shot top-1/top-5, retrieval recall@k, mean/median rank and the CLIP validation loss of a "
        "model on one or more evaluation sets; on one process or split over N local ranks (the same metrics).",
    )
    evaluator.add_argument(
        "target",
        help="a run directory, a .dcp/.pt checkpoint, an export folder, or an open_clip "
        "model name (with --pretrained) or hf-hub:ORG/REPO",
    )
    evaluator.add_argument(
        "--set",
        dest="sets",
        action="append",
        type=_named_set,
        metavar="NAME=SPEC",
        help="an evaluation set: shards, a folder, a clip_benchmark dataset folder (repeatable)",
    )
    evaluator.add_argument(
        "--dense",
        action="store_true",
        help="also a linear probe on the image tower's patch tokens over generated scenes of shapes (a label per "
        "pixel): dense/miou and dense/patch_accuracy (docs/training.md)",
    )
    evaluator.add_argument("--pretrained", default=None, help="open_clip pretrained tag of a model name")
    evaluator.add_argument("--model", default=None, help="the model a bare weights file fits (ViT-B-32)")
    evaluator.add_argument(
        "--classnames",
        type=_csv(str),
        default=None,
        help="comma-separated class names, where no classnames.txt is beside the set",
    )
    evaluator.add_argument(
        "--templates",
        action="append",
        default=None,
        help="a zero-shot prompt with {} (repeatable; default 'a photo of {}.')",
    )
    evaluator.add_argument("--world", type=int, default=1, help="local gloo ranks to split the sets over")
    evaluator.add_argument("--batch", type=int, default=256, help="images per forward")
    evaluator.add_argument("--precision", choices=["fp32", "bf16", "fp16", "pure_bf16", "pure_fp16"], default="fp32")
    evaluator.add_argument("--cache-dir", default=None, help="where downloaded weights go (Hugging Face's cache)")
    evaluator.add_argument(
        "--retrieval-ties",
        choices=["pessimistic", "open_clip"],
        default="pessimistic",
        help="repeated captions: a tie counts against the image (default), or open_clip_train's argsort order",
    )
    evaluator.add_argument("--ema", action="store_true", help="a run's weight average (optim.ema) as the weights")
    evaluator.add_argument("--out", default=None, help="write the metrics to this JSON file")
    evaluator.add_argument("--json", action="store_true", help="print the metrics as JSON")
    evaluator.set_defaults(run=_eval)


def _add_trust(commands) -> None:
    trusting = commands.add_parser(
        "trust",
        help="convert a checkpoint or weights file you trust into a copy clipdist reads without running code",
        description="Read SOURCE the unsafe way -- any code it carries RUNS NOW, as you: only for files whose origin "
        "you trust -- and write a copy of its tensors and plain values, which clipdist then reads safely. "
        "See docs/checkpoints.md.",
    )
    trusting.add_argument("source", help="a .pt/.bin/.pth file or a .dcp checkpoint folder that clipdist refused")
    trusting.add_argument(
        "--out",
        default=None,
        help="where the copy goes (default: beside it, <stem>.trusted<suffix> / <name>.trusted.dcp)",
    )
    trusting.set_defaults(run=_trust)


def _add_report(commands) -> None:
    reporting = commands.add_parser(
        "report",
        help="a run at a glance: report.png (loss, lr, samples/s, evaluations) and report.txt in its directory",
        description="Read a run directory's own logs (train_log.jsonl, metrics.jsonl, train.log) — a finished, stopped "
        "or running run — and write report.png and report.txt into it; print the summary.",
    )
    reporting.add_argument("run_dir", metavar="RUN", help="the run directory (runs/<name>)")
    reporting.set_defaults(run=_report)


def _report(args: argparse.Namespace) -> int:
    from clipdist.tools.report import write_report

    picture, text = write_report(args.run_dir)
    print(f"{text}wrote {picture} and {picture.with_name('report.txt').name}", end="\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    host.spin_briefly()  # before torch loads libgomp
    argv = sys.argv[1:] if argv is None else argv
    problem = floor_problem()
    if problem:
        print(f"clipdist: error: {problem}", file=sys.stderr)
        return 2
    if argv[:1] == ["train"]:
        train_main(argv[1:])
        return 0
    if argv[:1] == ["torchrun"]:
        from clipdist.distributed import torchrun

        return torchrun.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as error:
        print(printable(f"clipdist {args.command}: error: {error}"), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
