"""A copy of each checkpoint off the node (`checkpoint.remote=URL`): any fsspec URL — `s3://bucket/runs/x`,
`gs://...`, `az://...`, a mounted path. A node's local disk dies with the node; the remote copy lets a job
requeued onto a fresh node, with an empty run directory, continue (`resume=auto` takes the newest of local and
remote).

    <URL>/step_XXXXXXXX.dcp/<the checkpoint's files>, then COMPLETE   (written last: a copy without it is partial)
    <URL>/logs/train_log.jsonl, metrics.jsonl, train.log             (the run's logs, after each copy and at the end)

Uploads run on rank 0 in a background thread, one checkpoint after another, from hard links taken when the
checkpoint was published (retention may remove the local folder meanwhile). A failed upload is retried
(`checkpoint.remote_retries` times, waiting 1, 2, 4, ... s), then reported as a warning; it never touches the
local copy and never stops training. The newest `keep_checkpoints` complete copies are kept remotely too.
The run's logs follow each copy (whole lines only) and the end of the run, so a fresh node's run directory gets
its history back with the checkpoint (`fetch_logs`: rows after the checkpoint's step are then rewound as on any
resume); `clipdist report` on it draws the whole run.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import shutil
import threading
import time
from pathlib import Path

import fsspec

from clipdist.checkpoint.run_dir import COPIED_LOGS, LOG_TOTAL_BYTES
from clipdist.checkpoint.weights import CHECKPOINT
from clipdist.errors import ConfigError, words
from clipdist.files import read_own

log = logging.getLogger(__name__)
COMPLETE = "COMPLETE"
LOGS = "logs"


def redacted(url: str) -> str:
    """`url` with the credentials of a `scheme://user:password@host` part replaced by ***."""
    return re.sub(r"://[^/@:]*:[^/@]*@", "://***@", url)


def check_remote(url: str) -> None:
    """checkpoint.remote names a file system fsspec can open here (s3:// needs s3fs, gs:// gcsfs, ...), and holds
    no credentials: a `user:secret@` in the URL would be written to the run's records, logs and W&B."""
    if redacted(url) != url:
        raise ConfigError(
            f"checkpoint.remote={redacted(url)}: the URL holds credentials (user:password@); it would be "
            "saved with the run's config and logs. Give credentials the file system's own way (S3: "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or ~/.aws; gs: GOOGLE_APPLICATION_CREDENTIALS)"
        )
    try:
        fsspec.core.url_to_fs(url)
    except (ImportError, ValueError, OSError) as error:
        raise ConfigError(
            f"checkpoint.remote={url}: {' '.join(str(error).split())[:300]} (s3:// needs "
            "`pip install s3fs`, gs:// gcsfs, az:// adlfs; a server must answer)"
        ) from None
    protocol, _ = fsspec.core.split_protocol(url)
    if protocol is None and not Path(url).expanduser().is_absolute():  # `s3:/bucket` was the folder ./s3:/bucket
        raise ConfigError(
            f"checkpoint.remote={url}: neither a URL (protocol://...) nor an absolute path, so the copies would go "
            "to a folder of that name under the working directory, on this node; give s3://bucket/path (two "
            "slashes) or a mounted path from /"
        )


def whole_lines(path: Path) -> bytes:
    """A log's bytes up to its last newline: a line being appended is left for the next copy."""
    data = read_own(path, LOG_TOTAL_BYTES)
    return data[: data.rfind(b"\n") + 1]


