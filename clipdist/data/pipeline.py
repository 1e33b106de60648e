"""WebDataset streams for training (infinite, same number of batches on every rank) and evaluation."""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import random
from pathlib import Path

import braceexpand
import torch
import webdataset as wds

log = logging.getLogger(__name__)
IMAGE_KEYS = "jpg;jpeg;png;webp"


def expand_shards(pattern: str, what: str = "data.train_shards") -> list[str]:
    """Brace-expand a shard spec ('::' separates several) and check that local shards exist."""
    if not pattern:
        raise ValueError(f"{what} is empty: give a shard path, brace pattern or pipe: URL")
    urls = [url for part in pattern.split("::") for url in braceexpand.braceexpand(part)]
    local = [url for url in urls if "://" not in url and not url.startswith("pipe:")]
    missing = [url for url in local if not Path(url).is_file()]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise FileNotFoundError(
            f"{what}={pattern!r}: {len(missing)} of {len(urls)} shards not found ({shown}). "
            "Check the path, or write shards with `clipdist make-shards`"
        )
    empty = [url for url in local if Path(url).stat().st_size == 0]
    if empty:
        raise ValueError(f"{what}: empty shard file(s): {', '.join(empty[:3])}")
    return urls


class SkipCounter:
    """A webdataset handler that skips a bad sample or shard, warns, and counts it (across workers)."""

    def __init__(self):
        self._count = multiprocessing.get_context("fork").Value("i", 0)

    def __call__(self, exception: Exception) -> bool:
        with self._count.get_lock():
            self._count.value += 1
        log.warning("skipped a corrupt sample or shard: %r", exception)
        return True

    @property
    def count(self) -> int:
        return self._count.value


class _EpochShuffledShards(torch.utils.data.IterableDataset):
    """Endless shard list, reshuffled (seed + epoch) at every pass, the same on every rank."""

    def __init__(self, urls: list[str], seed: int):
        super().__init__()
        self.urls, self.seed = urls, seed

    def __iter__(self):
        for epoch in itertools.count():
            urls = list(self.urls)
            random.Random(self.seed + epoch).shuffle(urls)
            yield from ({"url": url} for url in urls)


def _valid_pair(sample) -> bool:
    return isinstance(sample[1], str) and sample[1].strip() != ""


def train_stream(urls: list[str], batch_size: int, image_transform, tokenizer, *, resampled: bool,
                 shuffle_buffer: int, workers: int, world_size: int, seed: int, skips: SkipCounter):
    """An endless iterator of (images, tokens) batches for this rank.

    Epoch mode: shards are shuffled each epoch and split by node and worker, so every sample is
    seen once per epoch; resampled mode draws shards with replacement. Either way the stream
    never ends, so each rank takes exactly one batch per step: same number of batches on every rank.
    """
    if not resampled and len(urls) < world_size * max(workers, 1):
        raise ValueError(
            f"{len(urls)} shard(s) for {world_size} rank(s) × {max(workers, 1)} worker(s): every worker needs "
            "at least one shard. Use more shards, fewer data.workers, or data.resampled=true"
        )
    if resampled:
        shards = [wds.ResampledShards(urls, seed=seed, deterministic=True)]
    else:
        shards = [_EpochShuffledShards(urls, seed), wds.split_by_node, wds.split_by_worker]
    pipeline = wds.DataPipeline(
        *shards,
        wds.tarfile_to_samples(handler=skips),
        wds.shuffle(shuffle_buffer, initial=min(shuffle_buffer, 100)),
        wds.decode("pil", handler=skips),
        wds.to_tuple(IMAGE_KEYS, "txt", handler=skips),
        wds.select(_valid_pair),
        wds.map_tuple(image_transform, lambda text: tokenizer([text])[0], handler=skips),
        wds.batched(batch_size, partial=False),
    )
    loader = wds.WebLoader(pipeline, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
    return iter(loader)


def eval_batches(urls: list[str], batch_size: int, image_transform, skips: SkipCounter):
    """Every (images, captions, json) batch of the validation shards, once, in order (rank-local)."""
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.tarfile_to_samples(handler=skips),
        wds.decode("pil", handler=skips),
        wds.to_tuple(IMAGE_KEYS, "txt", "json", handler=skips),
        wds.map_tuple(image_transform, lambda text: text, lambda meta: meta, handler=skips),
        wds.batched(batch_size, partial=True, collation_fn=_collate_eval),
    )
    return iter(pipeline)


def _collate_eval(samples):
    images, captions, metas = zip(*samples)
    return torch.stack(images), list(captions), list(metas)
