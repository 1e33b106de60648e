"""Samples/s of short clipdist trainings, several variants interleaved, median per variant.

    python scripts/train_throughput.py --steps 60 --repeats 2 \
        --variant workers0=data.workers=0 --variant workers2=data.workers=2 \
        -- world=1gpu model=vit_b32

Each variant is NAME=OVERRIDE[,OVERRIDE...] (Hydra overrides on top of the common ones after
`--`), or NAME@CHECKOUT=... to run another checkout's train.py (another revision: `git worktree add
/tmp/old HEAD~3`); `--launcher torchrun` starts each run as `torchrun --nproc-per-node N train.py ...`.
Runs go round-robin (variant A, B, C, A, B, C, ...) so drift on a shared machine hits all alike.
The figure is the median of the per-step `samples_per_s` logged after `--skip` warm-up steps
(compilation, loader start), which excludes evaluation and checkpoint time. Prints a Markdown
table and writes JSON with every run's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_run(overrides: list[str], launcher: str, nproc: int, steps: int, timeout: float, repo: Path = REPO) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        train = [str(repo / "train.py")]
        command = (
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *train]
            if launcher == "torchrun"
            else [sys.executable, *train]
        )
        command += [
            f"run_dir={run_dir}",
            "logging.wandb=disabled",
            "logging.progress=false",
            "logging.log_every=1",
            f"optim.max_steps={steps}",
            f"eval_every={steps}",
            f"checkpoint_every={steps}",
            *overrides,
        ]
        started = time.perf_counter()
        # The checkout's own package first (an editable install would otherwise import this one's).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=repo, env=env)
        wall = time.perf_counter() - started
        if result.returncode != 0:
            return {
                "error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed",
                "wall_s": wall,
            }
        rows = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
        metrics = (
            [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            if (run_dir / "metrics.jsonl").exists()
            else []
        )
        return {
            "samples_per_s": [row["samples_per_s"] for row in rows],
            "wall_s": wall,
            "final_loss": rows[-1]["loss"],
            "zeroshot_top1": metrics[-1].get("zeroshot_top1") if metrics else None,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", required=True, help="NAME=OVERRIDE[,OVERRIDE...]")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the median")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--launcher", choices=["python", "torchrun"], default="python")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=None, help="JSON file for every run's figures")
    parser.add_argument("common", nargs="*", help="overrides for every variant (after --)")
    args = parser.parse_args(argv)
    variants = {}
    for spec in args.variant:
        label, _, overrides = spec.partition("=")
        name, _, checkout = label.partition("@")
        variants[name] = ([o for o in overrides.split(",") if o], Path(checkout).resolve() if checkout else REPO)
    runs = {name: [] for name in variants}
    for repeat in range(args.repeats):
        for name, (overrides, repo) in variants.items():
            run = one_run([*args.common, *overrides], args.launcher, args.nproc, args.steps, args.timeout, repo)
            runs[name].append(run)
            shown = (
                f"{statistics.median(run['samples_per_s'][args.skip :]):.1f} samples/s"
                if "samples_per_s" in run
                else run["error"]
            )
            print(f"[{repeat + 1}/{args.repeats}] {name}: {shown} ({run['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    # Per run too: a 2-core machine settles into one of two steady states for a whole run (e.g. ~900 or ~770
    # samples/s), so one pair can move a ratio by 15-25%; the per-run medians and per-repeat ratios show which.
    print(
        "| variant | median samples/s | per-run medians | ratio to the first, per repeat | wall s | final loss | "
        "zero-shot top-1 |\n|---|---:|---|---|---:|---:|---:|"
    )
    first = next(iter(runs.values()))

    def run_median(run):
        return statistics.median(run["samples_per_s"][args.skip :]) if "samples_per_s" in run else None

    for name, results in runs.items():
        ok = [r for r in results if "samples_per_s" in r]
        if not ok:
            print(f"| {name} | failed: {results[0]['error']} | | | | | |")
            continue
        median = statistics.median(s for r in ok for s in r["samples_per_s"][args.skip :])
        wall = statistics.median(r["wall_s"] for r in ok)
        top1 = ok[-1]["zeroshot_top1"]
        medians = ", ".join(f"{run_median(r):.0f}" for r in ok)
        ratios = ", ".join(
            f"{run_median(r) / run_median(base):.2f}"
            for r, base in zip(results, first)
            if run_median(r) and run_median(base)
        )
        print(
            f"| {name} | {median:.1f} | {medians} | {ratios} | {wall:.0f} | {ok[-1]['final_loss']:.3f} | "
            f"{'' if top1 is None else f'{top1:.3f}'} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs, "host": os.uname().nodename}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
