"""An epoch is a permutation of the rows for every layout (data/epochs.py): shards of any sizes (empty ones too)
over any number of readers, ranks and loader workers — the order's readers V and cycle Λ are what those make, or a
NaFlex token budget's batches of varying size —
and readers stopped and resumed anywhere. The property test drives the real order, deal, shard sequence and
reader (its shuffle buffer and end-of-pass drain) with the shards' bytes stood in by their row numbers; the stream
tests read a real table end to end."""

from __future__ import annotations

import random

import pytest
from fixtures import image_bytes
from helpers import identity_transform, train_stream

from clipdist.data import reader as reader_module
from clipdist.data.epochs import RowDeal, shard_sizes, stats_path
from clipdist.data.faults import ShardHealth
from clipdist.data.naflex import TokenBudget
from clipdist.data.order import BudgetOrder, SampleOrder, run_layout
from clipdist.data.reader import Reader, ShardList, ShardSequence
from clipdist.data.tables import table_parts
from clipdist.registry.kinds import TableOptions

LAYOUTS = 240


def rows_of(sizes: list[int]) -> list[list[int]]:
    """Shard i's rows, numbered through all shards."""
    out, row = [], 0
    for size in sizes:
        out.append(list(range(row, row + size)))
        row += size
    return out


def layout(rng: random.Random) -> dict:
    """A run's shards and order as TrainStream makes them: N ranks × m readers each (V = N·m), a global batch G = N·b,
    the cycle (V/N)·G for a fresh run, or G where data.readers is given."""
    ranks, per_rank, rows_each = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3]), rng.choice([1, 2, 5, 8])
    readers = ranks * per_rank
    batch = ranks * rows_each
    cycle = per_rank * batch if rng.random() < 0.5 else batch
    if cycle < readers:
        cycle = readers * rows_each
    sizes = [rng.choice([0, 1, 3, 7, 20, 64, 100]) for _ in range(rng.randint(1, 9))]
    if not sum(sizes):
        sizes[0] = 5
    return {
        "sizes": sizes,
        "readers": readers,
        "cycle": cycle,
        # a NaFlex token budget in a quarter of them: batches of max_tokens // L_k samples, L_k drawn per batch
        "budget": 64 * readers * rng.choice([1, 2, 3]) if rng.random() < 0.25 else None,
        "buffer": rng.choice([0, 1, 4, 50]),
        "seed": rng.randrange(1000),
        "stops": sorted(rng.sample(range(1, 3 * sum(sizes)), k=min(3, 3 * sum(sizes) - 1))),
    }


def read_stream(case: dict, monkeypatch, epochs: int = 3) -> list[int]:
    """The global stream's first `epochs` × R samples (as row numbers), each reader stopped and resumed from its
    state at the case's stops."""
    rows = rows_of(case["sizes"])
    urls = [f"shard-{index}" for index in range(len(rows))]

    def piece_samples(url, first, count, handler, health=None, size=None):
        shard = rows[urls.index(url)]
        for row in shard[first : len(shard) if count is None else first + count]:
            yield {"__key__": str(row), "__url__": url, "row": row}

    monkeypatch.setattr(reader_module, "piece_samples", piece_samples)
    if case["budget"]:
        order = BudgetOrder(case["readers"], TokenBudget([16, 36, 64], [1, 2, 1], case["budget"], seed=case["seed"]))
    else:
        order = SampleOrder(case["readers"], case["cycle"])
    shards = ShardList([urls])
    deal = RowDeal(case["sizes"], case["seed"], order, shards.permutation)
    total = epochs * deal.rows

    def fresh(index: int) -> Reader:
        sequence = ShardSequence(shards, None, case["seed"], index, order.readers, False, deal)
        return Reader(sequence, case["buffer"], f"{case['seed']}-{index}", None, ShardHealth(), initial=2)

    by_reader = []
    for index in range(order.readers):
        wanted = order.taken_before(index, total)
        taken, one = [], fresh(index)
        samples = iter(one)
        for stop in [*[stop for stop in case["stops"] if stop < wanted], wanted]:
            while len(taken) < stop:
                taken.append(next(samples)["row"])
            saved = one.state_dict()
            one = fresh(index)
            one.load_state_dict(saved)
            samples = iter(one)
        by_reader.append(taken)
    stream = [0] * total
    for index, taken in enumerate(by_reader):
        for n, row in enumerate(taken):
            stream[order.position(index, n)] = row
    return stream


