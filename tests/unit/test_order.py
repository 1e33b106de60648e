"""The global sample order's arithmetic (clipdist/data/order.py), against a plain listing of the order."""

from __future__ import annotations

import pytest

from clipdist.data.order import BATCHES_PER_CYCLE, SampleOrder, run_layout


def listing(order: SampleOrder, cycles: int) -> list[tuple[int, int]]:
    """(reader, its sample number) of every stream position, written out cycle by cycle."""
    taken = [0] * order.readers
    out = []
    for _ in range(cycles):
        for reader in range(order.readers):
            for _ in range(order.chunk(reader)):
                out.append((reader, taken[reader]))
                taken[reader] += 1
    return out


@pytest.mark.parametrize("readers, cycle", [(1, 1), (1, 7), (4, 64), (6, 64), (3, 10), (7, 7)])
def test_positions_are_the_listing(readers, cycle):
    order = SampleOrder(readers, cycle)
    stream = listing(order, 3)
    assert sum(order.chunk(reader) for reader in range(readers)) == cycle
    for position, (reader, n) in enumerate(stream):
        assert order.position(reader, n) == position
    for position in range(len(stream) + 1):
        for reader in range(readers):
            assert order.taken_before(reader, position) == sum(1 for r, _ in stream[:position] if r == reader)
    for start in range(len(stream)):
        for end in range(start + 1, min(start + 2 * cycle, len(stream)) + 1):
            assert set(order.readers_in(start, end)) == {reader for reader, _ in stream[start:end]}


def test_ranks_of_the_starting_layout_read_their_own_readers():
    order = SampleOrder(8, 64)  # 2 ranks × 4 readers, global batch 64
    assert [order.rank_readers(0, 64, rank, 2) for rank in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [order.rank_readers(640, 64, rank, 4) for rank in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert order.rank_readers(64, 64, 0, 1) == list(range(8))
    assert [order.rank_readers(0, 64, rank, 16) for rank in (0, 1, 15)] == [[0], [0], [7]]  # halves of a reader's chunk
    assert [order.rank_readers(0, 48, rank, 2) for rank in range(2)] == [
        list(range(8))
    ] * 2  # batch ≠ cycle: all turn up


def test_a_layout_with_more_readers_than_samples_is_refused():
    with pytest.raises(ValueError, match="3 reader\\(s\\) cannot share a cycle of 2 sample"):
        SampleOrder(3, 2)


@pytest.mark.parametrize(
    "ranks, per_rank, workers, start",
    [(1, 4, 2, 0), (1, 4, 4, 0), (2, 4, 2, 0), (2, 4, 4, 3 * 24), (2, 6, 3, 24), (3, 2, 2, 5 * 36), (1, 4, 1, 0)],
)
def test_workers_make_whole_batches_from_readers_of_their_own(ranks, per_rank, workers, start):
    """A fresh run's layout, Λ = (V/N)·G: with W dividing the rank's readers, worker w's readers hold all of the
    rank's rows of every batch k ≡ w (mod W) from any start, and no other worker's batches — checked against the
    listing, batch by batch."""
    rows, readers = 12, ranks * per_rank
    batch = rows * ranks
    order = SampleOrder(readers, batch * per_rank)
    stream = listing(order, 4 + start // order.cycle)
    for rank in range(ranks):
        groups = order.worker_readers(start, batch, rank, ranks, workers)
        assert groups is not None and sorted(sum(groups, [])) == order.rank_readers(start, batch, rank, ranks)
        for k in range(2 * per_rank):
            low = start + k * batch + rank * rows
            assert {reader for reader, _ in stream[low : low + rows]} <= set(groups[k % workers]), (rank, k)


@pytest.mark.parametrize("readers, cycle, batch, workers", [(4, 64, 64, 2), (4, 256, 64, 3), (6, 192, 64, 2)])
def test_workers_share_every_batch_where_a_reader_spans_two_workers_batches(readers, cycle, batch, workers):
    """Λ = G (data.readers given, or a checkpoint's layout), or a worker count that does not divide the cycle's
    batches: a reader holds rows of batches of two workers, so each worker gives its readers' rows of every batch."""
    assert SampleOrder(readers, cycle).worker_readers(0, batch, 0, 1, workers) is None


@pytest.mark.parametrize(
    "batch, most, layout",
    [(64, None, (8, 256)), (4096, None, (512, 16384)), (96, None, (12, 384)), (100, None, (8, 400)), (7, None, (4, 28))]
    + [(64, 3, (3, 192)), (4096, 100, (64, 16384)), (64, 1, (1, 64))],
)
def test_a_runs_layout_is_a_function_of_its_global_batch(batch, most, layout):
    """P slots (the largest divisor of G up to G/32) × m = 4 batches a cycle; where epochs deal whole shards, no more
    readers than shards (`most`)."""
    assert run_layout(batch, most) == layout


@pytest.mark.parametrize("batch", [64, 256, 96])
def test_in_a_runs_layout_each_reader_holds_one_slot_of_one_batch_of_each_cycle(batch):
    readers, cycle = run_layout(batch)
    order, slots, per_cycle = SampleOrder(readers, cycle), readers // (cycle // batch), cycle // batch
    stream = listing(order, 2)
    for position, (reader, _) in enumerate(stream):
        within = position % cycle
        assert reader == (within // batch) * slots + (within % batch) // (batch // slots), position
    assert per_cycle == BATCHES_PER_CYCLE


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_any_launch_of_a_runs_layout_reads_each_reader_once_and_lets_workers_make_whole_batches(ranks, workers):
    """Global batch 256: 8 slots. On 1, 2, 4 or 8 ranks each rank reads readers of its own, and 1, 2 or 4 workers
    each make whole batches — the order is the same for every one of these launches."""
    order = SampleOrder(*run_layout(256))
    mine = [order.rank_readers(0, 256, rank, ranks) for rank in range(ranks)]
    assert sorted(sum(mine, [])) == list(range(order.readers))
    for rank in range(ranks):
        groups = order.worker_readers(0, 256, rank, ranks, workers)
        assert groups is not None and sorted(sum(groups, [])) == mine[rank]
