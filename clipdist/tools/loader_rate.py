"""The loader alone, no step: a TrainStream's batches and their samples/s (scripts/bench_loader.py, the GPU
battery's loader row)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from clipdist.config import DataConfig, DecodeOn
from clipdist.data.stream import TrainStream


def stream_rows(
    shards: list[str],
    batch: int,
    workers: int,
    transform,
    tokenizer,
    pixels: bool = False,
    pieces: int = 1,
    decode_on: str = "host",
    shuffle_buffer: int = 1000,
    then: Callable | None = None,
) -> Iterator[int]:
    """Each batch's rows from clipdist's stream over `shards` (resampled, rank 0 of 1). `pixels`: uint8 batches, as
    GPU runs have them (data.normalize_on=device); `pieces`: each batch read as that many pieces (data.pieces);
    `decode_on`: device, the workers hand over JPEG bytes and crop boxes (data.decode_on), `then` (the rank's
    decode) run on each batch's images."""
    data = DataConfig(
        source=None,
        resampled=True,
        workers=workers,
        shuffle_buffer=shuffle_buffer,
        pieces=pieces,
        decode_on=DecodeOn(decode_on),
    )
    stream = TrainStream(
        [shards], data, batch_size=batch, image_transform=transform, tokenizer=tokenizer, pixels=pixels
    )
    try:
        while True:
            rows = next(stream)
            if then is not None:
                then(rows["image"])
            yield rows.rows
    finally:
        stream.close()


def samples_per_second(batches: Iterator[int], skip: int, count: int) -> float:
    """Samples/s over `count` batches after `skip` warm-up batches; the stream closed after."""
    try:
        for _ in range(skip):
            next(batches)
        started, samples = time.perf_counter(), 0
        for _ in range(count):
            samples += next(batches)
        return samples / (time.perf_counter() - started)
    finally:
        batches.close()  # type: ignore[attr-defined]
