"""The global sample order: which sample is row i of global batch k. A function of the data, the seed and the
run's reader layout (V readers, a cycle of Λ samples) alone — not of the world size, the global batch, the
loader workers or data.pieces — so a run resumes sample for sample on any number of ranks.

The V readers (reader.py: each its own dealt shards, shuffle buffer and augmentation seeds) take turns in
cycles of Λ samples: in every cycle reader j gives the c_j = o_{j+1} − o_j samples at offsets [o_j, o_{j+1}),
o_j = ⌊jΛ/V⌋. The stream's sample S is reader j's sample n with

    q = ⌊S/Λ⌋,  o_j ≤ S mod Λ < o_{j+1},  n = q·c_j + (S mod Λ − o_j).

Global batch k of G samples, counted from the stream position S₀ it (re)started at, is S ∈ [S₀ + kG,
S₀ + (k+1)G), and rank r of N holds its rows [rG/N, (r+1)G/N).

A fresh run's layout comes from its global batch alone (`run_layout`), so two launches of one run — 1 × 64, 2 × 32
or 4 × 16, any loader workers, any CPU count — read the same global batches: P slots of G/P rows a batch and m
batches a cycle, V = P·m readers, Λ = m·G, reader j holding slot j mod P of batch ⌊j/P⌋ of every cycle. Where N
divides P every rank reads its own V/N readers, each sample once, and where W divides m its W loader workers each make
whole batches from readers of their own (`worker_readers`); elsewhere a reader whose chunk straddles two ranks' rows
is read by both, each keeping its own rows (correct, that reader decoded twice). data.readers=V instead gives Λ = G.
"""

from __future__ import annotations

import bisect
import math

MAX_PATTERN_BATCHES = 100_000  # beyond this period of (S₀ + kG) mod Λ, a rank takes every reader (correct, slower)
ROWS_PER_SLOT = 32  # a fresh run's slots: at most G/32 of them, so a reader gives a batch 32 rows or more
BATCHES_PER_CYCLE = 4  # m: 1, 2 or 4 loader workers a rank make whole batches; a rank reads 4·P/N readers


