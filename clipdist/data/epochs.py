"""Epochs that are permutations: where every shard's size is known, epoch e of a run is exactly the stream's
samples [eR, (e+1)R) (R: the rows of all shards), and they are every row once — for any sizes, readers, ranks,
workers and resume points.

The order (order.py) has reader j give m_j(e) = taken_before(j, (e+1)R) − taken_before(j, eR) of epoch e's
positions. `RowDeal` makes reader j's pass e exactly those m_j(e) rows: the shards shuffled with seed + e (as
whole-shard dealing shuffles them), laid end to end, and cut into V consecutive runs of m_0(e), …, m_{V−1}(e)
rows — so a shard may be split between two readers, each reading its own piece (a table part is narrowed to its
rows; a tar shard is read from its start and the samples before the piece skipped undecoded). Each reader
empties its shuffle buffer at the end of a pass (reader.py), so its pass gives its m_j(e) rows inside epoch e's
window and nowhere else. A sample skipped as bad shifts the window by one.

Sizes: a table part's rows (its URL says them); a tar shard's from the `<shard>_stats.json` beside it that
img2dataset and `clipdist make-shards` write ({"successes": n}), else counted from a local file's member names
(~13 µs a member: 14 ms for a 360-sample shard); unknown for a remote shard (`pipe:`, URLs), or where more than
MAX_COUNTED local shards would need counting. Unknown
sizes: whole shards are dealt, and readers holding fewer rows start their next pass early (the log says so).
"""

from __future__ import annotations

import bisect
import tarfile
from pathlib import Path

import numpy as np

from clipdist.data.kinds import kind_of_url
from clipdist.data.tar_samples import count_samples
from clipdist.files import UnboundedFileError, is_remote, json_of, read_bounded

MAX_COUNTED = 2_000  # local tar shards counted file by file at the start, at most (beyond: write _stats.json)
STATS_SUFFIX = "_stats.json"
STATS_BYTES = 1 << 20
SAMPLE_BYTES = 1024  # the least a sample takes in a tar: two members' 512-byte headers


def stats_path(shard: str) -> Path:
    """The img2dataset statistics file beside a tar shard: 00000.tar -> 00000_stats.json."""
    path = Path(shard.removeprefix("file:"))
    return path.with_name(path.name.split(".", 1)[0] + STATS_SUFFIX)


def _from_stats(url: str) -> tuple[int | None, str]:
    """(the samples a shard's stats file states, or None; why None where a file was there). A statement is a hint:
    an int (not a bool) from 1 to the most the shard's bytes can hold — every sample is at least two tar members, 1 kB
    of headers — else it is not used and the shard is counted. The readers check it again against what they find
    (reader.piece_samples)."""
    path = stats_path(url)
    if not path.exists():
        return None, ""
    try:
        count = json_of(read_bounded(path, STATS_BYTES)).get("successes")
        most = Path(url.removeprefix("file:")).stat().st_size // SAMPLE_BYTES
    except (OSError, ValueError, UnboundedFileError, AttributeError):
        return None, f"{path.name} cannot be read as img2dataset's statistics"
    if type(count) is not int or not 1 <= count <= most:
        return None, f"{path.name} states {str(count)[:40]} samples; a shard of its bytes holds 1 to {most}"
    return count, ""


def shard_sizes(urls: list[str]) -> tuple[list[int] | None, str]:
    """(the samples of every shard, or None where one is unknown; how they were found, for the log)."""
    sizes: list[int | None] = []
    refused: list[str] = []
    for url in urls:
        kind = kind_of_url(url)
        if kind is not None or is_remote(url):
            sizes.append(kind.size(url) if kind is not None else None)
            continue
        size, why = _from_stats(url)
        sizes.append(size)
        refused += [why] if why else []
    missing = [index for index, size in enumerate(sizes) if size is None]
    remote = next((urls[index] for index in missing if is_remote(urls[index])), None)
    if remote is not None:
        return None, f"{remote} is remote (a remote shard's size is not read before training)"
    if len(missing) > MAX_COUNTED:
        return None, (
            f"{len(missing)} tar shards have no usable {STATS_SUFFIX} (img2dataset's, or `clipdist make-shards`'): "
            f"more than the {MAX_COUNTED} counted at the start" + (f"; {refused[0]}" if refused else "")
        )
    for index in missing:
        try:
            sizes[index] = count_samples(urls[index].removeprefix("file:"))
        except (OSError, tarfile.ReadError) as error:
            return None, f"{urls[index]} cannot be counted ({error})"
    how = f"{len(missing)} tar shard(s) counted by their member names" if missing else "their sizes known"
    if refused:
        how += f" ({len(refused)} statistics file(s) not used: {refused[0]})"
    return [int(size or 0) for size in sizes], how


def epoch_sizes(urls: list[str], resampled: bool) -> tuple[list[int] | None, str]:
    """shard_sizes for a run's training shards: none in resampled mode, which has no epochs."""
    return (None, "resampled") if resampled else shard_sizes(urls)


class RowDeal:
    """Each reader's pieces of each epoch (the module docstring): (shard index, first sample, samples)."""

    def __init__(self, sizes: list[int], seed: int, order, permutation):
        """`permutation(seed)`: the shards' order for a pass shuffled with `seed` (reader.ShardList's)."""
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.rows, self.seed, self.order, self.permutation = int(self.sizes.sum()), seed, order, permutation
        self._epoch: tuple[int, tuple] = (-1, ())
        if self.rows < 1:
            raise ValueError("the shards hold no samples")

    def _cut(self, epoch: int) -> tuple[np.ndarray, list[int], list[int]]:
        """(the shards in epoch order, where each ends in the rows laid end to end, where each reader's run
        begins: V + 1 bounds)."""
        if self._epoch[0] != epoch:
            shards = self.permutation(self.seed + epoch)
            ends = np.cumsum(self.sizes[shards]).tolist()
            low, high = epoch * self.rows, (epoch + 1) * self.rows
            bounds = [0]
            for reader in range(self.order.readers):
                taken = self.order.taken_before(reader, high) - self.order.taken_before(reader, low)
                bounds.append(bounds[-1] + taken)
            self._epoch = (epoch, (shards, ends, bounds))
        return self._epoch[1]

    def pieces(self, epoch: int, reader: int) -> list[tuple[int, int, int]]:
        """Reader j's pass `epoch`: [(shard, first sample, samples), ...] in reading order."""
        shards, ends, bounds = self._cut(epoch)
        low, high = bounds[reader], bounds[reader + 1]
        found, at = [], bisect.bisect_right(ends, low)
        while low < high:
            begins = ends[at] - int(self.sizes[shards[at]])
            take = min(high, ends[at]) - low
            if take > 0:
                found.append((int(shards[at]), low - begins, take))
            low, at = low + take, at + 1
        return found
