"""Evaluation sets read once, in order (the training stream is data/stream.py)."""
from __future__ import annotations

import webdataset as wds

from clipdist.data.faults import DataError, SkipCounter
from clipdist.data.samples import eval_record
from clipdist.data.tar_samples import tar_samples


class _MarkGood:
    """Passes a usable sample on and tells the SkipCounter (its in-a-row count starts again)."""

    def __init__(self, skips: SkipCounter):
        self.skips = skips

    def __call__(self, sample):
        self.skips.ok()
        return sample


def eval_records(urls: list[str], skips: SkipCounter):
    """Every usable (image, captions, label) of the shards, once, in order (see samples.eval_record)."""
    return wds.DataPipeline(
        wds.SimpleShardList(urls),
        tar_samples(handler=skips),
        wds.map(eval_record, handler=skips),
        wds.map(_MarkGood(skips)),
    )


def first_eval_record(urls: list[str]):
    """The first sample of a validation set, or the exception that reading it raised (no skipping)."""
    first = wds.DataPipeline(wds.SimpleShardList(urls[:1]), tar_samples(handler=wds.reraise_exception), wds.map(eval_record))
    for record in first:
        return record
    raise DataError(f"{urls[0]} holds no sample")
