"""The loader alone on web-like JPEGs at 224 px: clipdist's TrainStream against open_clip_train's own webdataset
pipeline (`get_wds_dataset`, from the installed open_clip_torch wheel), same shards, same transform (open_clip's
training transform for a 224-px tower: random resized crop, RGB, normalize), same tokenizer, same batch and
loader workers; runs interleaved (clipdist, open_clip, clipdist, ...).

    python scripts/bench_loader.py --workers 1,2 --repeats 3 --batches 30 --out docs/bench/loader_web.json
    python scripts/bench_loader.py --shards '/data/datacomp/{00000000..00000099}.tar' ...

Default shards: the built-in web_photos set (data=web_photos: photographs from scikit-image and scikit-learn
re-cut as 256-512 px JPEGs of quality 80-95, ~42 KB each; needs scikit-image). Per run: decoded, augmented
samples/s over --batches batches after --skip warm-up batches (worker start-up and the first shards left
out), and that rate per loader worker. Needs pandas for open_clip_train (pip install -e ".[bench]").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def transform_and_tokenizer(model: str):
    import open_clip

    from clipdist.models import create_model, get_tokenizer

    visual = create_model(model, device="meta").visual
    config = visual.preprocess_cfg
    return (open_clip.image_transform(visual.image_size, is_train=True, mean=config["mean"], std=config["std"]),
            get_tokenizer(model))


def clipdist_batches(shards: list[str], batch: int, workers: int, transform, tokenizer):
    from clipdist.config import DataConfig
    from clipdist.data.stream import TrainStream

    data = DataConfig(source=None, resampled=True, workers=workers, shuffle_buffer=1000)
    stream = TrainStream([shards], data, batch_size=batch, image_transform=transform, tokenizer=tokenizer, rank=0,
                         world_size=1, seed=0)
    try:
        while True:
            images, _tokens, _counts = next(stream)
            yield images.shape[0]
    finally:
        stream.close()


def open_clip_batches(pattern: str, batch: int, workers: int, transform, tokenizer):
    from clipdist.tools.open_clip_peer import patch_open_clip_data

    open_clip_data = patch_open_clip_data()
    args = SimpleNamespace(train_data=pattern, train_num_samples=10**9, batch_size=batch, workers=workers, seed=0,
                           world_size=1, dataset_resampled=True, train_data_upsampling_factors=None,
                           val_data=None, val_num_samples=None)
    loader = open_clip_data.get_wds_dataset(args, transform, is_train=True, tokenizer=tokenizer).dataloader
    for images, _tokens in loader:
        yield images.shape[0]


def measure(batches, skip: int, count: int) -> float:
    """Samples/s over `count` batches after `skip`."""
    for _ in range(skip):
        next(batches)
    started, samples = time.perf_counter(), 0
    for _ in range(count):
        samples += next(batches)
    rate = samples / (time.perf_counter() - started)
    batches.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", help="a brace pattern of shards (default: the built-in web_photos set)")
    parser.add_argument("--cache-dir", default="~/.cache/clipdist", help="where web_photos is written on first use")
    parser.add_argument("--model", default="ViT-B-32", help="the tower whose transform is used (224 px)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--workers", default="1,2", help="loader workers per run, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", type=int, default=5, help="warm-up batches left out")
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--out", help="write the runs and the summary here as JSON")
    args = parser.parse_args()

    from clipdist.data.builtin import builtin_shards
    from clipdist.data.sources import expand_shards

    pattern = args.shards or builtin_shards("web_photos", args.cache_dir)[0]
    shards = expand_shards(pattern)
    transform, tokenizer = transform_and_tokenizer(args.model)
    runs = []
    for workers in map(int, args.workers.split(",")):
        for repeat in range(args.repeats):
            for name in ("clipdist", "open_clip"):
                batches = clipdist_batches(shards, args.batch, workers, transform, tokenizer) if name == "clipdist" \
                    else open_clip_batches(pattern, args.batch, workers, transform, tokenizer)
                rate = measure(batches, args.skip, args.batches)
                runs.append({"loader": name, "workers": workers, "repeat": repeat, "samples_per_s": rate})
                print(f"{name:9s} workers={workers} repeat={repeat}: {rate:7.1f} samples/s "
                      f"({rate / max(workers, 1):.1f} per worker)", flush=True)
    summary = []
    for workers in sorted({run["workers"] for run in runs}):
        median = {name: statistics.median(run["samples_per_s"] for run in runs
                                          if run["loader"] == name and run["workers"] == workers)
                  for name in ("clipdist", "open_clip")}
        ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(
            [r for r in runs if r["loader"] == "clipdist" and r["workers"] == workers],
            [r for r in runs if r["loader"] == "open_clip" and r["workers"] == workers])]
        summary.append({"workers": workers, "clipdist": median["clipdist"], "open_clip": median["open_clip"],
                        "ratio": median["clipdist"] / median["open_clip"], "per_repeat_ratios": ratios})
    print("\n| loader workers | clipdist samples/s (per worker) | open_clip samples/s (per worker) | ratio | per-repeat ratios |")
    print("|---|---|---|---|---|")
    for row in summary:
        w = row["workers"]
        print(f"| {w} | {row['clipdist']:.0f} ({row['clipdist'] / w:.0f}) | {row['open_clip']:.0f} "
              f"({row['open_clip'] / w:.0f}) | {row['ratio']:.2f}× | "
              f"{', '.join(f'{r:.2f}' for r in row['per_repeat_ratios'])} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "cpus": len(os.sched_getaffinity(0)),
                                              "runs": runs, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
