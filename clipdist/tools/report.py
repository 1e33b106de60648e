"""`clipdist report RUN`: a finished, stopped or running run at a glance, from its own files alone (train_log.jsonl,
metrics.jsonl, train.log; no W&B, no TensorBoard): one picture, `report.png` — the loss and its terms, the lr,
samples/s and every evaluation metric against the step, each start of the run marked with its world size — and a
short text, `report.txt`: steps, samples, time, skips, the best and last of every metric. Written into the run
directory at the end of every run and at a stop, and by the command for any run.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import BinaryIO

from clipdist.checkpoint.run_dir import jsonl_rows, running_holder
from clipdist.errors import one_line
from clipdist.files import read_lines, write_atomic

PICTURE, SUMMARY = "report.png", "report.txt"
FRACTIONS = re.compile(r"(_r\d+|_top\d+)$")  # metrics in [0, 1]: recall@k, zero-shot top-k
LOWER_IS_BETTER = re.compile(r"(loss|_rank)$")
STAMP = re.compile(r"^\[([0-9-]+ [0-9:,]+)\] (.*)$")
RESUMED = re.compile(r"resumed from .* at step (\d+)$")
TERM_START = re.compile(r"step (\d+): (\S+) counts from this step on")  # a term's start_at (clipdist.train.trainer)
BANNER = re.compile(r"loss \S+: .*; global batch \d+ \((\d+) rank\(s\)")  # one a start (clipdist.train.recipe)


@dataclass
class RunRecord:
    """What a run directory says of its run."""

    train: list[dict]
    evals: list[dict]
    starts: list[tuple[int, int | None]] = field(default_factory=list)  # (step a start began at, its ranks)
    seconds: float | None = None  # from the first line of train.log to its last
    term_starts: dict[str, int] = field(default_factory=dict)  # a loss term counted from a later step (start_at)


def read_run(run_dir: str | Path) -> RunRecord:
    """The run's logs; a ValueError where the directory holds no training log."""
    run_dir = Path(run_dir)
    log = run_dir / "train_log.jsonl"
    if not log.exists() and not log.is_symlink():  # a link, a FIFO: refused by name when read (files.open_own)
        raise ValueError(f"{run_dir}: no train_log.jsonl (not a clipdist run directory, or no step logged yet)")
    record = RunRecord(jsonl_rows(run_dir / "train_log.jsonl")[0], jsonl_rows(run_dir / "metrics.jsonl")[0])
    log = run_dir / "train.log"
    times, resumed_at = [], 0
    for raw in read_lines(log) if log.is_file() else []:
        line = (raw or b"").decode(errors="replace")
        stamped = STAMP.match(line)
        if stamped is None:
            continue
        times.append(datetime.strptime(stamped.group(1), "%Y-%m-%d %H:%M:%S,%f"))
        resumed, banner = RESUMED.match(stamped.group(2)), BANNER.match(stamped.group(2))
        if started := TERM_START.match(stamped.group(2)):
            record.term_starts[started.group(2)] = int(started.group(1))
        if resumed:  # said just before the start's banner
            resumed_at = int(resumed.group(1))
        elif banner:
            record.starts.append((resumed_at, int(banner.group(1))))
            resumed_at = 0
    record.seconds = (times[-1] - times[0]).total_seconds() if len(times) > 1 else None
    return record


HEADLINES = ("zeroshot_top1", "t2i_r1", "i2t_r1", "val_clip_loss")  # the first a run has is its headline


def summary(record: RunRecord, name: str, running: str | None = None) -> str:
    """A few lines: a headline (what state the run is in, how far it went, its main result), what it skipped, the
    best and last of each metric — image→text recall said to be degenerate where the captions repeat."""
    last = record.train[-1] if record.train else {}
    state = f"RUNNING ({running})" if running else "not running"
    keys = metric_keys(record.evals)
    headline = next((key for key in HEADLINES if key in keys), None)
    result = ""
    if headline:
        points = [(row["step"], row[headline]) for row in record.evals if isinstance(row.get(headline), (int, float))]
        result = f"; {headline} {points[-1][1]:.4g} at step {points[-1][0]}"
    lines = [
        f"run {one_line(name)}: {state}, step {last.get('step', 0)}, {last.get('samples_seen', 0):,} samples seen"
        + result,
        (f"train.log spans {record.seconds / 60:.1f} min, " if record.seconds else "")
        + f"{len(record.starts)} start(s)"
        + "".join(
            f"; resumed at step {step}" + (f" on {ranks} rank(s)" if ranks else "") for step, ranks in record.starts[1:]
        ),
        f"skipped: {last.get('skipped_samples', 0)} sample(s), {last.get('skipped_shards', 0)} shard(s), "
        f"{last.get('skipped_steps', 0)} step(s); last loss {last.get('loss', float('nan')):.4f}",
    ]
    lines += [f"{one_line(name)} counted from step {step} on" for name, step in record.term_starts.items()]
    for key in keys:
        points = [(row["step"], row[key]) for row in record.evals if isinstance(row.get(key), (int, float))]
        best = (min if LOWER_IS_BETTER.search(key) else max)(points, key=lambda point: point[1])
        lines.append(
            f"{one_line(key)}: last {points[-1][1]:.4g} (step {points[-1][0]}), best {best[1]:.4g} (step {best[0]})"
            + _degenerate(key, record.evals[-1])
        )
    return "\n".join(lines) + "\n"


