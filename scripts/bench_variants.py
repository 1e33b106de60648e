"""clipdist against itself: the same run with different overrides, interleaved (A, B, A, B, ...), on one machine.

    python scripts/bench_variants.py --variant unlocked= --variant locked=model.lock_image=true \\
        --common model=timm_tiny data=web_photos world.batch_per_device=32 --steps 20 --repeats 2

Per run: the median samples/s of the steps after --skip (train_log.jsonl: the step alone, evaluation and
checkpoints excluded), and the ratio of each variant's median over the first variant's, per repeat.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from clipdist.tools.limit import real_run


def run(overrides: list[str], steps: int, skip: int, timeout: float) -> float:
    try:
        return real_run(overrides, steps, timeout, skip=skip)
    except RuntimeError as error:
        raise SystemExit(f"{' '.join(overrides)} failed: {error}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", required=True, help="NAME=override,override (may be empty)")
    parser.add_argument("--common", nargs="*", default=[], help="overrides every run gets")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=None, help="JSON file for every run's figure")
    args = parser.parse_args()
    variants = {}
    for spec in args.variant:
        name, _, overrides = spec.partition("=")
        variants[name] = [override for override in overrides.split(",") if override]
    figures = {name: [] for name in variants}
    for repeat in range(args.repeats):
        for name, overrides in variants.items():
            figures[name].append(run([*args.common, *overrides], args.steps, args.skip, args.timeout))
            print(f"repeat {repeat + 1} {name}: {figures[name][-1]:.1f} samples/s", flush=True)
    first = next(iter(variants))
    for name, values in figures.items():
        ratios = [value / base for value, base in zip(values, figures[first])]
        print(
            f"{name}: samples/s {', '.join(f'{v:.1f}' for v in values)}; vs {first}: "
            f"{', '.join(f'{r:.2f}x' for r in ratios)}"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"common": args.common, "variants": variants, "samples_per_s": figures}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
