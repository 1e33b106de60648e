"""The global sample order's arithmetic (clipdist/data/order.py), against a plain listing of the order."""
from __future__ import annotations

import pytest

from clipdist.data.order import SampleOrder


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
    assert [order.rank_readers(0, 48, rank, 2) for rank in range(2)] == [list(range(8))] * 2  # batch ≠ cycle: all turn up


def test_a_layout_with_more_readers_than_samples_is_refused():
    with pytest.raises(ValueError, match="3 reader\\(s\\) cannot share a cycle of 2 sample"):
        SampleOrder(3, 2)
