"""`clipdist torchrun [torchrun's options] train.py [overrides]`: torchrun, ending a failed launch in one line.

torchrun (torch.distributed.run) answers a rank that exits non-zero with its agent's Python traceback and a failure
table, after the rank's own one-line error (`world=8gpu expects 8 processes ...`). This is the same launcher — its
options, rendezvous and elastic agent, run in this process through `torch.distributed.run.run` — whose failure is
one line: the first rank that failed, its exit code (the launch's own), and how many others failed with it.
"""

from __future__ import annotations

import logging
import socket
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")


def exit_code(code: int) -> int:
    """A rank's exit code as the launch's: its own, 128 + N for a rank killed by signal N (as a shell says it)."""
    return code if 0 < code < 256 else 128 - code if code < 0 else 1


def main(argv: list[str]) -> int:
    args = get_args_parser().parse_args(argv)
    for name in AGENT_LOGGERS:  # its lines for a failed rank (the failure, the SIGTERMs to the others): ours below
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(args)
    except ValueError as error:  # torchrun's own check of its options (--nproc-per-node=abc): before any rank
        print(f"clipdist torchrun: error: {' '.join(str(error).split())[:300]}", file=sys.stderr)
        return 2
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
    return 0
