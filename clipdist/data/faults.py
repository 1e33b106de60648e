"""What the readers do with bad data: skip it, count it, say where it is — and give up, with a clear
error, when a source gives nothing but failures.

Everything here lives in the process that reads (a DataLoader worker under fork, spawn or
forkserver, or the main process); nothing is shared between processes. Counts travel with
the batches (stream.Batch.counts) and are summed over ranks by the step's agreement.
"""

from __future__ import annotations

import logging
import time

from clipdist.data.samples import SampleError
from clipdist.errors import ClipdistError, one_line

log = logging.getLogger("clipdist.data")


class DataError(ClipdistError, RuntimeError):
    """The training data cannot be read: every shard failed, or nothing but bad samples in a row."""


class DataFailure:
    """A DataError carried through a DataLoader as a value (its message intact, no worker traceback)."""

    def __init__(self, message: str):
        self.message = message


def describe(exn: BaseException) -> str:
    """One line: shard, key and reason (SampleError and ShardError say all three themselves), escaped: a shard's or
    sample's name cannot move the cursor or forge a line."""
    if isinstance(exn, (SampleError, ShardError)):
        return one_line(str(exn))
    if _webdatasets(exn):  # its message alone, after the shard where webdataset knew it
        said, _stream, url = exn.args
        return one_line(f"{url + ': ' if url else ''}{type(exn).__name__}: {said}")
    return one_line(f"{type(exn).__name__}: {exn}")


def _webdatasets(exn: BaseException) -> bool:
    """Whether `exn` is a message webdataset's grouping appended (stream, url) to: (str, a stream or None, a url or
    None) — not another exception's own several arguments (an OSError's errno, a UnicodeDecodeError's five)."""
    args = exn.args
    return (
        len(args) == 3
        and isinstance(args[0], str)
        and not isinstance(args[1], (str, bytes, int))
        and (args[2] is None or isinstance(args[2], str))
    )


class ShardError(OSError):
    """A shard that cannot be read from its start (not a tar, unreadable, gone), or is cut short."""

    def __init__(self, url: str, reason: str):
        self.url, self.reason = url, reason
        super().__init__(f"{url}: {reason}")


class SkipCounter:
    """A webdataset handler: skip the bad sample (or the rest of a bad shard), warn, count — samples and
    shards apart (`samples`, `shards`: a shard that cannot be opened or is cut short is one shard, whatever
    it held).

    Warnings name the shard, the key and the reason; the first `first_warnings` are logged in
    full, later ones at most once per `every_s` seconds as a summary, so a bad source cannot
    flood the log. `max_in_a_row` skips with no good sample in between raise DataError: a
    source that gives nothing usable (wrong layout, wrong keys) stops the run in seconds
    instead of spinning. `ok()` marks a good sample; `take()` returns the (samples, shards) skipped since
    it was last called (attached to each batch).
    """

    def __init__(self, max_in_a_row: int, first_warnings: int = 10, every_s: float = 30.0):
        self.samples, self.shards, self.in_a_row, self._taken = 0, 0, 0, (0, 0)
        self.max_in_a_row, self.first_warnings, self.every_s = max_in_a_row, first_warnings, every_s
        self._last_warning, self._unreported, self.last_reason = 0.0, 0, ""

    @property
    def count(self) -> int:
        """Everything skipped: samples and shards."""
        return self.samples + self.shards

    def __call__(self, exception: Exception) -> bool:
        if isinstance(exception, ShardError):
            self.shards += 1
        else:
            self.samples += 1
        self.in_a_row += 1
        self.last_reason = describe(exception)
        self._warn()
        if self.max_in_a_row and self.in_a_row >= self.max_in_a_row:
            raise DataError(
                f"{self.in_a_row} samples in a row could not be used (data.max_skips_in_a_row="
                f"{self.max_in_a_row}); the last: {self.last_reason}. Check the shards' layout "
                "(an image + .txt per sample for training)"
            )
        return True

    def _warn(self) -> None:
        now = time.monotonic()
        if self.count <= self.first_warnings:
            suffix = "; further skips are summarised" if self.count == self.first_warnings else ""
            log.warning("skipped: %s%s", self.last_reason, suffix)
            self._last_warning = now
        elif now - self._last_warning >= self.every_s:
            log.warning(
                "skipped %d more in the last %.0f s (%d in all); the latest: %s",
                self._unreported + 1,
                now - self._last_warning,
                self.count,
                self.last_reason,
            )
            self._last_warning, self._unreported = now, 0
        else:
            self._unreported += 1

    def ok(self) -> None:
        self.in_a_row = 0

    def take(self) -> tuple[int, int]:
        """(samples, shards) skipped since the last call."""
        fresh = (self.samples - self._taken[0], self.shards - self._taken[1])
        self._taken = (self.samples, self.shards)
        return fresh


class ShardHealth:
    """Which shards gave no sample at all (not a tar, unreadable, vanished) in this reader.

    Such a shard is counted (and warned about) as one skip by the SkipCounter, and left out of the
    resampled draws until the next pass in which some shard was read; when every shard a reader has
    failed, DataError — no endless retry loop.
    """

    def __init__(self):
        self.failed: dict[str, str] = {}  # url -> reason, this pass
        self.cut: set[str] = set()  # shards cut short by damage this pass (their samples before it kept)
        self.read_any = False  # some shard gave a file in this pass

    def new_pass(self) -> None:
        self.failed.clear()
        self.cut.clear()
        self.read_any = False

    def shard_read(self) -> None:
        self.read_any = True

    def shard_failed(self, url: str, reason: str) -> None:
        self.failed[url] = reason

    def shard_cut(self, url: str) -> None:
        self.cut.add(url)

    def check(self, urls: list[str], who: str) -> None:
        """DataError if every one of `urls` failed in this pass."""
        if urls and all(url in self.failed for url in urls):
            shown = "; ".join(f"{url}: {self.failed[url]}" for url in urls[:3])
            more = f" (and {len(urls) - 3} more)" if len(urls) > 3 else ""
            raise DataError(
                f"none of the {len(urls)} shard(s) {who} reads gave a sample: {shown}{more}. "
                "Check that they are tar files (`tar tf SHARD | head`)"
            )
