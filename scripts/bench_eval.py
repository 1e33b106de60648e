"""Evaluation on 1 rank against N ranks: `clipdist eval` on a generated set, runs interleaved, metrics compared.

    python scripts/bench_eval.py runs/my-run --samples 50000 --world 1,2 --repeats 2

The set: --samples distinct random 32-px PNGs in shards of 5,000, each with a distinct caption and a label of 10
classes (written once to --cache). Per run: the wall time of the whole command (process start included), and
whether its metrics equal the first run's.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def generated_set(folder: Path, samples: int, per_shard: int = 5000, size: int = 32) -> Path:
    import numpy as np
    import webdataset as wds
    from PIL import Image

    done = folder / f"done-{samples}"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(0)
    for shard in range(-(-samples // per_shard)):
        with wds.TarWriter(str(folder / f"{shard:04d}.tar")) as writer:
            for i in range(shard * per_shard, min(samples, (shard + 1) * per_shard)):
                buffer = io.BytesIO()
                Image.fromarray(generator.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, "PNG")
                writer.write(
                    {"__key__": f"{i:07d}", "png": buffer.getvalue(), "txt": f"sample number {i}", "cls": str(i % 10)}
                )
    (folder / "classnames.txt").write_text("".join(f"class {c}\n" for c in range(10)))
    done.touch()
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="what clipdist eval evaluates (a run directory, an export, a model name)")
    parser.add_argument("--samples", type=int, default=50000)
    parser.add_argument("--world", default="1,2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache", default="~/.cache/clipdist/bench_eval")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads per rank (OMP_NUM_THREADS)")
    args = parser.parse_args()
    folder = generated_set(Path(args.cache).expanduser() / str(args.samples), args.samples)
    spec = str(folder)  # a directory of shards, classnames.txt beside them
    times, first = {int(w): [] for w in args.world.split(",")}, None
    for repeat in range(args.repeats):
        for world in times:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                started = time.perf_counter()
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "clipdist",
                        "eval",
                        args.target,
                        "--set",
                        f"set={spec}",
                        "--world",
                        str(world),
                        "--out",
                        out.name,
                    ],
                    check=True,
                    capture_output=True,
                    cwd=REPO,
                    env={**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})},
                )
                times[world].append(time.perf_counter() - started)
                metrics = json.loads(Path(out.name).read_text())
            first = first or metrics
            print(
                f"repeat {repeat + 1}, {world} rank(s): {times[world][-1]:.1f} s, metrics equal to the first run's: "
                f"{metrics == first}",
                flush=True,
            )
    base = times[min(times)]
    for world, values in times.items():
        print(
            f"{world} rank(s): {', '.join(f'{v:.1f}' for v in values)} s; vs {min(times)}: "
            f"{', '.join(f'{v / b:.2f}x' for v, b in zip(values, base))}"
        )
    print(json.dumps(first, indent=1))


if __name__ == "__main__":
    main()
