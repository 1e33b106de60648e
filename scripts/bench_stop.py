"""From a stop signal to the process's exit, for the default run: the time a scheduler's grace must cover
(`docker stop` waits 10 s, Kubernetes 30 s, SLURM's --signal as long as the sbatch script asks).

    python scripts/bench_stop.py [--rounds 3] [--signal TERM] [overrides ...]

Each round starts `python train.py` in a fresh run directory, waits for its first progress, sends the signal and
times the exit; then checks that a checkpoint was published. Prints each round and the median."""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_round(work: Path, signum: int, overrides: list[str], timeout_s: float = 300) -> float:
    run_dir = work / "run"
    process = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), f"run_dir={run_dir}", *overrides],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    started = time.monotonic()
    try:
        log = run_dir / "train_log.jsonl"
        while not (log.exists() and log.read_text().count("\n") >= 5):  # five steps trained
            if process.poll() is not None or time.monotonic() - started > timeout_s:
                raise RuntimeError(f"the run ended or stalled before its fifth step (exit {process.returncode})")
            time.sleep(0.05)
        sent = time.monotonic()
        process.send_signal(signum)
        process.wait(timeout=timeout_s)
        took = time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
    if not list((run_dir / "checkpoints").glob("step_*.dcp")):
        raise RuntimeError("no checkpoint was published")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--signal", default="TERM", help="TERM, USR1 (SLURM's --signal) or INT")
    parser.add_argument("overrides", nargs="*", help="train.py overrides")
    args = parser.parse_args()
    signum = getattr(signal, f"SIG{args.signal}")
    times = []
    for index in range(args.rounds):
        with tempfile.TemporaryDirectory() as work:
            times.append(one_round(Path(work), signum, args.overrides))
        print(f"round {index + 1}: SIG{args.signal} to exit {times[-1]:.2f} s, checkpoint published", flush=True)
    print(f"median {statistics.median(times):.2f} s over {len(times)} rounds")


if __name__ == "__main__":
    main()
