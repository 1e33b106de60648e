"""A fixed background load for benchmarks' "shared machine" mode: other processes busy on the same cores,
as another job, an agent or a compile would be on a shared node."""

from __future__ import annotations

import contextlib
import subprocess
import sys

BUSY_LOOP = "while True:\n    pass\n"


@contextlib.contextmanager
def busy_processes(count: int):
    """`count` processes spinning on the CPU (normal priority, one core each at most) while the block runs;
    killed when it ends, however it ends."""
    processes = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL) for _ in range(count)]
    try:
        yield processes
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait(timeout=30)
