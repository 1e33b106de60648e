"""`clipdist report RUN`: a run at a glance from its own logs — the starts and world sizes from train.log, the best
and last of each metric, one picture."""

from __future__ import annotations

import json
import os

from PIL import Image

from clipdist.cli import main as cli
from clipdist.tools.report import read_run


def a_run(folder):
    """Two starts: 40 steps on 1 rank, resumed at step 20 on 2 ranks (train.log as the console writes it)."""
    folder.mkdir()
    rows = [
        {
            "step": step,
            "loss": 4 - step / 20,
            "lr": 1e-3,
            "samples_per_s": 100.0,
            "samples_seen": 64 * step,
            "skipped_samples": 1,
            "skipped_shards": 0,
            "skipped_steps": 0,
        }
        for step in range(10, 50, 10)
    ]
    (folder / "train_log.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 5')  # torn
    evals = [
        {"step": 20, "zeroshot_top1": 0.5, "val_clip_loss": 2.5, "i2t_mean_rank": 9.0, "zeroshot_samples": 359},
        {"step": 40, "zeroshot_top1": 0.4, "val_clip_loss": 2.0, "i2t_mean_rank": 7.0, "zeroshot_samples": 359},
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in evals))
    (folder / "train.log").write_text(
        "[2026-11-25 10:00:00,000] run directory: x\n"
        "[2026-11-25 10:00:00,001] loss disco: contrastive_loss × 1; global batch 64 (1 rank(s) × 64); ddp\n"
        "[2026-11-25 10:00:30,000] resumed from x/checkpoints/step_00000020.dcp at step 20\n"
        "[2026-11-25 10:00:30,001] loss disco: contrastive_loss × 1; global batch 64 (2 rank(s) × 32); ddp\n"
        "[2026-11-25 10:01:00,000] run directory: x (step 40)\n"
    )
    return folder


def test_a_report_reads_the_starts_and_gives_the_best_and_last_of_each_metric(tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    titles, savefig = [], Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda self, *a, **k: (titles.append(self._suptitle.get_text()), savefig(self, *a, **k))
    )
    run = a_run(tmp_path / "run")
    record = read_run(run)
    assert record.starts == [(0, 1), (20, 2)] and record.seconds == 60 and len(record.train) == 4
    assert cli(["report", str(run)]) == 0
    text = (run / "report.txt").read_text()
    assert text in capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == "run run: not running, step 40, 2,560 samples seen; zeroshot_top1 0.4 at step 40"
    assert lines[1] == "train.log spans 1.0 min, 2 start(s); resumed at step 20 on 2 rank(s)"
    assert "zeroshot_top1: last 0.4 (step 40), best 0.5 (step 20)" in lines  # higher is better
    assert "val_clip_loss: last 2 (step 40), best 2 (step 40)" in lines  # lower is better
    assert "i2t_mean_rank: last 7 (step 40), best 7 (step 40)" in lines
    assert not any(line.startswith("zeroshot_samples") for line in lines)  # a count, not a metric
    assert titles == [lines[0]]  # the picture says which run it is
    with Image.open(run / "report.png") as picture:
        assert picture.format == "PNG" and picture.size[0] > 1000


def test_a_directory_without_a_training_log_is_one_line(tmp_path, capsys):
    assert cli(["report", str(tmp_path)]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("no train_log.jsonl (not a clipdist run directory, or no step logged yet)")
    )


def test_a_runs_own_logs_are_read_bounded_and_its_report_never_written_through_a_link(tmp_path, capsys):
    """What a copied or shared run directory may hold: a log line nested past the parser, one endless line, NaN,
    a FIFO or a link in place of a log, links planted at report.png / report.txt — read and written without a
    traceback, a hang, unbounded memory, or a byte outside the run."""
    import os

    from clipdist.checkpoint.run_dir import jsonl_rows, rewind_jsonl

    run = tmp_path / "run"
    a_run(run)
    log = run / "train_log.jsonl"
    with log.open("a") as file:
        file.write("\n" + "[" * 100_000 + "]" * 100_000 + "\n")  # RecursionError in json.loads
        file.write('{"step": 60, "loss": NaN}\n')
        file.write('{"step": "7"}\n{"step": true}\n')
        file.write("x" * (3 << 20) + "\n")  # over the 1 MiB line bound
        file.write(json.dumps({"step": 70, "loss": 1.0}) + "\n")
    rows, damaged = jsonl_rows(log)
    # the torn line and four of those; NaN is kept, as clipdist writes it (an fp16 step's overflowed grad norm)
    assert [row["step"] for row in rows] == [10, 20, 30, 40, 60, 70] and damaged == 5

    outside = tmp_path / "outside.txt"
    outside.write_text("theirs\n")
    for name in ("report.png", "report.txt"):
        (run / name).symlink_to(outside)
    assert cli(["report", str(run)]) == 0
    assert outside.read_text() == "theirs\n" and not (run / "report.txt").is_symlink()
    assert Image.open(run / "report.png").size[0] > 100

    rewind_jsonl(log, 40)  # the rewind writes a new file and renames it: a planted temporary name is never used
    assert [row["step"] for row in jsonl_rows(log)[0]] == [10, 20, 30, 40] and outside.read_text() == "theirs\n"

    log.unlink()
    log.symlink_to(outside)
    capsys.readouterr()
    assert cli(["report", str(run)]) == 2
    error = capsys.readouterr().err.strip()
    assert "symbolic link" in error and "theirs" not in error and "\n" not in error
    log.unlink()
    os.mkfifo(log)  # a FIFO would hang a reader that opens it plainly
    assert cli(["report", str(run)]) == 2 and "not a regular file" in capsys.readouterr().err


def test_the_headline_says_whether_the_run_is_running_and_its_result(tmp_path, capsys):
    from clipdist.checkpoint.run_dir import RunLock

    run = tmp_path / "run"
    a_run(run)
    with RunLock(run):
        assert cli(["report", str(run)]) == 0
        headline = capsys.readouterr().out.splitlines()[0]
        assert (
            headline.startswith(f"run run: RUNNING (pid {os.getpid()} on ")
            and "zeroshot_top1 0.4 at step 40" in headline
        )
    assert cli(["report", str(run)]) == 0
    assert capsys.readouterr().out.startswith("run run: not running, step 40")


def test_image_to_text_recall_over_repeated_captions_is_said_to_be_degenerate(tmp_path, capsys):
    run = tmp_path / "run"
    a_run(run)
    with (run / "metrics.jsonl").open("a") as file:
        file.write(json.dumps({"step": 50, "i2t_r1": 0.0, "val_distinct_captions": 10, "val_images": 359}) + "\n")
    assert cli(["report", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(
        line.startswith("i2t_r1:") and "degenerate: 10 distinct captions for 359 images" in line for line in lines
    )


def test_escapes_in_a_runs_logs_reach_the_report_escaped(tmp_path, capsys):
    """A metric key holding a screen clear, a window title and a forged line: printed and written escaped."""
    run = tmp_path / "run"
    a_run(run)
    key = "zeroshot\x1b[2J\x1b]0;owned\x07\nerror: forged"
    with (run / "metrics.jsonl").open("a") as file:
        file.write(json.dumps({"step": 50, key: 0.5}) + "\n")
    assert cli(["report", str(run)]) == 0
    out = capsys.readouterr().out + (run / "report.txt").read_text()
    assert "\x1b" not in out and "\x07" not in out and "\nerror: forged" not in out and "\\x1b[2J" in out
