"""`clipdist torchrun [torchrun's options] train.py [overrides]`: torchrun, ending a failed launch in one line.

torchrun (torch.distributed.run) answers a rank that exits non-zero with its agent's Python traceback and a failure
table, after the rank's own one-line error (`world=8gpu expects 8 processes ...`). This is the same launcher — its
options, rendezvous and elastic agent, run in this process through `torch.distributed.run.run` — whose failure is
one line: the first rank that failed, its exit code (the launch's own), and how many others failed with it.

torchrun checks its options in several places (the parser, the launch config, the worker spec, the rendezvous), with
ValueErrors and bare AssertionErrors alike; whatever it raises other than a rank's failure (those, and a rendezvous
that fails) is said in one line (exit 2), and an address it would connect to that does not resolve is refused
before it waits on it.
"""

from __future__ import annotations

import contextlib
import linecache
import logging
import socket
import sys
import tempfile
import traceback

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.run import get_args_parser, run

from clipdist.errors import words

AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")


def exit_code(code: int) -> int:
    """A rank's exit code as the launch's: its own, 128 + N for a rank killed by signal N (as a shell says it)."""
    return code if 0 < code < 256 else 128 - code if code < 0 else 1


def main(argv: list[str]) -> int:
    args = get_args_parser().parse_args(argv)
    for name in AGENT_LOGGERS:  # its lines for a failed rank (the failure, the SIGTERMs to the others): ours below
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        unresolved = unresolved_address(args)
        if unresolved:
            print(f"clipdist torchrun: error: {unresolved}", file=sys.stderr)
            return 2
        with _agent_log_dir(args):
            run(args)
    except ChildFailedError as failed:
        rank, first = failed.get_first_failure()
        others = len(failed.failures) - 1
        print(
            f"clipdist torchrun: error: rank {rank} exited with code {first.exitcode}"
            + (f" ({others} other rank(s) failed too)" if others else "")
            + f" on {socket.gethostname()}; the lines above are its own",
            file=sys.stderr,
        )
        return exit_code(first.exitcode)
    except SignalException as stopped:  # the launch told to stop: the ranks were sent it too
        print(f"clipdist torchrun: stopped by {stopped.sigval.name}", file=sys.stderr)
        return 128 + int(stopped.sigval)
    except Exception as error:  # noqa: BLE001 -- its options refused, its rendezvous failed: one line
        print(f"clipdist torchrun: error: {refusal(error)}", file=sys.stderr)
        return 2
    return 0


@contextlib.contextmanager
def _agent_log_dir(args):
    """The agent's per-attempt files (its error files; the ranks' streams with --redirects) in a temporary folder
    removed when the launch ends, where --log-dir names none (torchrun's own default, torchelastic_* in /tmp, is
    left behind by every launch). A failed rank's lines are on the console already."""
    if args.log_dir:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="clipdist-torchrun-") as folder:
        args.log_dir = folder
        yield


def unresolved_address(args) -> str | None:
    """The rendezvous endpoint's host or --local-addr where it does not resolve (the ranks would retry it until the
    rendezvous timeout, minutes): one line, else None."""
    static = args.rdzv_backend == "static" and not args.rdzv_endpoint  # the endpoint is --master-addr:--master-port
    endpoint = args.rdzv_endpoint and parse_rendezvous_endpoint(args.rdzv_endpoint, 29400)[0]
    hosts = [("--master-addr", args.master_addr) if static else ("--rdzv-endpoint", endpoint)]
    hosts.append(("--local-addr", args.local_addr))
    for flag, host in hosts:
        if host:
            try:
                socket.getaddrinfo(host, None)
            except (OSError, UnicodeError) as error:
                return f"{flag} {host}: the address does not resolve ({error}); give a host or IP this node reaches"
    return None


def refusal(error: BaseException) -> str:
    """torchrun's exception as one line: its message, or where it has none (a bare `raise AssertionError`), the
    condition at the raise."""
    said = words(error)
    if not said:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        above = linecache.getline(frame.filename, (frame.lineno or 1) - 1).strip()
        condition = above.split(" ", 1)[1] if above.startswith(("if ", "elif ")) else frame.line or ""
        return f"torchrun stopped the launch ({type(error).__name__} where {condition.rstrip(':')}, in {frame.name})"
    return f"torchrun stopped the launch ({type(error).__name__}: {said})"
