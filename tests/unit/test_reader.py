"""A reader's passes: in epoch mode every pass gives each of its samples exactly once, whatever the shuffle
buffer (open_clip_train's epochs are permutations too), and a reader stopped anywhere — inside a pass, or while
the buffer empties at its end — reads on as one never stopped."""

from __future__ import annotations

import itertools

import pytest
import webdataset as wds
from fixtures import caption_shards, flat
from helpers import train_stream

from clipdist.data.faults import ShardHealth
from clipdist.data.reader import Reader, ShardSequence


def reader(tmp_path, buffer, *, index=0, readers=1, resampled=False, initial=100):
    urls = sorted(str(path) for path in caption_shards(tmp_path, shards=4, per_shard=7).glob("*.tar"))
    sequence = ShardSequence([urls], None, seed=5, reader=index, readers=readers, resampled=resampled)
    return Reader(sequence, buffer, "5-shuffle-0", wds.reraise_exception, ShardHealth(), initial=initial)


def keys(samples, count):
    return [sample["__key__"] for sample in itertools.islice(samples, count)]


@pytest.mark.parametrize("buffer, initial", [(1000, 100), (5, 2), (28, 10), (0, 100)])
@pytest.mark.parametrize("readers", [1, 2])
def test_every_pass_is_a_permutation_of_its_samples(tmp_path, buffer, initial, readers):
    """28 samples in 4 shards, dealt each pass over 1 or 2 readers: pass p of the readers together is the 28."""
    streams = [
        iter(reader(tmp_path, buffer, index=index, readers=readers, initial=initial)) for index in range(readers)
    ]
    passes = [[key for samples in streams for key in keys(samples, 28 // readers)] for _ in range(4)]
    for seen in passes:
        assert sorted(seen) == sorted(passes[0]) and len(set(seen)) == 28, (buffer, sorted(seen))
    if buffer > 1:
        assert len({tuple(seen) for seen in passes}) == 4  # shuffled afresh each pass


def test_resampled_streams_keep_one_buffer_across_draws(tmp_path):
    """Resampled has no passes: the buffer is not emptied every 28 draws, so the first samples out of a buffer
    larger than a pass mix draws from more than one 'pass' worth of shards (28 samples here come from more
    than 4 draws)."""
    samples = list(itertools.islice(reader(tmp_path, 1000, resampled=True), 200))
    first = samples[:28]
    assert max(sample["__entry__"] for sample in first) >= 4


@pytest.mark.parametrize("buffer", [1000, 5])
def test_a_reader_resumed_anywhere_reads_on_as_one_never_stopped(tmp_path, buffer):
    """Stopped once, or stopped again soon after a resume (twice inside the same end-of-pass drain too)."""
    whole = keys(iter(reader(tmp_path, buffer)), 90)
    for stops in [[1], [6], [7], [20], [27], [28], [29], [40], [55], [56], [57], [3, 5], [2, 9, 20], [21, 29, 30]]:
        seen, saved = [], None
        for stop in [*stops, 90]:
            part = reader(tmp_path, buffer)
            if saved is not None:
                part.load_state_dict(saved)
            seen += keys(iter(part), stop - len(seen))
            saved = part.state_dict()
        assert seen == whole, stops


def test_the_streams_epochs_are_permutations_with_a_buffer_larger_than_a_pass(tmp_path):
    """Two readers of 2 shards × 10 samples each, a buffer of 1,000: every 40 samples of the stream hold the 40
    samples once (before passes were permutations, the first 40 held samples read up to three times). The
    order's cycle is 2 batches of 10 (data.md: a pass ends on a cycle's boundary where the data is a whole
    number of cycles)."""
    caption_shards(tmp_path / "shards", shards=4, per_shard=10, pixel=lambda shard, i: 10 * shard + i)
    urls = sorted((tmp_path / "shards").glob("*.tar"))
    stream = train_stream(urls, 10, flat, shuffle_buffer=1000, readers=2, seed=1)
    try:
        assert stream.order.cycle == 20
        values = [value for _ in range(12) for value in next(stream)["image"].tolist()]
    finally:
        stream.close()
    for epoch in range(3):
        assert sorted(values[40 * epoch : 40 * (epoch + 1)]) == list(range(40)), epoch