def _degenerate(key: str, row: dict) -> str:
    """Why an image→text metric says little on this set: fewer distinct captions than images (e.g. the digits'
    10 prompts for 359 images), so most images' own caption ties with others', and ties count against them."""
    prefix = key.split("/")[0] + "/" if "/" in key else "val_"  # the main set's counts are val_*, a named set's name/*
    distinct, images = row.get(f"{prefix}distinct_captions"), row.get(f"{prefix}images")
    stem = key.split("/")[-1]
    if stem.startswith("i2t_") and isinstance(distinct, int) and isinstance(images, int) and distinct < images:
        return f"  [degenerate: {distinct} distinct captions for {images} images]"
    return ""


def metric_keys(evals: list[dict]) -> list[str]:
    """The evaluation metrics worth a curve: numbers that vary, counts of samples left out."""
    keys = dict.fromkeys(
        key
        for row in evals
        for key, value in row.items()
        if key != "step" and isinstance(value, float) and not key.endswith(("samples", "errors"))
    )
    return list(keys)


def plot(record: RunRecord, path: Path | BinaryIO, title: str) -> None:
    """report.png: four panels against the step, each start of the run marked, under `title`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ((losses, rate), (lr, metrics)) = plt.subplots(2, 2, figsize=(13, 8), sharex=True)
    steps = [row["step"] for row in record.train]
    for key in ("loss", "contrastive_loss", "caption_loss", "distill_loss"):
        if any(key in row for row in record.train):
            losses.plot(steps, [row.get(key) for row in record.train], label=key, lw=1.5 if key == "loss" else 1)
    for key in (key for key in metric_keys(record.evals) if key.endswith("loss")):
        losses.plot([row["step"] for row in record.evals], [row.get(key) for row in record.evals], "o--", label=key)
    rate.plot(steps, [row.get("samples_per_s") for row in record.train], color="tab:green")
    lr.plot(steps, [row.get("lr") for row in record.train], color="tab:purple")
    for key in (key for key in metric_keys(record.evals) if FRACTIONS.search(key)):
        metrics.plot(
            [row["step"] for row in record.evals], [row.get(key) for row in record.evals], "o-", label=key, ms=3
        )
    for axes, panel in (
        (losses, "loss (train, and evaluation's)"),
        (rate, "samples/s"),
        (lr, "learning rate"),
        (metrics, "evaluation"),
    ):
        axes.set_title(panel)
        axes.grid(alpha=0.3)
        for name, step in record.term_starts.items():
            axes.axvline(step, color="tab:purple", ls="--", lw=1)
            axes.annotate(
                f"+{name}", (step, 0), xycoords=("data", "axes fraction"), fontsize=7, color="tab:purple", va="bottom"
            )
        for step, ranks in record.starts[1:]:
            axes.axvline(step, color="grey", ls=":", lw=1)
            axes.annotate(
                f"resumed{f' ×{ranks}' if ranks else ''}",
                (step, 1),
                xycoords=("data", "axes fraction"),
                fontsize=7,
                color="grey",
                ha="left",
                va="top",
                rotation=90,
            )
    for axes in (losses, metrics):
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=7, ncol=2)
    lr.set_xlabel("step")
    metrics.set_xlabel("step")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(run_dir: str | Path) -> tuple[Path, str]:
    """report.png and report.txt into the run directory; (the picture's path, the summary)."""
    run_dir = Path(run_dir)
    record = read_run(run_dir)
    text = summary(record, run_dir.name, running_holder(run_dir))
    picture = io.BytesIO()
    plot(record, picture, text.splitlines()[0])
    write_atomic(run_dir / PICTURE, picture.getvalue())  # a link planted at either name is replaced, not followed
    write_atomic(run_dir / SUMMARY, text)
    return run_dir / PICTURE, text
