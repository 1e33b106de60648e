"""`clipdist report`: a run at a glance, report.png and report.txt (clipdist.tools.report)."""

from __future__ import annotations

import argparse

from clipdist.cli.command import Command, arg


def run(args: argparse.Namespace) -> int:
    from clipdist.tools.report import write_report

    picture, text = write_report(args.run_dir)
    print(f"{text}wrote {picture} and {picture.with_name('report.txt').name}", end="\n")
    return 0


COMMAND = Command(
    "report",
    help="a run at a glance: report.png (loss, lr, samples/s, evaluations) and report.txt in its directory",
    description="Read a run directory's own logs (train_log.jsonl, metrics.jsonl, train.log) — a finished, stopped "
    "or running run — and write report.png and report.txt into it; print the summary.",
    arguments=(arg("run_dir", metavar="RUN", help="the run directory (runs/<name>)"),),
    run=run,
)
