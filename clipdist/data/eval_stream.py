"""Evaluation sets read once, in order (the training stream is data/stream.py)."""
from __future__ import annotations

import math

import webdataset as wds

from clipdist.data.faults import DataError, SkipCounter
from clipdist.data.samples import eval_record
from clipdist.data.tar_samples import tar_samples


class _MarkGood:
    """Passes a usable sample on and tells the SkipCounter (its in-a-row count starts again)."""

    def __init__(self, *counters: SkipCounter):
        self.counters = counters

    def __call__(self, sample):
        for counter in self.counters:
            counter.ok()
        return sample


def _share(rank: int, world_size: int):
    """The samples this rank evaluates, undecoded: sample i of the set (counting every sample read, in shard
    order) goes to rank i mod world_size; its index travels with it."""

    def samples(source):
        for index, sample in enumerate(source):
            if index % world_size == rank:
                sample["__eval_index__"] = index
                yield sample

    return samples


def _indexed_record(sample: dict) -> tuple[int, object, list[str], int]:
    return (sample["__eval_index__"], *eval_record(sample))


def eval_records(urls: list[str], skips: SkipCounter, rank: int = 0, world_size: int = 1):
    """Every usable (index in the set, image, captions, label) of this rank's share of the shards, once, in
    order (see samples.eval_record). Every rank reads every shard (only its share is decoded): what is wrong with
    a shard itself is counted and warned about by rank 0 alone."""
    reading = skips if rank == 0 else SkipCounter(skips.max_in_a_row, first_warnings=0, every_s=math.inf)
    return wds.DataPipeline(
        wds.SimpleShardList(urls),
        tar_samples(handler=reading),
        _share(rank, world_size),
        wds.map(_indexed_record, handler=skips),
        wds.map(_MarkGood(skips, reading)),
    )


def first_eval_record(urls: list[str]):
    """The first sample of a validation set, or the exception that reading it raised (no skipping)."""
    first = wds.DataPipeline(wds.SimpleShardList(urls[:1]), tar_samples(handler=wds.reraise_exception), wds.map(eval_record))
    for record in first:
        return record
    raise DataError(f"{urls[0]} holds no sample")
