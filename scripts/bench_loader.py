"""The loader alone on web-like JPEGs at 224 px: clipdist's TrainStream against open_clip_train's own webdataset
pipeline (`get_wds_dataset`, from the installed open_clip_torch wheel), same shards, same transform (open_clip's
training transform for a 224-px tower: random resized crop, RGB, normalize), same tokenizer, same batch and
loader workers; runs interleaved (clipdist, clipdist uint8, open_clip, clipdist, ...). "clipdist" makes
normalized float32 batches (CPU runs); "clipdist uint8" makes the uint8 batches GPU runs copy to the device and
normalize there (data.normalize_on). --background N: N busy-looping processes run beside (a shared machine).

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
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "scripts"))
from background import busy_processes  # noqa: E402

from clipdist.tools.loader_rate import samples_per_second, stream_rows  # noqa: E402


def transform_and_tokenizer(model: str):
    import open_clip

    from clipdist.model.factory import create_model, get_tokenizer

    visual = create_model(model, device="meta").visual
    config = visual.preprocess_cfg
    return (
        open_clip.image_transform(visual.image_size, is_train=True, mean=config["mean"], std=config["std"]),
        get_tokenizer(model),
    )


def open_clip_batches(pattern: str, batch: int, workers: int, transform, tokenizer):
    from open_clip_peer import patch_open_clip_data

    open_clip_data = patch_open_clip_data()
    args = SimpleNamespace(
        train_data=pattern,
        train_num_samples=10**9,
        batch_size=batch,
        workers=workers,
        seed=0,
        world_size=1,
        dataset_resampled=True,
        train_data_upsampling_factors=None,
        val_data=None,
        val_num_samples=None,
    )
    loader = open_clip_data.get_wds_dataset(args, transform, is_train=True, tokenizer=tokenizer).dataloader
    for images, _tokens in loader:
        yield images.shape[0]


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
    parser.add_argument(
        "--pieces",
        type=int,
        default=1,
        help="above 1: also clipdist uint8 reading each batch in this many pieces (data.pieces)",
    )
    parser.add_argument(
        "--background",
        type=int,
        default=0,
        help="shared machine: this many busy-looping processes run beside the loaders",
    )
    parser.add_argument(
        "--decode-on-device",
        action="store_true",
        help="also data.decode_on=device: the workers' rate handing over bytes and boxes, and with the rank's "
        "decode run on this CPU (libjpeg-turbo; nvJPEG on CUDA) in the loop",
    )
    parser.add_argument("--out", help="write the runs and the summary here as JSON")
    args = parser.parse_args()
    with busy_processes(args.background):
        run(args)


def run(args) -> None:
    from clipdist.data.builtin import builtin_shards
    from clipdist.data.sources import expand_shards

    pattern = args.shards or builtin_shards("web_photos", args.cache_dir)[0]
    shards = expand_shards(pattern)
    transform, tokenizer = transform_and_tokenizer(args.model)
    loaders = {
        "clipdist": lambda workers: stream_rows(shards, args.batch, workers, transform, tokenizer),
        "clipdist uint8": lambda workers: stream_rows(shards, args.batch, workers, transform, tokenizer, pixels=True),
        "open_clip": lambda workers: open_clip_batches(pattern, args.batch, workers, transform, tokenizer),
    }
    if args.decode_on_device:
        from clipdist.data.device_decode import device_decoder

        decode = device_decoder(transform, "cpu")
        loaders["clipdist bytes (decode_on=device)"] = lambda workers: stream_rows(
            shards, args.batch, workers, transform, tokenizer, pixels=True, decode_on="device"
        )
        loaders["clipdist bytes + rank decode (cpu)"] = lambda workers: stream_rows(
            shards, args.batch, workers, transform, tokenizer, pixels=True, decode_on="device", then=decode
        )
    if args.pieces > 1:
        loaders[f"clipdist uint8 ×{args.pieces} pieces"] = lambda workers: stream_rows(
            shards, args.batch, workers, transform, tokenizer, pixels=True, pieces=args.pieces
        )
    runs = []
    for workers in map(int, args.workers.split(",")):
        for repeat in range(args.repeats):
            for name, batches in loaders.items():
                rate = samples_per_second(batches(workers), args.skip, args.batches)
                runs.append({"loader": name, "workers": workers, "repeat": repeat, "samples_per_s": rate})
                print(
                    f"{name:24s} workers={workers} repeat={repeat}: {rate:7.1f} samples/s "
                    f"({rate / max(workers, 1):.1f} per worker)",
                    flush=True,
                )
    summary = []
    for workers in sorted({run["workers"] for run in runs}):
        of = {
            name: [run["samples_per_s"] for run in runs if run["loader"] == name and run["workers"] == workers]
            for name in loaders
        }
        for name in loaders:
            summary.append(
                {
                    "workers": workers,
                    "loader": name,
                    "samples_per_s": statistics.median(of[name]),
                    "ratio": statistics.median(of[name]) / statistics.median(of["open_clip"]),
                    "per_repeat_ratios": [a / b for a, b in zip(of[name], of["open_clip"])],
                }
            )
    print(f"\n{args.background} busy process(es) beside the loaders")
    print("| loader workers | loader | samples/s (per worker) | ratio to open_clip | per-repeat ratios |")
    print("|---|---|---|---|---|")
    for row in summary:
        w = row["workers"]
        print(
            f"| {w} | {row['loader']} | {row['samples_per_s']:.0f} ({row['samples_per_s'] / max(w, 1):.0f}) | "
            f"{row['ratio']:.2f}× | {', '.join(f'{r:.2f}' for r in row['per_repeat_ratios'])} |"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {"args": vars(args), "cpus": len(os.sched_getaffinity(0)), "runs": runs, "summary": summary}, indent=2
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
