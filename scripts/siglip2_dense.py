"""Plain SigLIP against the SigLIP 2 recipe on the embedded digits, on the built-in dense probe (and zero-shot).

    python scripts/siglip2_dense.py --seeds 0 1 --out runs/siglip2_dense

Per seed, three runs of the default tiny model, interleaved: `loss=siglip` for --steps steps; `recipe=siglip2` for
the same steps (so the same samples), its EMA decay lowered to --ema-decay for a run this short; and `loss=siglip`
again for as long as the recipe's steps took (the same compute, counted in seconds of training steps on this
machine; measured on the first seed and kept for the others). A run already finished in --out is not run again. Each is
scored by `clipdist eval <run> --dense` (the last checkpoint; the linear probe on its patch tokens) and its
zero-shot top-1 on the digits' validation set (the run's last evaluation). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train(run_dir: Path, overrides: list[str], timeout: float) -> float:
    """The seconds its training steps took (every step logged: Σ samples / samples_per_s; start-up, evaluation and
    checkpoints left out), after the run succeeded; a run that already finished in `run_dir` is not run again."""
    if not (run_dir / "metrics.jsonl").is_file():
        command = [sys.executable, str(REPO / "train.py"), f"run_dir={run_dir}", "logging.progress=false", *overrides]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
        if result.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    log = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    seen = [0] + [row["samples_seen"] for row in log]
    return sum((seen[k + 1] - seen[k]) / row["samples_per_s"] for k, row in enumerate(log))


def scores(run_dir: Path, timeout: float) -> dict:
    command = [sys.executable, "-m", "clipdist", "eval", str(run_dir), "--dense", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    dense = json.loads(result.stdout)
    log = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [row for row in log if "zeroshot_top1" in row]
    return {**dense, "zeroshot_top1": evaluated[-1]["zeroshot_top1"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--ema-decay", type=float, default=0.99)
    parser.add_argument("--out", type=Path, default=Path("runs/siglip2_dense"))
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    common = [f"optim.max_steps={args.steps}", f"eval_every={args.steps}", f"checkpoint_every={args.steps}"]
    common.append("logging.log_every=1")
    rows: dict[str, list[dict]] = {"siglip": [], "siglip2": [], "siglip, same time": []}
    steps = None  # the same-time run's steps: from the first seed's two runs, kept for the others
    for seed in args.seeds:
        base = args.out / f"seed{seed}"
        plain = train(base / "siglip", ["loss=siglip", f"seed={seed}", *common], args.timeout)
        recipe = train(
            base / "siglip2",
            ["recipe=siglip2", f"optim.ema.decay={args.ema_decay}", f"seed={seed}", *common],
            args.timeout,
        )
        steps = steps or round(args.steps * recipe / plain)
        same = [f"optim.max_steps={steps}", f"eval_every={steps}", f"checkpoint_every={steps}", "logging.log_every=1"]
        longer = train(base / "siglip_same_time", ["loss=siglip", f"seed={seed}", *same], args.timeout)
        for name, run, seconds, run_steps in (
            ("siglip", "siglip", plain, args.steps),
            ("siglip2", "siglip2", recipe, args.steps),
            ("siglip, same time", "siglip_same_time", longer, steps),
        ):
            figures = {**scores(base / run, args.timeout), "seconds": seconds, "steps": run_steps, "seed": seed}
            rows[name].append(figures)
            print(json.dumps({name: figures}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=2))
    print("\n| run | steps | step seconds | dense/miou | dense/patch_accuracy | zero-shot top-1 |")
    print("|---|---|---|---|---|---|")
    for name, figures in rows.items():
        cells = [
            "/".join(str(f["steps"]) for f in figures),
            "/".join(f"{f['seconds']:.0f}" for f in figures),
            *(
                " / ".join(f"{f[key]:.3f}" for f in figures) + f" (mean {statistics.mean(f[key] for f in figures):.3f})"
                for key in ("dense/miou", "dense/patch_accuracy", "zeroshot_top1")
            ),
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