def test_every_epoch_of_every_layout_is_every_row_once(monkeypatch):
    rng = random.Random(20261126)
    for _ in range(LAYOUTS):
        case = layout(rng)
        stream, rows = read_stream(case, monkeypatch), sum(case["sizes"])
        for epoch in range(3):
            window = stream[epoch * rows : (epoch + 1) * rows]
            assert sorted(window) == list(range(rows)), (case, epoch)
        if case["buffer"] > 1 and rows > 8:
            assert stream[:rows] != stream[rows : 2 * rows], case  # reshuffled each epoch


def test_a_layout_whose_shards_are_dealt_whole_reads_rows_twice_where_sizes_differ(monkeypatch):
    """The property fails without the deal: shards of 10 and 2 over two readers, dealt whole, give one reader's
    second pass inside the first epoch (the test above can tell)."""
    rows = rows_of([10, 2])
    urls = ["shard-0", "shard-1"]

    def piece_samples(url, first, count, handler, health=None, size=None):
        yield from ({"__key__": str(row), "row": row} for row in rows[urls.index(url)])

    monkeypatch.setattr(reader_module, "piece_samples", piece_samples)
    order = SampleOrder(2, 2)
    streams = [
        iter(Reader(ShardSequence([urls], None, 0, index, 2, False), 0, "0", None, ShardHealth())) for index in (0, 1)
    ]
    first_epoch = [next(streams[position % 2])["row"] for position in range(12)]
    assert sorted(first_epoch) != list(range(12)) and order.readers == 2


def write_table(folder, rows: int):
    (folder / "images").mkdir(parents=True)
    lines = ["filepath\ttitle"]
    for row in range(rows):
        (folder / "images" / f"{row}.png").write_bytes(image_bytes(row % 256))
        lines.append(f"images/{row}.png\trow {row}")
    (folder / "train.tsv").write_text("\n".join(lines) + "\n")
    return folder / "train.tsv"


def epoch_keys(streams, batches: int) -> list[str]:
    keys = []
    for _ in range(batches):
        for stream in streams:
            batch = next(stream)
            keys += batch.sample_keys
            stream.consumed()
    return keys


