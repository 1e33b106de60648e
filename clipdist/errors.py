"""Failures a user can act on: shown as one line (`error: ...`), no traceback unless HYDRA_FULL_ERROR=1."""

import os
import tempfile
import time
import traceback
from contextlib import contextmanager

from clipdist.files import write_durable


class ClipdistError(Exception):
    """Base of the errors whose message says what is wrong and what to do."""


class ConfigError(ClipdistError, ValueError):
    """A config (or command-line argument) that cannot run; the message says what to change."""


class CheckpointError(ClipdistError, RuntimeError):
    """A checkpoint could not be written (disk full, permissions); earlier checkpoints are intact."""


class RunDirError(ClipdistError, OSError):
    """The run directory cannot take a log line (disk full, permissions); the checkpoints are intact."""


class OutOfMemory(ClipdistError, RuntimeError):
    """An allocation failed on a rank: the run asks more memory than its device or host has."""


def out_of_memory(error: BaseException) -> bool:
    """Whether `error` is a failed allocation: Python's MemoryError, torch's OutOfMemoryError (CUDA), or the CPU
    allocator's RuntimeError (also as a DataLoader worker's error, re-raised with its text)."""
    return (
        isinstance(error, MemoryError)
        or type(error).__name__ == "OutOfMemoryError"
        or (isinstance(error, RuntimeError) and "can't allocate memory" in str(error))
    )


class CollectiveTimeout(ClipdistError, RuntimeError):
    """A collective waited past its bound on a rank: another rank was slower, stuck or gone."""


def timed_out_collective(error: BaseException) -> bool:
    """Whether `error` is a collective that waited past its timeout (gloo's transport, NCCL's watchdog)."""
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "Timed out waiting" in text or "Watchdog caught collective operation timeout" in text
    )


def said(error: BaseException) -> str:
    """What `error` says: its str(), but an OSError the system raised as `PATH: reason` (`abc: no such file or
    directory`), not as Python words it (`[Errno 2] No such file or directory: 'abc'`). The paths are one line each
    (a name with a newline cannot forge a line, as Python's quoting kept it from doing); an OSError subclass that
    words itself (its own __str__) is said its way."""
    if type(error).__str__ is OSError.__str__ and isinstance(error, OSError) and error.errno is not None:
        if error.strerror:
            reason = error.strerror[:1].lower() + error.strerror[1:]
            paths = [one_line(str(path)) for path in (error.filename, error.filename2) if path is not None]
            return f"{' -> '.join(paths)}: {reason}" if paths else reason
    return str(error)


def words(error: BaseException, limit: int = 300) -> str:
    """An error's whole message (said) on one line (its lines joined by single spaces), printable, at most `limit`
    characters; "" where it has none."""
    return printable(" ".join(said(error).split()))[:limit]


def first_line(error: BaseException) -> str:
    """An error's first line (said), printable, at most 300 characters."""
    return one_line((said(error).splitlines() or [""])[0])[:300]


class TrainingDiverged(ClipdistError, RuntimeError):
    """Too many non-finite losses in a row: the run stops without saving and says where to go on from."""


def printable(text: str) -> str:
    """`text` with every control character but newline and tab escaped (`\\x1b`, `\\u202e`): text a file chose —
    a module name in a refused pickle, a path, a caption — cannot move the cursor, recolour or hide what a
    console or log shows after it."""
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode("ascii") for c in text)


def one_line(text: str) -> str:
    """`text` printable and on one line: newlines and tabs escaped too, so a name a file chose cannot forge a line
    of a log or a report (`skipped: ...\\nerror: ...`)."""
    return printable(text).replace("\n", "\\n").replace("\t", "\\t")


@contextmanager
def as_config_error(*errors: type[Exception]):
    """A component's ValueError (or one of `errors`) as the ConfigError the user sees, in one line."""
    caught: tuple[type[BaseException], ...] = (ValueError, *errors)
    try:
        yield
    except caught as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(str(error)) from None


def is_failure(error: BaseException) -> bool:
    """Whether `error` is a failure to report (as a bug where nothing foresaw it): an Exception, or a BaseException
    torch raises as its failure (DCP's CheckpointException). Other BaseExceptions pass: exits, Ctrl-C, a test
    framework's outcome."""
    return isinstance(error, Exception) or type(error).__module__.split(".")[0] == "torch"


def report_bug(error: BaseException, folder=None) -> str:
    """One line for an exception clipdist did not foresee: that it is a bug, and where its full traceback went —
    `clipdist-bug-<time>-<pid>.txt` in `folder` (a run directory), else the working directory, else the temporary
    folder. A failed allocation is said as what it is, not as a bug."""
    if out_of_memory(error):
        return f"out of memory: {first_line(error)}; ask less of this machine (a smaller batch) or use one with more"
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    kind = one_line(type(error).__name__)
    said = f"internal error (a bug in clipdist, not in your input): {kind}: {first_line(error)}"
    name = f"clipdist-bug-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    for place in (folder, os.getcwd(), tempfile.gettempdir()):
        if place is None:
            continue
        path = os.path.join(place, name)
        try:
            write_durable(path, text.encode("utf-8", "replace"))
        except OSError:
            continue
        return f"{said}; the traceback is in {path} — please report it with that file"
    return said
