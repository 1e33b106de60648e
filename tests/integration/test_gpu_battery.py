"""`clipdist bench gpu --tiny`: the GPU battery at tiny sizes on the CPU, every section, so that it cannot rot
before a GPU is lent (the same code runs there with ViT-B/32, B/16, L/14)."""

from __future__ import annotations

import json
import os

import pytest
from helpers import REPO, python


def test_the_battery_runs_every_section_on_the_cpu(tmp_path):
    result = python(  # `python -m clipdist bench ...` as a program (the runs it starts are fresh interpreters)
        [
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
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert not [row for row in rows if "error" in row], rows
    assert {row["section"] for row in rows} == {
        "step",
        "large batch",
        "naflex",
        "recipe",
        "fsdp",
        "checkpoint",
        "data",
        "peak",
    }
    naflex = [row for row in rows if row["section"] == "naflex"]
    assert [row["tokens_per_s"] / row["samples_per_s"] for row in naflex] == pytest.approx([16, 64])
    steps = [row for row in rows if "flops" in row]
    assert len(steps) == 9 and all(row["samples_per_s"] > 0 and 0 < row["mfu"] < 1 for row in steps), steps
    plain, recipe = [row for row in rows if row["section"] == "recipe"]
    assert "recipe=siglip2 terms" in recipe["what"] and recipe["flops"] > 2 * plain["flops"]  # the terms' forwards
    assert [row["what"].split()[2] for row in rows if row["section"] == "large batch"] == ["disco", "tiled", "siglip"]
    assert all(row["took_s"] > 0 and row["estimate_s"] > 0 for row in rows if row["section"] != "peak")
    checkpoint = next(row for row in rows if row["section"] == "checkpoint")
    assert 0 < checkpoint["stall_s"] <= checkpoint["written_s"]
    data = [row for row in rows if row["section"] == "data"]
    assert len(data) == 2 and all(row["samples_per_s"] > 0 for row in data)  # a real run, the loader alone
    loader = next(row for row in data if "bytes_per_s" in row)
    assert loader["bytes_per_s"] > 0 and loader["workers"] == 0
    page = (tmp_path / "battery.md").read_text()
    assert page.startswith("# GPU battery: CPU") and page.count("\n| ") == len(rows) + 1  # the header and a row each


def test_a_budget_skips_what_does_not_fit_and_every_row_is_written_as_it_goes(tmp_path):
    """--budget: rows whose estimate does not fit are skipped with the reason, in the JSON and the page alike."""
    from clipdist.tools import gpu_battery

    rows = gpu_battery.battery(tiny=True, steps=1, out=tmp_path / "rows.json", doc=tmp_path / "page.md", budget_s=0)
    skipped = [row for row in rows if "skipped" in row]
    assert len(skipped) == len(rows) - 1 and "needs ~" in skipped[0]["skipped"]  # all but the measured peak
    assert json.loads((tmp_path / "rows.json").read_text()) == json.loads(json.dumps(rows))
    assert (tmp_path / "page.md").read_text().count("skipped: needs") == len(skipped)


def test_resume_keeps_the_measured_rows_of_this_device_and_runs_the_rest(tmp_path):
    """--resume: a second device call keeps the first call's measured rows (not its skipped or failed ones, nor
    another device's) and spends its budget on the rest."""
    from clipdist.tools import gpu_battery

    first = gpu_battery.battery(tiny=True, steps=1, budget_s=0)
    step, fsdp, data = (
        {key: value for key, value in next(row for row in first if row["section"] == name).items() if key != "skipped"}
        for name in ("step", "fsdp", "data")
    )
    earlier = [
        {**step, "samples_per_s": 123.0, "took_s": 1.0},
        {**fsdp, "samples_per_s": 7.0, "device": "another GPU"},
        {**data, "error": "RuntimeError: it failed"},
    ]
    (tmp_path / "first.json").write_text(json.dumps(earlier))
    rows = gpu_battery.battery(tiny=True, steps=1, budget_s=0, resume=tmp_path / "first.json", out=tmp_path / "r.json")
    assert [row["what"] for row in rows] == [row["what"] for row in first]
    assert next(row for row in rows if row["section"] == "step") == earlier[0]
    assert all("skipped" in row for row in rows if row["section"] in ("fsdp", "data"))
    assert sum("skipped" in row for row in rows) == len(rows) - 2  # all but the peak and the kept row


def test_a_resume_file_that_is_not_a_batterys_rows_is_one_line(tmp_path, capsys):
    """--resume names a file the user hands over: not JSON, JSON of another shape, a FIFO, a folder, a missing
    file — each one line on stderr, exit 2, before any row runs."""
    from clipdist.cli import main as cli

    hostile = {name: tmp_path / name for name in ("text", "object", "numbers", "rows_without_labels", "missing")}
    hostile["text"].write_text("not json")
    hostile["object"].write_text('{"section": "step"}')
    hostile["numbers"].write_text("[1, 2]")
    hostile["rows_without_labels"].write_text('[{"section": 1, "what": "x"}]')
    os.mkfifo(tmp_path / "fifo")
    for path in [*hostile.values(), tmp_path / "fifo", tmp_path]:
        capsys.readouterr()
        assert cli(["bench", "gpu", "--tiny", "--budget", "0", "--resume", str(path)]) == 2, path
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("clipdist bench: error:"), (path, lines)


def test_the_default_plan_fits_seven_minutes_on_an_h100_by_its_estimates():
    """The plan's rows, in order of value, with FLOP-based estimates (989 TFLOPS: H100 / H200 SXM bf16, calibrated on
    an H200's rows): the default budget of 420 s holds every row up to the background save — the step, the real run,
    both ends of the batch curve, NaFlex, the recipe —; compile, 32k, fp16, L/14 and FSDP2 run where time is left."""
    from clipdist.tools import gpu_battery

    table = gpu_battery.estimate_table(989.0)
    lines = table.splitlines()[2:]
    totals = [float(line.rsplit("|", 2)[1].strip().rstrip(" s")) for line in lines]
    assert totals == sorted(totals) and totals[1] < 60  # B/16 and B/32 first, in seconds
    save = next(index for index, line in enumerate(lines) if line.startswith("| checkpoint:"))
    assert totals[save] <= gpu_battery.DEFAULT_BUDGET_S == 420 < totals[-1]
    assert all(" compiled" not in line for line in lines[:save]) and "65,536" in "".join(lines[:save])
    assert "ViT-B-16 bf16 × 128" in lines[0]


def test_the_chips_limit_rows_fit_one_device_call_when_sections_are_chosen(capsys):
    """`--sections step,data,checkpoint,compile,fsdp`: within run.sh's 360 s, by the estimates, every row a target of
    the chip's limit reads — the compiled B/16 step (the run's default on CUDA), FSDP2 at world 1, L/14 compiled, a
    background save, the real run; the CLI's section names are the plan's, and a name that is none is refused."""
    from clipdist.cli import main as cli
    from clipdist.cli.bench import BATTERY_SECTIONS
    from clipdist.tools import gpu_battery

    every = gpu_battery.estimate_table(989.0).splitlines()[2:]
    assert {line.split(":")[0].removeprefix("| ").replace(" ", "-") for line in every} == set(BATTERY_SECTIONS)
    chosen = gpu_battery.estimate_table(989.0, sections=["step", "data", "checkpoint", "compile", "fsdp"])
    lines = chosen.splitlines()[2:]
    assert not [line for line in lines if line.split(":")[0] in ("| large batch", "| naflex", "| recipe")]
    within = [line for line in lines if float(line.rsplit("|", 2)[1].strip().rstrip(" s")) <= 360]
    for target in ("ViT-B-16 bf16 compiled × 128", "FSDP2", "ViT-L-14 bf16 compiled", "background save", "web_photos"):
        assert any(target in line for line in within), (target, within)
    assert any("train.py started twice" in line for line in lines)
    assert cli(["bench", "gpu", "--sections", "step,nope", "--estimate-for", "989"]) == 2  # before anything runs
    error = capsys.readouterr().err.strip().splitlines()
    assert error == ["clipdist bench gpu: error: argument --sections: nope: not one of " + ", ".join(BATTERY_SECTIONS)]
    assert cli(["bench", "gpu", "--tiny", "--sections", "compile", "--budget", "0"]) == 2  # --tiny has no such row
    said = capsys.readouterr()
    assert said.out == "" and said.err.strip() == (
        "clipdist bench: error: --sections compile: this plan has none of those rows "
        "(checkpoint, data, fsdp, large-batch, naflex, recipe, step)"
    )