@pytest.mark.parametrize("ranks, workers", [(1, 0), (2, 0), (1, 2)])
def test_a_table_in_unequal_parts_reads_every_row_once_an_epoch(tmp_path, ranks, workers):
    """The issue's case: parts of 40 + 20 rows (data.table.rows_per_part=40), two readers a rank; on 1 or 2 ranks, with
    or without loader workers, each epoch of 60 samples is the 60 rows — twice over, reshuffled."""
    parts = table_parts(str(write_table(tmp_path, 60)), TableOptions(rows_per_part=40), "data.train_shards")
    streams = [
        train_stream(parts, 10 // ranks, identity_transform, rank=rank, world_size=ranks, readers=2, workers=workers)
        for rank in range(ranks)
    ]
    try:
        first, second = epoch_keys(streams, 6), epoch_keys(streams, 6)
    finally:
        for stream in streams:
            stream.close()
    for keys in (first, second):
        rows = sorted(int(key.rsplit("row", 1)[1]) for key in keys)
        assert rows == list(range(60)), rows
    assert "every one of the 60 rows once" in streams[0].epochs()


def test_a_table_of_one_part_runs_on_two_ranks_and_resumes_on_one(tmp_path):
    """A table no larger than data.table.rows_per_part on 2 ranks (refused before: one shard for two readers), stopped
    after 2 of its 3 batches an epoch and resumed on 1 rank: the epoch is still every row once."""
    parts = table_parts(str(write_table(tmp_path, 30)), TableOptions(rows_per_part=1000), "data.train_shards")
    assert len(parts) == 1
    two = [train_stream(parts, 5, identity_transform, rank=rank, world_size=2) for rank in range(2)]
    keys = epoch_keys(two, 2)
    saved = two[0].state_dict()
    saved["readers"] = {**saved["readers"], **two[1].state_dict()["readers"]}
    for stream in two:
        stream.close()
    one = train_stream(parts, 10, identity_transform)
    one.load_state_dict(saved)
    assert one.continued
    keys += epoch_keys([one], 1)
    one.close()
    assert sorted(int(key.rsplit("row", 1)[1]) for key in keys) == list(range(30))


def test_tar_shard_sizes_come_from_stats_files_or_are_counted(tmp_path):
    from fixtures import caption_shards

    folder = caption_shards(tmp_path / "tars", shards=2, per_shard=5)
    urls = sorted(str(path) for path in folder.glob("*.tar"))
    assert shard_sizes(urls) == ([5, 5], "2 tar shard(s) counted by their member names")
    stats_path(urls[0]).write_text('{"successes": 7}')
    assert shard_sizes(urls)[0] == [7, 5]  # a hint, taken: the readers check it (below)
    sizes, why = shard_sizes([*urls, "pipe:cat x.tar"])
    assert sizes is None and "pipe:cat x.tar is remote" in why


@pytest.mark.parametrize(
    "stated", ["0", "-1", "true", "7.0", '"7"', "1000000000000", str(2**62), "1e30", "[" * 5000 + "]" * 5000, "{"]
)
def test_a_stats_file_is_a_bounded_typed_hint_else_the_shard_is_counted(tmp_path, stated):
    """A count that is not an int from 1 to what the shard's bytes can hold (a bool, a float, 0, 10^12, nested
    JSON past the parser's depth) is not used: the shard is counted instead, and the log says why."""
    from fixtures import caption_shards

    folder = caption_shards(tmp_path / "tars", shards=2, per_shard=5)
    urls = sorted(str(path) for path in folder.glob("*.tar"))
    body = stated if stated.startswith(("[", "{")) else f'{{"successes": {stated}}}'
    stats_path(urls[0]).write_text(body)
    sizes, how = shard_sizes(urls)
    assert sizes == [5, 5] and "1 statistics file(s) not used" in how, how


@pytest.mark.parametrize("stated, said", [(7, "holds fewer than the 7 samples"), (4, "holds more than 4 samples")])
def test_a_stated_size_the_shard_does_not_hold_stops_the_epoch_in_one_line(tmp_path, stated, said):
    """Read on, a wrong size would read a row twice in an epoch (too many stated) or never read the rows past it
    (too few): each reader checks its piece against the shard, and the run stops with the shard named."""
    from fixtures import caption_shards

    from clipdist.data.faults import DataError

    urls = [str(caption_shards(tmp_path / name, shards=1, per_shard=5) / "0.tar") for name in "ab"]
    stats_path(urls[0]).write_text(f'{{"successes": {stated}}}')
    stream = train_stream(urls, 2, identity_transform, readers=1, shuffle_buffer=1)
    try:
        with pytest.raises(DataError, match=said) as raised:
            epoch_keys([stream], 6)
    finally:
        stream.close()
    assert urls[0] in str(raised.value) and "Correct or delete the stats file" in str(raised.value)


def test_tar_shards_of_unequal_sizes_read_every_sample_once_an_epoch(tmp_path):
    """12 + 4 samples in two tar shards over two readers (dealt whole, one reader would start its second pass after
    4 of the epoch's 16): each epoch is the 16, the piece of a split shard read from its start, its head dropped."""
    from fixtures import caption_shards

    urls = [str(caption_shards(tmp_path / "a", shards=1, per_shard=12) / "0.tar")]
    urls.append(str(caption_shards(tmp_path / "b", shards=1, per_shard=4) / "0.tar"))
    stream = train_stream(urls, 4, identity_transform, readers=2, shuffle_buffer=8)
    try:
        epochs = [epoch_keys([stream], 4) for _ in range(3)]
    finally:
        stream.close()
    for keys in epochs:
        assert sorted(keys) == sorted(f"{url}#0-{i:03d}" for url, n in zip(urls, (12, 4)) for i in range(n)), keys
    assert epochs[0] != epochs[1]


def test_a_checkpoint_from_before_exact_epochs_restarts_the_order_and_says_why(tmp_path):
    """A stream position saved when whole shards were dealt (its layout has no "epochs") cannot go on sample for
    sample under the row deal: reshuffled, with the reason in the log's words."""
    parts = table_parts(str(write_table(tmp_path, 20)), TableOptions(rows_per_part=10), "data.train_shards")
    before = train_stream(parts, 4, identity_transform)
    saved = before.state_dict()
    saved["layout"] = {key: value for key, value in saved["layout"].items() if key != "epochs"}
    after = train_stream(parts, 4, identity_transform)
    after.load_state_dict(saved)
    assert not after.continued
    assert "epochs whole shards -> every row once (the shards' sizes are known now)" in after.restart_reason


def test_sizes_found_before_the_ranks_start_are_not_found_again(tmp_path, monkeypatch):
    """preflight finds the shards' sizes once (Shards.sizes) and each rank's stream takes them as they are."""
    from clipdist.data import stream as stream_module

    parts = table_parts(str(write_table(tmp_path, 12)), TableOptions(rows_per_part=5), "data.train_shards")

    def counted_again(*args):
        raise AssertionError("the sizes were found again")

    monkeypatch.setattr(stream_module, "epoch_sizes", counted_again)
    stream = train_stream(parts, 4, identity_transform, sizes=([5, 5, 2], "their sizes known"))
    try:
        assert "every one of the 12 rows once" in stream.epochs()
        keys = epoch_keys([stream], 3)
    finally:
        stream.close()
    assert sorted(int(key.rsplit("row", 1)[1]) for key in keys) == list(range(12))


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder"])
def test_a_stats_file_that_is_not_a_regular_file_is_not_read(tmp_path, kind):
    """A FIFO (which would block a read), a link to /dev/zero (which never ends), a folder: not a hint, never read;
    the shard is counted instead."""
    import os

    from fixtures import caption_shards

    folder = caption_shards(tmp_path / "tars", shards=2, per_shard=5)
    urls = sorted(str(path) for path in folder.glob("*.tar"))
    stats = stats_path(urls[0])
    {"fifo": lambda: os.mkfifo(stats), "dev_zero": lambda: stats.symlink_to("/dev/zero"), "folder": stats.mkdir}[kind]()
    sizes, how = shard_sizes(urls)
    assert sizes == [5, 5] and "1 statistics file(s) not used" in how, how


def test_a_fresh_runs_batches_are_the_same_on_one_two_or_four_ranks(tmp_path):
    """A run's own layout (order.run_layout) depends on its global batch alone: 1 × 64, 2 × 32 and 4 × 16 read the
    same global batches, row for row, across an epoch's end (96 rows in parts of 24; a shuffle buffer of 40 a slot,
    10 a reader)."""
    parts = table_parts(str(write_table(tmp_path, 96)), TableOptions(rows_per_part=24), "data.train_shards")
    layout = run_layout(64)
    launches = {}
    for ranks in (1, 2, 4):
        streams = [
            train_stream(
                parts,
                64 // ranks,
                identity_transform,
                rank=rank,
                world_size=ranks,
                layout=layout,
                seed=3,
                shuffle_buffer=40,
            )
            for rank in range(ranks)
        ]
        try:
            launches[ranks] = epoch_keys(streams, 2)
        finally:
            for stream in streams:
                stream.close()
    assert launches[1] == launches[2] == launches[4]
    first_epoch = sorted(int(key.rsplit("row", 1)[1]) for key in launches[1][:96])
    assert first_epoch == list(range(96)) and launches[1][:64] != sorted(launches[1][:64])
    assert streams[0].layout["buffer"] == 10
