"""`clipdist report RUN`: a run at a glance from its own logs — the starts and world sizes from train.log, the best
and last of each metric, one picture."""

from __future__ import annotations

import json

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
    assert lines[0] == (
        "run run: step 40, 2,560 samples seen, train.log spans 1.0 min, 2 start(s); resumed at step 20 on 2 rank(s)"
    )
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
