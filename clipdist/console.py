"""One console convention under every launcher (alone, local ranks, torchrun, srun, submitit):

- progress and results (INFO) on stdout, warnings and errors on stderr as `warning: ...` / `error: ...`;
- every one of those lines also in <run_dir>/train.log, with its time, the run's final error included;
- lines go through tqdm.write, so a progress bar on the terminal stays intact.

The main rank says INFO; every rank may warn (a data warning names its rank: `warning: rank 1: skipped: ...`). Python
warnings
(torch's, webdataset's) are routed through the same handlers.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from tqdm import tqdm

from clipdist.errors import printable

LOG_FILE = "train.log"
PREFIX = {logging.WARNING: "warning: ", logging.ERROR: "error: ", logging.CRITICAL: "error: "}


_RANK = ""  # "rank N: " in a run of several ranks (name_rank), for the data warnings any rank may give


def name_rank(rank: int, world_size: int) -> None:
    """From here on (and in what this process forks: its loader workers), data warnings say which rank gave them."""
    global _RANK
    _RANK = f"rank {rank}: " if world_size > 1 else ""


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = PREFIX.get(record.levelno, "")
        if record.name.startswith("clipdist.data") and record.levelno >= logging.WARNING:
            prefix += _RANK
        record.__dict__["prefix"] = prefix  # %(prefix)s, as logging's own `extra=` sets a record's fields
        return printable(super().format(record).rstrip())  # a file's text cannot drive the terminal


DETAIL = {"detail": True}  # log.info(..., extra=DETAIL): a line for train.log, not the console


class ConsoleHandler(logging.Handler):
    """INFO to stdout, WARNING and above to stderr (the streams looked up as each line is written)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(_Formatter("%(prefix)s%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "detail", False) and record.levelno < logging.WARNING:
            return  # the host's internals (threads, malloc, loader priority): train.log only
        try:
            stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
            tqdm.write(self.format(record), file=stream)
            stream.flush()
        except Exception:  # noqa: BLE001 -- logging's own contract: report, never raise
            self.handleError(record)


class RunLogHandler(logging.FileHandler):
    """<run_dir>/train.log, appended to (a resumed run continues it); opened at its first line."""

    def __init__(self, path: str):
        super().__init__(path, mode="a", delay=True)
        self.setFormatter(_Formatter("[%(asctime)s] %(prefix)s%(message)s"))


def _own_write_lock() -> None:
    """In a forked child (a loader worker, a rank): tqdm's write lock replaced by one of the child's own.
    The inherited lock is a semaphore shared with the parent; a child killed while it writes a line
    (workers and ranks are stopped with SIGKILL) would leave it held, and the parent's next console line
    would wait for it forever."""
    tqdm.set_lock(threading.RLock())


os.register_at_fork(after_in_child=_own_write_lock)


def configure(main: bool) -> None:
    """Install the console on the root logger (replacing what an earlier call installed, the run log
    included, so an in-process second run starts clean); clipdist's INFO only from the main rank."""
    _remove(ConsoleHandler, RunLogHandler)
    root = logging.getLogger()
    root.addHandler(ConsoleHandler())
    root.setLevel(logging.WARNING)
    logging.getLogger("clipdist").setLevel(logging.INFO if main else logging.WARNING)
    logging.getLogger("hydra").setLevel(logging.INFO)
    logging.captureWarnings(True)


def open_run_log(path: str | os.PathLike) -> None:
    """From here on, every console line also goes to `path` (<run_dir>/train.log): called once the start's
    checks have passed, so a refused attempt adds nothing to a run it was refused to touch."""
    close_run_log()
    logging.getLogger().addHandler(RunLogHandler(str(path)))


def close_run_log() -> None:
    """Stop writing to the run log (an in-process caller that outlives the run)."""
    _remove(RunLogHandler)


def _remove(*kinds: type) -> None:
    root = logging.getLogger()
    for handler in [handler for handler in root.handlers if isinstance(handler, kinds)]:
        root.removeHandler(handler)
        handler.close()


def run_log() -> str | None:
    """The run log the root logger writes to, if any (for ranks started afresh to write to it too)."""
    return next(
        (handler.baseFilename for handler in logging.getLogger().handlers if isinstance(handler, RunLogHandler)), None
    )
