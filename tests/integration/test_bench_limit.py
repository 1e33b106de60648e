"""`clipdist bench limit`: one core's loader and step cost per sample, the pipelined bound for the machine's cores,
and a real run as a fraction of it (small sizes: that it runs and its figures hang together)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO, own_environment


def test_the_limit_benchmark_measures_costs_a_bound_and_a_run_against_it(tmp_path, cache_dir):
    result = subprocess.run([sys.executable, "-m", "clipdist", "bench", "limit", "--data", "digits", "--ranks", "1",
                             "--batch", "32", "--batches", "2", "--steps", "4", "--repeats", "2", "--cache-dir", str(cache_dir),
                             "--out", str(tmp_path / "limit.json")],
                            capture_output=True, text=True, timeout=300, cwd=REPO, env=own_environment())
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    [row] = json.loads((tmp_path / "limit.json").read_text())
    assert row["loader_ms"] > 0 and row["step_ms"] > 0 and row["samples_per_s"] > 0
    assert row["bound"] == pytest.approx(row["cores"] / (row["loader_ms"] + row["step_ms"]) * 1e3)
    assert 0 < row["fraction"] == pytest.approx(row["samples_per_s"] / row["bound"])
    assert len(row["runs"]) == len(row["fractions"]) == len(row["cost_rounds"]) == 2  # each round kept
    assert min(row["runs"]) <= row["samples_per_s"] <= max(row["runs"])
    assert "| digits | 1 |" in result.stdout
