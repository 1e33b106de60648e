"""The run directory: one per run, locked for the life of the run, with the run's own record of its config.

A lock is an exclusive `flock` on <run_dir>/.lock held by the process that starts the run (the
launching process for local spawns, global rank 0 under torchrun / srun). The kernel drops it
when that process ends however it ends, so a crashed or killed run leaves no stale lock behind;
the file only keeps the last holder's host, pid and start time for the message a second process
gets.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from omegaconf import OmegaConf

from clipdist.errors import ConfigError, printable
from clipdist.files import append_own, json_of, open_lock, open_own, read_lines, write_atomic


def running_holder(run_dir: str | Path) -> str | None:
    """Who holds the run directory's lock (a run in progress: "pid 123 on node4 since ..."), or None. Asked with a
    shared, non-blocking flock on a descriptor of its own, released at once."""
    try:
        with open_own(Path(run_dir) / ".lock") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return printable(handle.read(200).decode("utf-8", "replace").strip()) or "another process"
            fcntl.flock(handle, fcntl.LOCK_UN)
    except OSError:
        return None
    return None


def in_use(run_dir: str | Path, holder: str) -> ConfigError:
    """The refusal of a run directory whose lock another run holds (`holder`: its pid, node and start)."""
    return ConfigError(
        f"{run_dir} is in use by {holder}; wait for that run to end, or start another with name=<new name>"
    )


class RunLock:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / ".lock"
        self._handle = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open_lock(self.path)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise in_use(self.path.parent, holder) from None
        except OSError as error:  # ENOSYS (Lustre without -o flock), ENOLCK (NFS without a lock manager), ...
            handle.close()
            raise ConfigError(
                f"cannot lock {self.path}: its file system does not support flock ({error.strerror}); "
                "put the run on one that does with run_dir=<path> (a local disk, or Lustre mounted "
                "with -o flock)"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
        self._handle = handle
        return self

    def release(self) -> None:
        if self._handle is not None:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# What a run writes into its directory: none of it may be a link (a planted link would have the run overwrite or
# append to, or read its W&B id from, a file elsewhere).
RECORDS = (
    ".lock",
    "hydra",
    "hydra/config.yaml",
    "hydra/overrides.yaml",
    "train.log",
    "train_log.jsonl",
    "metrics.jsonl",
    "wandb_id",
    "wandb",
    "tensorboard",
    "checkpoints",
    "samples",
)


# What else a run writes at the top of its folder (report.png/.txt: tools.report; compile_cache; profile: tracking;
# a bug's traceback: errors.report_bug); a folder with anything else and no run record is not a run
OUTPUTS = ("report.png", "report.txt", "compile_cache", "profile", "lost+found")  # and a new volume's own
BUG_FILE = "clipdist-bug-"


def foreign_entries(run_dir: str | Path) -> list[str]:
    """The entries of an existing run_dir that no run writes, where it holds no run's record (hydra/config.yaml,
    written at every start that passed its checks): a folder of the user's own, which a run would write its
    checkpoints, logs and report beside (and report.png over). [] for a run's folder, or a new or empty one."""
    root = Path(run_dir)
    if not root.is_dir() or (root / "hydra" / "config.yaml").is_file():
        return []
    own = {name.split("/")[0] for name in RECORDS} | set(OUTPUTS)
    return sorted(
        entry.name for entry in root.iterdir() if entry.name not in own and not entry.name.startswith(BUG_FILE)
    )


def check_run_dir(run_dir: str | Path) -> None:
    """Before any rank starts: an existing run directory that other users may write (not a sticky /tmp-like
    folder), whose record files are links (RECORDS, the checkpoints in checkpoints/, samples/rank_*.jsonl), or that
    is a folder of other files and no run (`foreign_entries`) is refused (ConfigError) — a run writes there, and reads
    its W&B id and logs back."""
    root = Path(run_dir)
    if not root.exists():
        return
    foreign = foreign_entries(root)
    if foreign:
        shown = ", ".join(printable(name) for name in foreign[:3]) + (
            f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        )
        raise ConfigError(
            f"run_dir={root} holds files no run wrote ({shown}) and no run's record (hydra/config.yaml): a run would "
            "write its checkpoints, logs and report among them; give a new or empty folder (run_dir=<path>)"
        )
    mode = root.stat().st_mode
    if mode & 0o002 and not mode & 0o1000:
        raise ConfigError(
            f"run_dir={root}: other users can write to it (mode {mode & 0o7777:o}); a run reads its "
            f"records back from there: chmod o-w {root}, or choose another run_dir"
        )
    paths = [root / name for name in RECORDS]
    for folder in ("checkpoints", "samples"):
        if (root / folder).is_dir() and not (root / folder).is_symlink():
            paths += sorted((root / folder).iterdir())
    for path in paths:
        if path.is_symlink():
            raise ConfigError(
                f"run_dir={root}: {path.relative_to(root)} is a symbolic link (to "
                f"{os.readlink(path)!r}); a run's records are its own files: remove the link, or "
                "choose another run_dir"
            )
        if path.exists() and not (path.is_file() or path.is_dir()):  # a FIFO would hang the log's rewind
            raise ConfigError(
                f"run_dir={root}: {path.relative_to(root)} is not a regular file (a FIFO, a device or a socket); "
                "a run's records are its own files: remove it, or choose another run_dir"
            )


