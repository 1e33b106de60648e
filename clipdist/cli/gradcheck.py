"""`clipdist gradcheck`: prove a distributed loss exact against one process on the global batch
(clipdist.tools.gradcheck)."""

from __future__ import annotations

import argparse
import json

import yaml

from clipdist.cli.arguments import batch_sizes, count, count_or_zero, positive, seed
from clipdist.cli.command import Command, arg, given
from clipdist.errors import words
from clipdist.hydra_policy import load_yaml
from clipdist.registry.losses import BACKENDS
from clipdist.registry.terms import TERMS


def option(text: str) -> tuple[str, object]:
    """--option KEY=VALUE: the value read as YAML reads it (3, 0.5, true, [0.1, 0.4], text)."""
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: give KEY=VALUE (tile=3, self_distill.crops=3)")
    try:
        return key.removeprefix("loss."), load_yaml(value)
    except yaml.YAMLError as error:
        raise argparse.ArgumentTypeError(f"{text[:60]!r}: {words(error, 200)}") from None


def run(args: argparse.Namespace) -> int:
    from clipdist.tools.gradcheck import run_gradcheck

    options = given(args, "json", "verbose", "loss", "backend")
    options["options"] = dict(options.get("options", []))
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
    cached += ", gathered weights kept to backward" if not report.reshard_after_forward else ""
    cached += f", gradient scaler ×{SCALE:g}" if report.scaler else ""
    cached += ", distilled from a teacher" if report.distill else ""
    cached += "".join(f", with loss.{name}" for name in report.terms)
    cached += "".join(f", {key}={value}" for key, value in report.options.items())
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


COMMAND = Command(
    "gradcheck",
    help="prove a distributed loss exact against one process on the global batch",
    description="Spawn N local gloo ranks, run one DDP (or FSDP) step of a tiny two-tower model with the loss, and "
    "compare the loss and every parameter's gradient with one process on the whole batch.",
    arguments=(
        arg("--backend", help=f"a registered backend ({', '.join(BACKENDS)}; default disco)"),
        arg("--loss", default=None, help="your own loss instead: 'package.module:name', same call signature"),
        arg("--world", dest="world_size", type=count, help="number of local ranks (default 2)"),
        arg(
            "--batch",
            dest="local_batch",
            type=batch_sizes,
            help="local batch per rank, or one per rank: 4,3,5 (default 4)",
        ),
        arg("--chunks", type=count, help="gradient caching: split each rank's batch into K chunks"),
        arg(
            "--parallel",
            choices=["ddp", "fsdp"],
            help="how the model is distributed: DDP (default), or FSDP2 (fully_shard per block)",
        ),
        arg(
            "--no-reshard-after-forward",
            dest="reshard_after_forward",
            action="store_false",
            help="with --parallel fsdp: world.reshard_after_forward=false (each block's gathered weights kept from "
            "forward to backward)",
        ),
        arg(
            "--lock-image",
            type=count_or_zero,
            nargs="?",
            const=0,
            metavar="UNLOCKED_GROUPS",
            help="lock the image tower (open_clip's lock_image_tower), its last N groups left trainable",
        ),
        arg(
            "--lock-text",
            type=count_or_zero,
            nargs="?",
            const=0,
            metavar="UNLOCKED_LAYERS",
            help="lock the text tower (open_clip's lock_text_tower), its last N layers left trainable",
        ),
        arg(
            "--scaler",
            action="store_true",
            help="scale the loss and unscale the gradients as precision=fp16 does (ShardedGradScaler)",
        ),
        arg(
            "--distill",
            action="store_true",
            help="add loss.distill's term against a teacher (the same model, other weights), checked "
            "against open_clip's DistillClipLoss on the whole batch",
        ),
        arg(
            "--term",
            dest="terms",
            action="append",
            choices=list(TERMS),
            help="add a registered loss term (repeat for more), on with small options (its registry entry's probe): "
            "any "
            "module of its own on the model, the EMA teacher another model's weights, checked against the term's own "
            "definition (distill: --distill)",
        ),
        arg(
            "--option",
            dest="options",
            action="append",
            type=option,
            metavar="KEY=VALUE",
            help="an option of the backend (tile=3) or of a --term (self_distill.crops=3), as its config key after "
            "loss.; repeat for more",
        ),
        arg("--dtype", choices=["float64", "float32"], help="default float64"),
        arg("--model", help="open_clip model config (random init; default the tiny model)"),
        arg("--seed", type=seed),
        arg("--timeout", dest="timeout_s", type=positive, help="seconds before a stuck collective fails"),
        arg("--json", action="store_true", default=False, help="print a JSON object instead of the table"),
        arg("--verbose", action="store_true", default=False, help="list every parameter"),
    ),
    run=run,
    given_only=True,
)
