"""`clipdist bench limit`: one core's loader and step cost per sample, the pipelined bound for the machine's cores,
and a real run as a fraction of it (small sizes: that it runs and its figures hang together)."""

from __future__ import annotations

import json

import pytest
from helpers import REPO, python


def test_the_limit_benchmark_measures_costs_a_bound_and_a_run_against_it(tmp_path, cache_dir):
    result = python(  # `python -m clipdist bench ...` as a program (the runs it starts are fresh interpreters)
        [
            "-m",
            "clipdist",
            "bench",
            "limit",
            "--data",
            "digits",
            "--ranks",
            "1",
            "--batch",
            "32",
            "--batches",
            "2",
            "--steps",
            "4",
            "--repeats",
            "2",
            "--cache-dir",
            str(cache_dir),
            "--out",
            str(tmp_path / "limit.json"),
        ],
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    [row] = json.loads((tmp_path / "limit.json").read_text())
    assert row["loader_ms"] > 0 and row["step_ms"] > 0 and row["samples_per_s"] > 0
    assert len(row["runs"]) == len(row["bounds"]) == len(row["fractions"]) == len(row["cost_rounds"]) == 2  # each pair
    for run, bound, fraction, cost in zip(row["runs"], row["bounds"], row["fractions"], row["cost_rounds"]):
        assert bound == pytest.approx(row["cores"] / (cost["loader_s"] + cost["step_s"]) * 1e3)  # the costs before it
        assert fraction == pytest.approx(run / bound)
    assert 0 < row["fraction"] == pytest.approx(sum(row["fractions"]) / 2)  # the median of two
    assert min(row["runs"]) <= row["samples_per_s"] <= max(row["runs"])
    assert "| digits | 1 |" in result.stdout