def write_record(run_dir: str | Path, config: dict, overrides: list[str]) -> None:
    """<run_dir>/hydra/{config,overrides}.yaml: the resolved config and the command-line overrides
    of this start (written only once its checks have passed, so a refused attempt changes nothing)."""
    record = Path(run_dir) / "hydra"
    record.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(config), record / "config.yaml")
    OmegaConf.save(OmegaConf.create(list(overrides)), record / "overrides.yaml")


LOG_LINE_BYTES, LOG_TOTAL_BYTES = 1 << 20, 1 << 30  # a log line clipdist writes is ~1 kB; a run's log, MBs


def jsonl_rows(path: str | Path) -> tuple[list[dict], int]:
    """The {"step": int, ...} rows of a run's JSONL log, and how many lines are not such a row — torn by a crash
    mid-write, over 1 MiB, nested past what the parser takes, or text that is not clipdist's: those are dropped and
    counted, never a traceback. NaN and Infinity are kept: clipdist writes them (an fp16 step's overflowed grad
    norm). Read line by line, without following a link,
    at most 1 GiB (files.read_lines): a log that is a link, a FIFO or a device is a one-line UnboundedFileError."""
    path = Path(path)
    rows: list[dict] = []
    damaged = 0
    if not path.exists() and not path.is_symlink():
        return rows, damaged
    for line in read_lines(path, LOG_LINE_BYTES, LOG_TOTAL_BYTES):
        try:
            row = json_of(line) if line is not None and line.strip() else None
        except ValueError:
            row = ...
        if line is None:
            row = ...
        if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool):
            rows.append(row)
        elif row is not None:
            damaged += 1
    return rows, damaged


def rewind_jsonl(path: str | Path, step: int) -> int:
    """Drop the rows of a {"step": ...} JSONL log after `step` (what a resumed run will log again), and any line
    that is not a row; returns how many of those there were. Written whole to a new name, then renamed."""
    path = Path(path)
    if not path.exists():
        return 0
    rows, damaged = jsonl_rows(path)
    write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows if row["step"] <= step))
    return damaged


SAMPLES = "samples"  # logging.sample_keys: <run_dir>/samples/rank_<r>.jsonl
STEP_LOGS = ("train_log.jsonl", "metrics.jsonl")
COPIED_LOGS = (
    *STEP_LOGS,
    "train.log",
)  # go off the node with the checkpoints (checkpoint.remote: clipdist.checkpoint.remote)


def log_sample_keys(
    run_dir: str | Path, rank: int, step: int, keys: list[str] | None, seq_len: int | None = None
) -> None:
    """logging.sample_keys: this rank's rows of a step's batch, one line (a step skipped as non-finite too); a NaFlex
    batch's sequence length with them."""
    path = Path(run_dir) / SAMPLES / f"rank_{rank}.jsonl"
    path.parent.mkdir(exist_ok=True)
    with append_own(path) as log_file:
        log_file.write(json.dumps({"step": step, "keys": keys, **({"seq_len": seq_len} if seq_len else {})}) + "\n")


def rewind_logs(run_dir: str | Path, step: int) -> list[str]:
    """A resumed run's logs rewound to its checkpoint's `step` (what comes after it is logged again, so no step is
    there twice); a warning for each log that held lines which are not a step's row."""
    run_dir, warnings = Path(run_dir), []
    for log_file in (
        *STEP_LOGS,
        *sorted(str(path.relative_to(run_dir)) for path in (run_dir / SAMPLES).glob("rank_*.jsonl")),
    ):
        damaged = rewind_jsonl(run_dir / log_file, step)
        if damaged:
            warnings.append(
                f"{log_file}: {damaged} line(s) that are not a step's JSON row dropped (a write torn by a crash?)"
            )
    return warnings