def run_layout(global_batch: int, most_readers: int | None = None) -> tuple[int, int]:
    """(V, Λ) of a fresh run from its global batch G alone: P slots — the largest divisor of G up to G/ROWS_PER_SLOT
    — and m = BATCHES_PER_CYCLE, V = P·m, Λ = m·G. `most_readers` (the shard count, where epochs deal whole shards
    because their sizes are unknown) bounds V; it depends on the data, not on the launch."""
    slots_most, per_cycle = max(1, global_batch // ROWS_PER_SLOT), BATCHES_PER_CYCLE
    if most_readers is not None:
        per_cycle = max(1, min(per_cycle, most_readers))
        slots_most = max(1, min(slots_most, most_readers // per_cycle))
    slots = next(slots for slots in range(slots_most, 0, -1) if global_batch % slots == 0)
    return slots * per_cycle, per_cycle * global_batch


class SampleOrder:
    """V readers in cycles of Λ samples (the module docstring)."""

    def __init__(self, readers: int, cycle: int):
        if readers < 1 or cycle < readers:
            raise ValueError(
                f"{readers} reader(s) cannot share a cycle of {cycle} sample(s): every reader needs at "
                "least one sample of each global batch; use fewer readers (data.readers, data.workers)"
            )
        self.readers, self.cycle = readers, cycle
        self.offsets = [j * cycle // readers for j in range(readers + 1)]

    def chunk(self, reader: int) -> int:
        """c_j: the samples reader j gives in each cycle."""
        return self.offsets[reader + 1] - self.offsets[reader]

    def position(self, reader: int, n: int) -> int:
        """S of reader j's sample n."""
        q, within = divmod(n, self.chunk(reader))
        return q * self.cycle + self.offsets[reader] + within

    def taken_before(self, reader: int, position: int) -> int:
        """How many of reader j's samples lie before stream position S."""
        q, within = divmod(position, self.cycle)
        return q * self.chunk(reader) + min(max(within - self.offsets[reader], 0), self.chunk(reader))

    def readers_in(self, start: int, end: int) -> list[int]:
        """The readers with a sample in [start, end), in stream order from `start`."""
        if end - start >= self.cycle:
            return list(range(self.readers))
        first, last = start % self.cycle, (end - 1) % self.cycle
        at = bisect.bisect_right(self.offsets, first) - 1
        to = bisect.bisect_right(self.offsets, last) - 1
        if first <= last:
            return list(range(at, to + 1))
        return list(range(at, self.readers)) + list(range(to + 1))

    def rank_readers(self, start: int, batch: int, rank: int, world_size: int) -> list[int]:
        """The readers rank r of N needs for its rows of every global batch of `batch` samples from stream
        position `start` (the pattern of (start + kG) mod Λ repeats every Λ / gcd(Λ, G) batches)."""
        rows = batch // world_size
        period = self.cycle // math.gcd(self.cycle, batch)
        if period > MAX_PATTERN_BATCHES:
            return list(range(self.readers))
        found: set[int] = set()
        for k in range(period):
            low = start + k * batch + rank * rows
            found.update(self.readers_in(low, low + rows))
            if len(found) == self.readers:
                break
        return sorted(found)

    def worker_readers(
        self, start: int, batch: int, rank: int, world_size: int, workers: int
    ) -> list[list[int]] | None:
        """Whole batches per loader worker: worker w makes rank r's rows of every global batch k ≡ w (mod W) from
        start, out of readers no other worker reads — each worker's readers; None where some reader has rows of
        batches of two workers (then every worker gives its readers' rows of every batch instead).

        With a fresh run's layout (`run_layout`: Λ = m·G, reader j holding slot j mod P of batch ⌊j/P⌋ of a cycle),
        any W dividing m gets disjoint readers where N divides P."""
        rows = batch // world_size
        span = math.lcm(self.cycle // math.gcd(self.cycle, batch), workers)
        if span > MAX_PATTERN_BATCHES:
            return None
        groups: list[set[int]] = [set() for _ in range(workers)]
        owner: dict[int, int] = {}
        for k in range(span):
            low = start + k * batch + rank * rows
            for reader in self.readers_in(low, low + rows):
                if owner.setdefault(reader, k % workers) != k % workers:
                    return None
                groups[k % workers].add(reader)
        return [sorted(group) for group in groups]


class BudgetOrder:
    """The order of a token-budget run (data/naflex.py): V readers, and every global batch k — G_k samples, from
    P_k = Σ_{i<k} G_i — is one cycle, in which reader j gives the samples at offsets [⌊jG_k/V⌋, ⌊(j+1)G_k/V⌋).
    With V = N·m readers, ⌊rm·G/V⌋ = ⌊rG/N⌋: rank r's rows are exactly its own m readers' chunks, for every G;
    on another world size a reader whose chunk straddles two ranks' rows is read by both, as in SampleOrder."""

    def __init__(self, readers: int, budget):
        if readers < 1 or readers > min(budget.sizes()):
            raise ValueError(
                f"{readers} reader(s) cannot share a global batch of {min(budget.sizes())} sample(s) (the "
                "token budget at the longest sequence): use fewer readers (data.readers, data.workers) "
                "or raise data.max_tokens_per_batch"
            )
        self.readers, self.budget = readers, budget
        self._cursors: dict[int, tuple[int, int]] = {}  # reader -> (batch k, its samples before k), as read

    def span(self, k: int) -> tuple[int, int]:
        """(P_k, G_k)."""
        return self.budget.start(k), self.budget.start(k + 1) - self.budget.start(k)

    def _chunk(self, reader: int, size: int) -> tuple[int, int]:
        """(offset, count) of reader j's chunk in a batch of `size`."""
        low = reader * size // self.readers
        return low, (reader + 1) * size // self.readers - low

    def _before(self, reader: int, k: int) -> int:
        """Reader j's samples in batches origin … k−1."""
        sizes = self.budget.sizes_before(k)
        return int(((reader + 1) * sizes // self.readers - reader * sizes // self.readers).sum())

    def taken_before(self, reader: int, position: int) -> int:
        """How many of reader j's samples lie before stream position S."""
        k = self.budget.batch_at(position)
        start, size = self.span(k)
        offset, count = self._chunk(reader, size)
        return self._before(reader, k) + min(max(position - start - offset, 0), count)

    def position(self, reader: int, n: int) -> int:
        """S of reader j's sample n (a reader reads forwards: its batch is followed, not searched again)."""
        origin = self.budget.origin
        k, before = self._cursors.get(reader, (origin, 0))
        if n < before:
            k, before = origin, 0
        while True:
            start, size = self.span(k)
            offset, count = self._chunk(reader, size)
            if n < before + count:
                self._cursors[reader] = (k, before)
                return start + offset + n - before
            k, before = k + 1, before + count

    def rank_readers(self, rank: int, world_size: int) -> list[int]:
        """The readers rank r of N needs for its rows ⌊rG/N⌋ … ⌊(r+1)G/N⌋ of a batch, for every size G a batch
        can have."""
        found: set[int] = set()
        for size in self.budget.sizes():
            low, high = rank * size // world_size, (rank + 1) * size // world_size
            found.update(j for j in range(self.readers) if self._overlaps(j, size, low, high))
        return sorted(found)

    def _overlaps(self, reader: int, size: int, low: int, high: int) -> bool:
        offset, count = self._chunk(reader, size)
        return count > 0 and offset < high and low < offset + count
