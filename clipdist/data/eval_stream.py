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


def split_by_shard(urls: list[str], world_size: int) -> bool:
    """Whether a set's ranks take whole shards (at least one each), or samples of every shard."""
    return len(urls) >= world_size


def shard_of(index: int) -> int:
    """The shard of a sample's place in its set, where the set is split by shard."""
    return index >> 32


def _share(urls: list[str], rank: int, world_size: int):
    """The samples this rank evaluates, undecoded, each with its place in the set (`__eval_index__`, ordering
    the samples as the set does). With at least as many shards as ranks, shard k goes to rank k mod world_size
    and a sample's place is (k, position in its shard); with fewer, every rank reads every shard and sample i
    (counting every sample read) goes to rank i mod world_size."""
    by_shard = split_by_shard(urls, world_size)
    position_of = {url: position for position, url in enumerate(urls)}

    def samples(source):
        seen: dict[int, int] = {}
        for index, sample in enumerate(source):
            if by_shard:
                shard = position_of[sample["__url__"]]
                seen[shard] = seen.get(shard, -1) + 1
                sample["__eval_index__"] = (shard << 32) | seen[shard]
                yield sample
            elif index % world_size == rank:
                sample["__eval_index__"] = index
                yield sample

    return samples


def _indexed_record(sample: dict) -> tuple[int, object, list[str], int]:
    return (sample["__eval_index__"], *eval_record(sample))


def eval_records(urls: list[str], skips: SkipCounter, rank: int = 0, world_size: int = 1):
    """Every usable (index in the set, image, captions, label) of this rank's share of the shards, once, in
    order (see samples.eval_record; `_share` for who reads what). Where every rank reads every shard, what is
    wrong with a shard itself is counted and warned about by rank 0 alone."""
    by_shard = split_by_shard(urls, world_size)
    reading = skips if rank == 0 or by_shard else SkipCounter(skips.max_in_a_row, first_warnings=0, every_s=math.inf)
    return wds.DataPipeline(
        wds.SimpleShardList(urls[rank::world_size] if by_shard else urls),
        tar_samples(handler=reading),
        _share(urls, rank, world_size),
        wds.map(_indexed_record, handler=skips),
        wds.map(_MarkGood(skips, reading)),
    )


def first_eval_record(urls: list[str]):
    """The first sample of a validation set, or the exception that reading it raised (no skipping)."""
    first = wds.DataPipeline(
        wds.SimpleShardList(urls[:1]), tar_samples(handler=wds.reraise_exception), wds.map(eval_record)
    )
    for record in first:
        return record
    raise DataError(f"{urls[0]} holds no sample")
