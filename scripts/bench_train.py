"""clipdist against open_clip's own trainer (open_clip_train, from the installed open_clip_torch wheel) on the
same work: shards, model config, per-rank batch, AdamW settings, warmup + cosine schedule, precision, loader
workers, steps — 1 and 2 ranks, both under torchrun, runs interleaved (A, B, A, B, ...).

    python scripts/bench_train.py --ranks 1,2 --repeats 2 --steps 100 --batch 128 --out docs/bench/train_cpu.json
    python scripts/bench_train.py --shards '/data/cc3m/{00000..00099}.tar' --model ViT-B-32 ...

Default shards: a built-in set, --source digits or web_photos (written to the cache on first use). Per run: the median
of the per-step
samples/s after --skip warm-up steps (clipdist: train_log.jsonl, evaluation and checkpoints excluded;
open_clip_train: its `Batch (t)` log lines), wall time, and zero-shot top-1 on the set's validation shards (same class
names and templates for both)
(both evaluated by clipdist's evaluate(), open_clip_train's model from its final checkpoint).

Shims open_clip_train needs here, all in scripts/open_clip_peer.py: clipdist's model configs
registered with open_clip; its webdataset grouping (`group_by_keys_nothrow`) skips webdataset 1.0's
end-of-shard marker `{}`, which it would otherwise fail on with KeyError 'fname'. It also needs pandas
(`pip install pandas`). On CPU it falls back from CUDA by itself; `--dist-backend gloo` for 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "scripts"))
from background import busy_processes  # noqa: E402

OPEN_CLIP_RATE = re.compile(r"Batch \(t\): [0-9.]+, ([0-9.]+)/s,")


def torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]


def quoted(text: str) -> str:
    """A string as a quoted Hydra override value."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def run_clipdist(args, ranks: int, work: Path) -> dict:
    world = ["world=local"] if ranks == 1 else [f"world=cpu{ranks}", "world.spawn=false"]
    command = [
        *torchrun(ranks),
        str(REPO / "train.py"),
        f"run_dir={work / 'run'}",
        *world,
        f"model={args.clipdist_model}",
        f"model.name={args.model}",
        "data=webdataset",
        f"data.train_shards='{args.shards}'",
        f"data.val_shards='{args.val_shards}'",
        f"data.workers={args.workers}",
        "data.resampled=true",
        f"data.classnames=[{','.join(map(quoted, args.classnames))}]",
        f"data.templates=[{','.join(map(quoted, args.templates))}]",
        f"world.batch_per_device={args.batch}",
        "precision=fp32",
        f"optim.lr={args.lr}",
        f"optim.weight_decay={args.wd}",
        f"optim.warmup_steps={args.warmup}",
        f"optim.max_steps={args.steps}",
        "optim.grad_clip=0",
        "logging.wandb=disabled",
        "logging.progress=false",
        "logging.log_every=1",
        f"eval_every={args.steps}",
        f"checkpoint_every={args.steps}",
        *args.clipdist_override,
    ]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, cwd=REPO)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1], "wall_s": wall}
    rows = [json.loads(line) for line in (work / "run" / "train_log.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    return {
        "samples_per_s": [row["samples_per_s"] for row in rows],
        "wall_s": wall,
        "zeroshot_top1": metrics[-1].get("zeroshot_top1"),
    }


def run_open_clip(args, ranks: int, work: Path) -> dict:
    samples = args.steps * args.batch * ranks
    peer = REPO / "scripts" / "open_clip_peer.py"
    # "--": torchrun's parser would take open_clip_train's --logs for an abbreviation of its own --logs-specs.
    command = [
        *torchrun(ranks),
        "--",
        str(peer),
        "--train-data",
        args.shards,
        "--dataset-type",
        "webdataset",
        "--dataset-resampled",
        "--train-num-samples",
        str(samples),
        "--epochs",
        "1",
        "--batch-size",
        str(args.batch),
        "--workers",
        str(args.workers),
        "--model",
        args.model,
        "--lr",
        str(args.lr),
        "--wd",
        str(args.wd),
        "--warmup",
        str(args.warmup),
        "--beta1",
        "0.9",
        "--beta2",
        "0.98",
        "--eps",
        "1e-6",
        "--precision",
        "fp32",
        "--dist-backend",
        "gloo",
        "--logs",
        str(work),
        "--name",
        "open_clip",
        "--log-every-n-steps",
        "1",
        "--report-to",
        "",
        "--save-frequency",
        "1",
        *args.open_clip_arg,
    ]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, cwd=work)
    wall = time.perf_counter() - started
    log = work / "open_clip" / "out.log"
    if result.returncode != 0 or not log.exists():
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1], "wall_s": wall}
    rates = [float(match.group(1)) for match in OPEN_CLIP_RATE.finditer(log.read_text())]
    return {
        "samples_per_s": rates,
        "wall_s": wall,
        "zeroshot_top1": zero_shot(args, work / "open_clip" / "checkpoints" / "epoch_1.pt"),
    }


