"""Run train.py the way a user does, in a subprocess with a timeout."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train_command(run_dir: Path, cache_dir: Path, *overrides: str) -> list[str]:
    return [
        sys.executable, str(REPO / "train.py"), f"run_dir={run_dir}", f"data.cache_dir={cache_dir}",
        "logging.wandb=disabled", "logging.progress=false", *overrides,
    ]


def train(run_dir: Path, cache_dir: Path, *overrides: str, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})}
    return subprocess.run(train_command(run_dir, cache_dir, *overrides), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=environment)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
