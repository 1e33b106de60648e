"""Tar shards → samples, like `webdataset.tarfile_to_samples`, but a cut-short shard is an error.

Python's `tarfile` ends iteration silently when an archive stops at a member boundary (no
header where one should be) or meets a garbage header after the first member, so
webdataset's reader never tells its handler that a shard was truncated or corrupt. Here the
archive must end with its end-of-archive (all-zero) block; anything else raises
`TruncatedShardError` into the handler, which skips the rest of the shard and counts it.
The samples read before the cut are kept.
"""
from __future__ import annotations

import tarfile

import webdataset as wds
from webdataset.tariterators import group_by_keys, url_opener


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


def _tar_members(sources, handler):
    """(fname, data) of every regular file of every shard, then {} as the end-of-shard marker."""
    for source in sources:
        url = source["url"]
        try:
            with tarfile.open(fileobj=source["stream"], mode="r|*", tarinfo=_EndCheckedTarInfo) as archive:
                for member in archive:
                    if member.isreg() and not member.name.startswith("__"):
                        yield {"fname": member.name, "data": archive.extractfile(member).read(), "__url__": url}
                    archive.members = []  # streaming: keep no index
        except Exception as exn:  # noqa: BLE001 -- handed to the pipeline's handler, which decides
            exn.args = (*exn.args, url)
            if not handler(exn):
                raise
        finally:
            source["stream"].close()
        yield {}  # never let group_by_keys join a cut-off sample to the next shard's first


def _tar_samples(urls, handler):
    return group_by_keys(_tar_members(url_opener(urls, handler=handler), handler), handler=handler)


tar_samples = wds.pipelinefilter(_tar_samples)
