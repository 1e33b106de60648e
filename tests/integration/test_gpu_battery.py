"""`clipdist bench gpu --tiny`: the GPU battery at tiny sizes on the CPU, every section, so that it cannot rot
before a GPU is lent (the same code runs there with ViT-B/32, B/16, L/14)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO, own_environment


def test_the_battery_runs_every_section_on_the_cpu(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "clipdist",
            "bench",
            "gpu",
            "--tiny",
            "--steps",
            "2",
            "--out",
            str(tmp_path / "rows.json"),
            "--doc",
            str(tmp_path / "battery.md"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=own_environment(),
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert not [row for row in rows if "error" in row], rows
    assert {row["section"] for row in rows} == {"step", "large batch", "naflex", "fsdp", "checkpoint", "data", "peak"}
    naflex = [row for row in rows if row["section"] == "naflex"]
    assert [row["tokens_per_s"] / row["samples_per_s"] for row in naflex] == pytest.approx([16, 64])
    steps = [row for row in rows if "flops" in row]
    assert len(steps) == 6 and all(row["samples_per_s"] > 0 and 0 < row["mfu"] < 1 for row in steps), steps
    assert {row["what"].split()[2] for row in rows if row["section"] == "large batch"} == {"tiled", "siglip"}
    checkpoint = next(row for row in rows if row["section"] == "checkpoint")
    assert 0 < checkpoint["stall_s"] <= checkpoint["written_s"]
    assert next(row for row in rows if row["section"] == "data")["samples_per_s"] > 0
    page = (tmp_path / "battery.md").read_text()
    assert page.startswith("# GPU battery: CPU") and page.count("\n| ") == len(rows) + 1  # the header and a row each
