"""One reader's raw samples — a rank's, or one of its DataLoader workers' — in an order that is a
function of the seed, the reader and the position alone, with a position that is saved with every
checkpoint and restored exactly (a resumed run reads the same samples as one never stopped).

    shard sequence   epoch mode: pass p shuffles the whole shard list with seed + p and deals it out
                     over the readers: where every shard's size is known, cut into each reader's rows of
                     epoch p (epochs.RowDeal: an epoch is then a permutation of the rows), else whole
                     shards, each to one reader. Resampled: draw i picks a source by
                     data.weights, then one of its shards, from a generator seeded by (seed, reader).
                     Entry n of the sequence is found by replaying n picks: no I/O.
    samples          a shard's (or a piece's) samples in tar order, numbered from 0.
    shuffle buffer   webdataset's algorithm (fill to `initial`, then two in per one out up to `size`;
                     a uniform pick, swapped with the last) driven by our own random.Random. In epoch
                     mode the buffer is emptied at the end of each pass and filled afresh, so a pass
                     gives each of its samples exactly once (a permutation, as open_clip_train's epochs
                     are); resampled streams have no passes and the buffer runs on.

The position (`state_dict`) is the shard being read (its sequence entry) and how many of its samples
were taken, the buffer as (entry, sample number) references in buffer order, and the buffer's RNG
state: a few kB. Restoring re-reads the referenced samples (the last few shards) and skips the taken
ones, without decoding. torchdata's StatefulDataLoader implements the same protocol (state_dict /
load_state_dict on the dataset, states sent along with the batches); we carry the state in each batch
ourselves, which needs no second loader implementation and works with any start method.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterator

import numpy as np
import webdataset as wds

from clipdist.data.epochs import RowDeal
from clipdist.data.faults import DataError, ShardHealth
from clipdist.data.kinds import kind_of_url
from clipdist.data.tar_samples import tar_samples


class ShardList:
    """Every shard of the run's sources in order, each with its source, and each epoch's shuffled order of them:
    one per process, shared by all its readers (a reader keeps only its own deal). At internet scale (500,000
    shards, a rank's 8 readers) a list of the URLs per reader and a shuffled copy per reader and pass cost 250 MB a
    rank; shared, the URLs once and one permutation of int32 per pass (2 MB)."""

    def __init__(self, sources: list[list[str]]):
        self.sources = sources
        self.urls = [url for urls in sources for url in urls]
        self.ends = list(itertools.accumulate(len(urls) for urls in sources))
        self._shuffled: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, index: int) -> tuple[str, int]:
        """(url, source) of shard `index` of the whole list."""
        return self.urls[index], bisect.bisect_right(self.ends, index)

    def permutation(self, seed: int) -> np.ndarray:
        """The shards' order in the pass shuffled with `seed`: the list shuffled with random.Random(seed) (the
        permutation of positions: the same as shuffling the list itself)."""
        if self._shuffled[0] != seed:
            order = list(range(len(self.urls)))
            random.Random(seed).shuffle(order)
            self._shuffled = (seed, np.asarray(order, dtype=np.int64 if len(order) >= 2**31 else np.int32))
        return self._shuffled[1]

    def dealt(self, seed: int, reader: int, readers: int) -> list[tuple[str, int]]:
        """Reader j's shards of the pass shuffled with `seed`: entries j, j + V, j + 2V, ... of its order."""
        return [self[int(index)] for index in self.permutation(seed)[reader::readers]]