def zero_shot(args, checkpoint: Path) -> float | None:
    """open_clip_train's final model on the validation set, by clipdist's evaluate()."""
    import open_clip
    import torch

    from clipdist.config import DataConfig
    from clipdist.data.sources import eval_set
    from clipdist.model.factory import create_model, get_tokenizer
    from clipdist.train.evaluate import evaluate

    if not checkpoint.exists():
        return None
    model = create_model(args.model)
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    model.load_state_dict({key.removeprefix("module."): value for key, value in state.items()})
    visual = model.visual
    transform = open_clip.image_transform(
        visual.image_size, is_train=False, mean=visual.preprocess_cfg["mean"], std=visual.preprocess_cfg["std"]
    )
    evalset = eval_set("val", args.val_shards, list(args.classnames), list(args.templates))
    return evaluate(
        model,
        get_tokenizer(args.model),
        evalset,
        transform,
        torch.device("cpu"),
        max_skips_in_a_row=DataConfig.max_skips_in_a_row,
    ).get("zeroshot_top1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--source",
        default=None,
        help="a built-in set (digits, web_photos): its shards where no --shards, its class names and "
        "templates for zero-shot (default: digits where no --shards)",
    )
    parser.add_argument("--shards", default=None, help="training shard spec (default: the built-in --source)")
    parser.add_argument("--val-shards", default=None, help="zero-shot set (default: the built-in --source's)")
    parser.add_argument("--cache-dir", default="~/.cache/clipdist", help="where a built-in set is written on first use")
    parser.add_argument(
        "--model", default="clipdist-tiny", help="open_clip model config name or config file (.json), for both"
    )
    parser.add_argument(
        "--clipdist-model", default="tiny", help="clipdist's model= preset for the other model settings"
    )
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the median")
    parser.add_argument("--batch", type=int, default=128, help="per rank")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--wd", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--clipdist-override", action="append", default=[], help="extra Hydra override")
    parser.add_argument("--open-clip-arg", action="append", default=[], help="extra open_clip_train argument")
    parser.add_argument(
        "--background",
        type=int,
        default=0,
        help="shared machine: this many busy-looping processes run beside every run",
    )
    parser.add_argument("--out", default=None, help="JSON file for every run's figures")
    args = parser.parse_args(argv)
    args.classnames, args.templates = [], ["a photo of {}."]
    if args.model.endswith(".json"):  # both trainers run elsewhere (open_clip_train in its own log folder)
        args.model = str(Path(args.model).resolve())
    if args.shards is None:
        args.source = args.source or "digits"
    if args.source is not None:
        from clipdist.data.builtin import builtin_shards, classnames_of, templates_of

        train_shards, builtin_val = builtin_shards(args.source, os.path.expanduser(args.cache_dir))
        args.shards, args.val_shards = args.shards or train_shards, args.val_shards or builtin_val
        args.classnames = classnames_of(args.source)
        args.templates = templates_of(args.source)
    if args.val_shards is None:
        parser.error("--val-shards is needed with --shards")

    runners = {"open_clip_train": run_open_clip, "clipdist": run_clipdist}
    runs = {(name, ranks): [] for ranks in map(int, args.ranks.split(",")) for name in runners}
    with busy_processes(args.background):
        measure(args, runners, runs)
    report(args, runs)
    return 0


def measure(args, runners, runs) -> None:
    for repeat in range(args.repeats):
        for (name, ranks), results in runs.items():
            with tempfile.TemporaryDirectory() as tmp:
                run = runners[name](args, ranks, Path(tmp))
            results.append(run)
            shown = (
                f"{statistics.median(run['samples_per_s'][args.skip :]):.1f} samples/s"
                if "samples_per_s" in run
                else run["error"]
            )
            print(
                f"[{repeat + 1}/{args.repeats}] {name} x{ranks}: {shown} ({run['wall_s']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )


def pair_ratios(runs: dict, name: str, ranks: int, skip: int) -> list[float]:
    """`name`'s median samples/s over open_clip_train's, repeat by repeat (a repeat's runs ran back to back, so a pair
    shares the machine's state of the moment: their spread shows its steady states, which one median hides)."""

    def rate(run: dict) -> float:
        return statistics.median(run["samples_per_s"][skip:])

    return [
        rate(mine) / rate(base)
        for mine, base in zip(runs[name, ranks], runs.get(("open_clip_train", ranks), []))
        if "samples_per_s" in mine and "samples_per_s" in base
    ]


def report(args, runs) -> None:
    print(f"{args.background} busy process(es) beside the runs")
    print(
        "| ranks | trainer | median samples/s | ratio | ratio per pair | wall s | zero-shot top-1 |\n"
        "|---:|---|---:|---:|---|---:|---:|"
    )
    summary = {}
    for (name, ranks), results in runs.items():
        ok = [r for r in results if "samples_per_s" in r]
        if ok:
            summary[name, ranks] = statistics.median(s for r in ok for s in r["samples_per_s"][args.skip :])
    for (name, ranks), results in runs.items():
        ok = [r for r in results if "samples_per_s" in r]
        if not ok:
            print(f"| {ranks} | {name} | failed: {results[0]['error']} | | | | |")
            continue
        base = summary.get(("open_clip_train", ranks))
        ratio = f"{summary[name, ranks] / base:.2f}" if base else ""
        top1 = [r["zeroshot_top1"] for r in ok if r["zeroshot_top1"] is not None]
        pairs = ", ".join(f"{value:.2f}" for value in pair_ratios(runs, name, ranks, args.skip))
        print(
            f"| {ranks} | {name} | {summary[name, ranks]:.1f} | {ratio} | {pairs} | "
            f"{statistics.median(r['wall_s'] for r in ok):.0f} | {statistics.median(top1) if top1 else '':.3} |"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "host": os.uname().nodename,
                    "runs": {f"{name} x{ranks}": results for (name, ranks), results in runs.items()},
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    sys.exit(main())
