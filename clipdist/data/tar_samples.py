"""Tar shards → samples, like `webdataset.tarfile_to_samples`, but a shard that is cut short, damaged
or no tar at all is reported (to the handler, with the shard and the reason) — never skipped silently.

Python's `tarfile` ends iteration silently when an archive stops at a member boundary (no
header where one should be) or meets a garbage header after the first member, so
webdataset's reader never tells its handler that a shard was truncated or corrupt. Here the
archive must end with its end-of-archive (all-zero) block; anything else is a ShardError
for the handler, which skips the rest of the shard and counts it. The samples read before
the cut are kept. A shard that gives no file at all is also recorded in the ShardHealth.
"""
from __future__ import annotations

import os
import signal
import tarfile
from pathlib import Path

import webdataset as wds
from webdataset.tariterators import group_by_keys

from clipdist.data.faults import ShardError, ShardHealth


class TruncatedShardError(tarfile.ReadError):
    """A shard stopped before its end-of-archive block, or holds a damaged header."""


class _EndCheckedTarInfo(tarfile.TarInfo):
    @classmethod
    def fromtarfile(cls, archive):
        try:
            return super().fromtarfile(archive)
        except (tarfile.EmptyHeaderError, tarfile.TruncatedHeaderError, tarfile.InvalidHeaderError) as exn:
            if archive.offset == 0:
                raise  # tarfile says "empty file" / "not a tar" itself
            raise TruncatedShardError(f"shard ends or is damaged at byte {archive.offset} "
                                      f"(no end-of-archive block): {exn}") from None


def _shard_error(url: str, exn: Exception, files: int) -> ShardError:
    if isinstance(exn, TruncatedShardError):
        return ShardError(url, f"{exn}; {files} file(s) read before it")
    if files == 0:
        return ShardError(url, f"cannot be read as a tar file ({type(exn).__name__}: {exn})")
    return ShardError(url, f"read error after {files} file(s) ({type(exn).__name__}: {exn})")


def descendants(pid: int) -> list[int]:
    """Child processes, recursively (Linux /proc; [] elsewhere)."""
    found, frontier = [], [pid]
    while frontier:
        for task in Path(f"/proc/{frontier.pop()}/task").glob("*"):
            try:
                children = [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            frontier += children
    return found


def _stop_command(stream) -> None:
    """A `pipe:` shard's command (the shell and what it started) is killed, not waited for, when reading
    stops early (a signal): webdataset's Pipe.close() would wait for it to finish."""
    process = getattr(stream, "proc", None)
    if process is not None and process.poll() is None:
        kill_tree(process.pid)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything it started."""
    for member in [*descendants(pid), pid]:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _tar_members(sources, handler, health: ShardHealth | None):
    """(fname, data) of every regular file of every shard, then {} as the end-of-shard marker."""
    for source in sources:
        url, files, stream = source["url"], 0, None
        try:
            stream = wds.gopen(url, "rb")
            with tarfile.open(fileobj=stream, mode="r|*", tarinfo=_EndCheckedTarInfo) as archive:
                for member in archive:
                    if member.isreg() and not member.name.startswith("__"):
                        files += 1
                        yield {"fname": member.name, "data": archive.extractfile(member).read(), "__url__": url}
                    archive.members = []  # streaming: keep no index
            stream.close()  # a `pipe:` shard's failing command is reported here
        except Exception as exn:  # noqa: BLE001 -- handed to the pipeline's handler, which decides
            error = _shard_error(url, exn, files)
            if files == 0 and health is not None:
                health.shard_failed(url, error.reason)
            if not handler(error):
                raise error from exn
        except BaseException:  # a signal or the generator closed mid-shard
            if stream is not None:
                _stop_command(stream)
            raise
        finally:
            if files and health is not None:
                health.shard_read()
            if stream is not None:
                try:
                    stream.close()
                except Exception:  # noqa: BLE001 -- a failure on close was reported above
                    pass
        yield {}  # never let group_by_keys join a cut-off sample to the next shard's first


def _tar_samples(sources, handler, health: ShardHealth | None = None):
    return group_by_keys(_tar_members(sources, handler, health), handler=handler)


tar_samples = wds.pipelinefilter(_tar_samples)