class ShardSequence:
    """The shards one reader opens, endlessly, as (entry, url, source, first, count): its samples `first` …
    `first + count − 1` of the shard (count None: all of them). Entries are numbered pass by pass: pass p is
    entries p·L … p·L + L − 1 (fewer where a RowDeal gives the reader fewer pieces)."""

    def __init__(
        self,
        shards: ShardList | list[list[str]],
        weights: list[float] | None,
        seed: int,
        reader: int,
        readers: int,
        resampled: bool,
        deal: RowDeal | None = None,
    ):
        self.shards = shards if isinstance(shards, ShardList) else ShardList(shards)
        self.sources, self.weights, self.seed = self.shards.sources, weights, seed
        self.reader, self.readers, self.resampled, self.deal = reader, readers, resampled, deal
        self._dealt: tuple[int, list] = (-1, [])
        self._sizes: dict[str, int] = {}

    def _pass(self, number: int) -> list[tuple[str, int, int, int | None]]:
        """(url, source, first, count) of each piece of pass `number` (epoch mode)."""
        if self._dealt[0] != number:
            if self.deal is None:
                pieces: list[tuple[str, int, int, int | None]] = [
                    (url, source, 0, None)
                    for url, source in self.shards.dealt(self.seed + number, self.reader, self.readers)
                ]
            else:
                pieces = [self._piece(*piece) for piece in self.deal.pieces(number, self.reader)]
            self._dealt = (number, pieces)
        return self._dealt[1]

    def _piece(self, shard: int, first: int, count: int) -> tuple[str, int, int, int | None]:
        url, source = self.shards[shard]
        kind = kind_of_url(url)
        assert self.deal is not None  # pieces come from a deal
        if kind is not None and kind.narrow is not None:
            whole = first == 0 and count == self.deal.sizes[shard]
            return (url if whole else kind.narrow(url, first, count)), source, 0, None
        return url, source, first, count  # a tar shard: its piece's count checked against what it holds

    def size(self, url: str) -> int | None:
        """The samples the run was told or counted a shard holds (None: not known, or not a tar shard)."""
        if self.deal is None or kind_of_url(url) is not None:
            return None
        if not self._sizes:
            self._sizes = dict(zip(self.shards.urls, (int(size) for size in self.deal.sizes)))
        return self._sizes.get(url)

    def pass_length(self) -> int:
        """Entries a pass may hold: this reader's shards in an epoch, every shard where a RowDeal cuts them into
        pieces, or as many draws as there are shards (resampled)."""
        if self.resampled or self.deal is not None:
            return len(self.shards)
        return len(range(self.reader, len(self.shards), self.readers))  # the size of a deal, without dealing one

    def pass_of(self, entry: int) -> int:
        return entry // self.pass_length()

    def pass_urls(self, entry: int) -> list[str]:
        """The shards a pass can open (for the all-failed check)."""
        if self.resampled:
            return self.shards.urls
        return [url for url, *_ in self._pass(self.pass_of(entry))]

    def from_entry(self, start: int) -> Iterator[tuple[int, str, int, int, int | None]]:
        if not self.resampled:
            length = self.pass_length()
            for number in itertools.count(start // length):
                for index, (url, source, first, count) in enumerate(self._pass(number)):
                    if number * length + index >= start:
                        yield number * length + index, url, source, first, count
            return
        rng = random.Random(f"{self.seed}-{self.reader}")
        for entry in itertools.count():
            if self.weights is None:
                url, source = rng.choice(self.shards)
            else:
                source = rng.choices(range(len(self.sources)), weights=self.weights)[0]
                url = rng.choice(self.sources[source])
            if entry >= start:
                yield entry, url, source, 0, None


def shard_samples(url: str, handler, health: ShardHealth | None = None) -> Iterator[dict]:
    """Every sample of one shard, in tar order (bad shards go to the handler and the health record)."""
    return iter(tar_samples(handler=handler, health=health)(iter([{"url": url}])))


def piece_samples(
    url: str, first: int, count: int | None, handler, health: ShardHealth | None = None, size: int | None = None
) -> Iterator[dict]:
    """Samples `first` … `first + count − 1` of a shard (all of them where count is None); those before read and
    dropped undecoded. `size`: the samples the run's deal says the shard holds (a stats file's hint, or a count),
    checked against what it holds — fewer than the piece needs, or a sample past the end — DataError, since every
    reader's deal of every epoch is cut from those sizes: read on, the epoch would read a row twice or drop one."""
    samples = shard_samples(url, handler, health)
    if count is None:
        yield from samples
        return
    taken = 0
    try:
        for sample in itertools.islice(samples, first, first + count):
            taken += 1
            yield sample
        if size is None:
            return
        damaged = health is not None and url in health.cut
        if taken < count and not damaged:
            _wrong_size(url, size, f"fewer than the {first + count}")
        if first + count == size and not damaged and next(samples, None) is not None:
            _wrong_size(url, size, f"more than {size}")
    finally:
        samples.close()  # type: ignore[attr-defined]


def _wrong_size(url: str, size: int, holds: str):
    raise DataError(
        f"{url} holds {holds} samples where the run's start was told {size} (its _stats.json, or a count of a shard "
        "that has changed since): every epoch's deal is cut from those sizes, so the run stops rather than read a "
        "row twice or drop one. Correct or delete the stats file (a shard without one is counted at the start) and "
        "resume"
    )


class Reader:
    """Raw samples (dicts with __url__, __key__ and __entry__/__index__/__source__) of one reader.

    The shuffle buffer fills as webdataset's does: it starts giving samples out at `initial` and grows
    by one per two samples taken until it holds `shuffle_size` (the rule depends on the count taken,
    which is part of the state)."""

    def __init__(
        self,
        sequence: ShardSequence,
        shuffle_size: int,
        shuffle_seed: str,
        handler,
        health: ShardHealth,
        initial: int = 100,
        name: str = "this reader",
    ):
        self.sequence, self.handler, self.health, self.name = sequence, handler, health, name
        self.size, self.initial = shuffle_size, min(initial, shuffle_size)
        self.rng = random.Random(shuffle_seed)
        self.entry, self.taken, self.received = 0, 0, 0
        self.buffer: list[dict] = []

    def state_dict(self) -> dict:
        return {
            "entry": self.entry,
            "taken": self.taken,
            "received": self.received,
            "rng": self.rng.getstate(),
            "buffer": [(sample["__entry__"], sample["__index__"]) for sample in self.buffer],
        }

    def load_state_dict(self, state: dict) -> None:
        """Back to a saved position: the buffered samples re-read from their shards, in buffer order."""
        self.entry, self.taken, self.received = state["entry"], state["taken"], state["received"]
        self.rng.setstate(_as_state(state["rng"]))
        wanted: dict[int, set[int]] = {}
        for entry, index in state["buffer"]:
            wanted.setdefault(entry, set()).add(index)
        found = {}
        if wanted:
            for entry, url, source, first, count in self.sequence.from_entry(min(wanted)):
                if entry > max(wanted):
                    break
                if entry in wanted:
                    for index, sample in enumerate(
                        piece_samples(url, first, count, wds.ignore_and_continue)
                    ):  # counted when first read
                        if index in wanted[entry]:
                            found[entry, index] = _labelled(sample, entry, index, source)
        self.buffer = [found[ref] for ref in map(tuple, state["buffer"]) if ref in found]

    def __iter__(self) -> Iterator[dict]:
        resume_at, previous = self.taken, self.entry
        for entry, url, source, first, count in self.sequence.from_entry(self.entry):
            if self.sequence.pass_of(entry) != self.sequence.pass_of(previous):
                if not self.sequence.resampled:
                    yield from self._drain()
                self._end_pass(previous)
            previous = entry
            self.entry, self.taken = (
                entry,
                resume_at,
            )  # skipped samples count as taken: a state saved mid-drain keeps them
            if self.sequence.resampled and url in self.health.failed:
                continue  # gave nothing earlier in this pass
            pieces = piece_samples(url, first, count, self.handler, self.health, self.sequence.size(url))
            for index, sample in enumerate(pieces):
                if index < resume_at:
                    continue
                self.taken = index + 1
                yield from self._shuffle(_labelled(sample, entry, index, source))
            resume_at = 0
            if url in self.health.failed:
                self.health.check(self.sequence.pass_urls(entry), self.name)

    def _end_pass(self, last_entry: int) -> None:
        if not self.sequence.resampled:
            self.health.check(self.sequence.pass_urls(last_entry), self.name)
            self.health.new_pass()
        elif self.health.read_any or not self.health.failed:
            self.health.new_pass()  # failed shards get another chance; not while nothing reads at all

    def _drain(self) -> Iterator[dict]:
        """The buffer emptied at the end of a pass (uniform picks, as while filling), so a pass is a permutation
        of its samples; the next pass fills the buffer afresh from `initial`."""
        while self.buffer:
            index = self.rng.randrange(len(self.buffer))
            self.buffer[index], self.buffer[-1] = self.buffer[-1], self.buffer[index]
            yield self.buffer.pop()
        self.received = 0

    def _shuffle(self, sample: dict) -> Iterator[dict]:
        if self.size <= 1:
            yield sample
            return
        self.buffer.append(sample)
        self.received += 1
        if len(self.buffer) >= min(self.size, self.initial + self.received // 2):
            index = self.rng.randrange(len(self.buffer))
            self.buffer[index], self.buffer[-1] = self.buffer[-1], self.buffer[index]
            yield self.buffer.pop()


def _labelled(sample: dict, entry: int, index: int, source: int) -> dict:
    sample.update(__entry__=entry, __index__=index, __source__=source)
    return sample


def _as_state(saved) -> tuple:
    """random.Random.setstate wants tuples; a state that went through a checkpoint may hold lists."""
    version, internal, gauss = saved
    return version, tuple(internal), gauss