class RemoteCopies:
    def __init__(
        self, url: str, keep: int = 3, retries: int = 3, backoff_s: float = 1.0, run_dir: str | Path | None = None
    ):
        self.url = url.rstrip("/")
        self.run_dir = Path(run_dir) if run_dir is not None else None  # whose logs follow the copies
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.root = self.root.rstrip("/")
        self.keep, self.retries, self.backoff_s = keep, retries, backoff_s
        self.failures = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def checkpoints(self) -> list[tuple[int, str]]:
        """(step, remote folder) of every complete remote checkpoint, newest first."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            match = CHECKPOINT.search(entry.rstrip("/").rsplit("/", 1)[-1])  # (not logs/)
            if match and match.group(2) == "dcp" and self.fs.exists(f"{entry.rstrip('/')}/{COMPLETE}"):
                found.append((int(match.group(1)), entry.rstrip("/")))
        return sorted(found, reverse=True)

    def fetch(self, remote: str, directory: Path) -> Path:
        """Download the remote checkpoint folder `remote` into `directory` (whole or not at all); its local path."""
        name = remote.rsplit("/", 1)[-1]
        final, partial = directory / name, directory / f".{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            for path in self.fs.ls(remote, detail=False):
                file = path.rstrip("/").rsplit("/", 1)[-1]
                if file != COMPLETE:
                    self.fs.get_file(path, str(partial / file))
            os.replace(partial, final)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return final

    def fetch_logs(self, run_dir: Path) -> list[str]:
        """The remote logs into `run_dir` where the local one is missing or shorter (an append-only log: the
        longer holds the other); the names of those fetched."""
        fetched = []
        for name in COPIED_LOGS:
            remote, local = f"{self.root}/{LOGS}/{name}", run_dir / name
            if not self.fs.exists(remote) or (local.exists() and local.stat().st_size >= self.fs.size(remote)):
                continue
            partial = run_dir / f".{name}.partial"
            self.fs.get_file(remote, str(partial))
            os.replace(partial, local)
            fetched.append(name)
        return fetched

    def upload(self, folder: Path) -> None:
        """Queue a copy of the published checkpoint `folder` (hard links now: the folder may be retired before
        the upload runs)."""
        snapshot = folder.parent / f".{folder.name}.upload"
        shutil.rmtree(snapshot, ignore_errors=True)
        snapshot.mkdir()
        for file in folder.iterdir():
            os.link(file, snapshot / file.name)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="clipdist-remote-copies", daemon=True)
            self._thread.start()
        self._queue.put((folder.name, snapshot))

    def close(self, timeout_s: float = 600) -> None:
        """Wait (at most `timeout_s`) for the queued uploads and the logs' last copy; say what did not reach the
        remote."""
        if self._thread is None:
            return
        self._queue.put(LOGS)
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "remote copies to %s still running after %.0f s; the local checkpoints are complete",
                self.url,
                timeout_s,
            )

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            if item == LOGS:
                self._upload_logs()
                continue
            name, snapshot = item
            try:
                if self._upload_with_retries(name, snapshot):
                    self._upload_logs()
            finally:
                shutil.rmtree(snapshot, ignore_errors=True)

    def _upload_logs(self) -> None:
        """The run's logs as they are now (whole lines), beside the copies; a failure is a warning."""
        if self.run_dir is None:
            return
        try:
            for name in COPIED_LOGS:
                if (self.run_dir / name).is_file():
                    self.fs.pipe_file(f"{self.root}/{LOGS}/{name}", whole_lines(self.run_dir / name))
        except Exception as error:  # noqa: BLE001 -- the logs are a convenience: never the run's failure
            log.warning(
                "could not copy the run's logs to %s (%s); they are intact on this node",
                self.url,
                words(error) or type(error).__name__,
            )

    def _upload_with_retries(self, name: str, snapshot: Path) -> bool:
        for attempt in range(self.retries + 1):
            try:
                started = time.monotonic()
                self._upload(name, snapshot)
                log.info("copied %s to %s in %.1f s", name, self.url, time.monotonic() - started)
                self._retain()
                return True
            except Exception as error:  # noqa: BLE001 -- any failure of the copy is retried, then reported
                reason = words(error) or type(error).__name__
                if attempt < self.retries:
                    time.sleep(self.backoff_s * 2**attempt)
                    continue
                self.failures += 1
                log.warning(
                    "could not copy %s to %s after %d attempt(s) (%s); the local checkpoint is intact and "
                    "training goes on",
                    name,
                    self.url,
                    self.retries + 1,
                    reason,
                )
        return False

    def _upload(self, name: str, snapshot: Path) -> None:
        target = f"{self.root}/{name}"
        if self.fs.exists(target):
            self.fs.rm(target, recursive=True)
        self.fs.makedirs(target, exist_ok=True)  # a mounted path needs the folder; object stores ignore it
        for file in sorted(snapshot.iterdir()):
            self.fs.put_file(str(file), f"{target}/{file.name}")
        self.fs.pipe_file(f"{target}/{COMPLETE}", b"")

    def _retain(self) -> None:
        for _, old in self.checkpoints()[self.keep :]:
            self.fs.rm(old, recursive=True)
