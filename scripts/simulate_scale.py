"""Internet scale without the data: a LAION-5B-shaped layout (500,000 shard URLs of ~10,000 samples, 1,024 ranks,
V = 8,192 readers) run through clipdist's own data-layout code, for one rank, with no shard opened.

    python scripts/simulate_scale.py [--shards 500000] [--ranks 1024] [--readers 8192] [--batch 32]
                                     [--buffer 1000] [--resampled] [--resume-ranks 768]

Measured, for rank 0: host memory the shard list and its readers hold (tracemalloc: Python allocations), the time to
expand the shard spec, to find the rank's readers and to place them at the run's start; the size of the data
position a checkpoint holds (`progress.pt`'s share: every reader with a full shuffle buffer, as late in a run) and
how long writing and reading it takes; and an elastic resume onto --resume-ranks ranks: the time for a rank to find
its readers and take their saved positions (the shard reads a real resume does to refill the shuffle buffers are
I/O, not simulated). Prints a table; --json writes the figures.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from clipdist.data.order import SampleOrder  # noqa: E402
from clipdist.data.reader import Reader, ShardList, ShardSequence  # noqa: E402
from clipdist.data.sources import expand_shards  # noqa: E402
from clipdist.data.stream import READER_KEY, TrainStream, pack_position  # noqa: E402


class Data:  # the DataConfig fields the stream reads
    split, workers, pieces, readers, weights, caption_keys, caption_probs, image_keys = (
        "node",
        0,
        1,
        None,
        None,
        ["txt"],
        None,
        [],
    )
    max_skips_in_a_row = 1000

    def __init__(self, resampled: bool, buffer: int):
        self.resampled, self.shuffle_buffer = resampled, buffer


def measured(action):
    """(result, seconds, retained MB, peak MB) of `action()` under tracemalloc."""
    tracemalloc.start()
    started = time.perf_counter()
    result = action()
    seconds = time.perf_counter() - started
    retained, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return result, seconds, retained / 2**20, peak / 2**20


def full_position(readers: int, buffer: int, entry: int, samples_per_shard: int) -> dict:
    """A reader's saved position late in a run: a full shuffle buffer of references to its last shards."""
    rng = random.Random(0)
    return {
        "reader": {
            "entry": entry,
            "taken": 1234,
            "received": 10 * buffer,
            "rng": rng.getstate(),
            "buffer": [(entry - rng.randrange(3), rng.randrange(samples_per_shard)) for _ in range(buffer)],
        },
        "taken": 0,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=500_000)
    parser.add_argument("--samples-per-shard", type=int, default=10_000)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--readers", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--buffer", type=int, default=1000, help="data.shuffle_buffer")
    parser.add_argument("--resampled", action="store_true")
    parser.add_argument("--resume-ranks", type=int, default=768)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    width = len(str(args.shards - 1))
    spec = f"s3://laion5b/shards/{{{0:0{width}d}..{args.shards - 1:0{width}d}}}.tar"
    figures: dict[str, float] = {}

    urls, figures["expand_s"], figures["urls_mb"], _ = measured(lambda: expand_shards(spec))
    data = Data(args.resampled, args.buffer)
    late_entry = 0

    def start(rank: int, ranks: int, saved: dict | None = None):
        stream = TrainStream(
            [urls],
            data,
            batch_size=args.batch,
            image_transform=None,
            tokenizer=None,
            rank=rank,
            world_size=ranks,
            seed=0,
            readers=args.readers // args.ranks,
        )  # V/N per rank at the start
        if saved is not None:
            stream.load_state_dict(saved)
        readers, shards = stream.rank_readers, ShardList(stream.sources)  # as the rank's TrainingBatches holds them
        sequences = [
            ShardSequence(shards, None, stream.seed, index, stream.order.readers, args.resampled) for index in readers
        ]
        placed = [
            Reader(sequence, args.buffer, f"{stream.seed}-shuffle-{index}", None, None)
            for sequence, index in zip(sequences, readers)
        ]
        for sequence in sequences:
            next(sequence.from_entry(0 if saved is None else late_entry))  # the first shard it opens: deal or draws
        return stream, placed

    (stream, placed), figures["start_s"], figures["start_mb"], figures["start_peak_mb"] = measured(
        lambda: start(0, args.ranks)
    )
    figures["rank_readers"] = len(stream.rank_readers)

    batches_done = 5_000
    position = batches_done * args.batch * args.ranks
    order = SampleOrder(args.readers, args.batch * args.ranks)
    entry = late_entry = max(order.taken_before(0, position) // args.samples_per_shard, 3)
    late = {
        "layout": stream.layout,
        "seed": stream.seed,
        "position": position,
        "skipped_samples": 0,
        "skipped_shards": 0,
        "source_samples": [position],
    }
    positions = {
        index: full_position(args.readers, args.buffer, entry, args.samples_per_shard) for index in range(args.readers)
    }
    # progress.pt: the layout, position and totals (each rank's RNG state is beside them, linear in the world: ~10 kB a
    # rank)
    buffer = io.BytesIO()
    _, figures["save_s"], _, _ = measured(lambda: torch.save({"stream": late}, buffer))
    figures["progress_kb"] = buffer.getbuffer().nbytes / 2**10
    # the readers' positions: tensors in the DCP folder, each rank writing its own (rank 0's share measured)
    shares = io.BytesIO()
    mine = {READER_KEY.format(index): pack_position(positions[index]) for index in stream.rank_readers}
    _, figures["pack_s"], _, _ = measured(lambda: torch.save(mine, shares))
    figures["rank_share_kb"] = shares.getbuffer().nbytes / 2**10
    figures["readers_total_mb"] = figures["rank_share_kb"] / len(mine) * args.readers / 2**10
    buffer.seek(0)
    loaded, figures["load_s"], _, _ = measured(lambda: torch.load(buffer, weights_only=True)["stream"])

    def resume():  # a rank of the new world: the small part, then only its readers' tensors, unpacked
        resumed, placed = start(0, args.resume_ranks, loaded)
        packed = {key: pack_position(positions[int(key.removeprefix("reader_"))]) for key in resumed.reader_keys()}
        resumed.load_reader_tensors(packed)
        for index, reader in zip(resumed.rank_readers, placed):
            reader.load_state_dict(
                {**resumed.readers[index]["reader"], "buffer": []}
            )  # (the buffer's shard reads: I/O)
        return resumed, placed

    (resumed, _), figures["resume_s"], figures["resume_mb"], figures["resume_peak_mb"] = measured(resume)
    figures["resume_rank_readers"] = len(resumed.rank_readers)
    figures["resume_continued"] = float(resumed.continued)

    mode = "resampled" if args.resampled else "epoch"
    print(
        f"{args.shards:,} shards × {args.samples_per_shard:,} samples, {args.ranks:,} ranks, V = {args.readers:,}, "
        f"{args.batch} per rank, shuffle buffer {args.buffer}, {mode}; rank 0 ({sys.version.split()[0]}, torch "
        f"{torch.__version__})"
    )
    rows = [
        ("expand the shard spec", f"{figures['expand_s']:.2f} s", f"{figures['urls_mb']:.0f} MB (the URL list)"),
        (
            "start: find and place the rank's readers",
            f"{figures['start_s']:.2f} s",
            f"{figures['start_mb']:.0f} MB kept, {figures['start_peak_mb']:.0f} MB peak "
            f"({figures['rank_readers']} readers)",
        ),
        (
            "progress.pt's data position: save / load",
            f"{figures['save_s']:.2f} / {figures['load_s']:.2f} s",
            f"{figures['progress_kb']:.1f} kB",
        ),
        (
            "the rank's readers' positions (DCP tensors)",
            f"{figures['pack_s']:.2f} s",
            f"{figures['rank_share_kb']:.0f} kB a rank, {figures['readers_total_mb']:.0f} MB in all",
        ),
        (
            f"elastic resume {args.ranks} → {args.resume_ranks} ranks: place",
            f"{figures['resume_s']:.2f} s",
            f"{figures['resume_mb']:.0f} MB kept, {figures['resume_peak_mb']:.0f} MB peak "
            f"({figures['resume_rank_readers']} readers, continued: {bool(figures['resume_continued'])})",
        ),
    ]
    for name, seconds, memory in rows:
        print(f"  {name:<48} {seconds:>14}   {memory}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
