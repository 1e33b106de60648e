"""Evaluation on the sets people have: clip_benchmark's zero-shot folders (.webp + .cls), retrieval
sets with several captions per image, mixed labelled/unlabelled shards, several sets in one run —
and an evaluation that fails never stops training."""
from __future__ import annotations

from fixtures import caption_shards, pets
from helpers import read_jsonl, train


def webdataset_run_overrides(shards):
    return ["data=webdataset", f"data.train_shards={shards}", "data.workers=0", "data.shuffle_buffer=0",
            "world.batch_per_device=8", "optim.max_steps=4", "eval_every=2", "checkpoint_every=2", "logging.log_every=1"]



def test_several_eval_sets_in_one_run_each_under_its_own_name(tmp_path):
    train_dir = caption_shards(tmp_path / "train")
    caption_shards(tmp_path / "val", shards=1, label=lambda i: i % 2)
    (tmp_path / "val" / "classnames.txt").write_text("even\nodd\n")
    pets_set = pets(tmp_path / "wds_pets")
    result = train(tmp_path / "run", tmp_path / "cache", *webdataset_run_overrides(train_dir),
                   f"data.val_shards={tmp_path}/val", f"+data.eval_sets.pets={pets_set}")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [2, 4]
    assert rows[-1]["zeroshot_samples"] == 16 and "i2t_r10" in rows[-1]  # the main set: names as ever
    assert rows[-1]["pets/zeroshot_samples"] == 6 and "pets/i2t_r1" not in rows[-1]
    assert rows[-1]["eval_errors"] == 0


def test_an_evaluation_that_fails_is_counted_and_training_goes_on(tmp_path):
    train_dir = caption_shards(tmp_path / "train")
    # The first sample passes the check before training; a later label has no class name: evaluate() fails.
    caption_shards(tmp_path / "val", shards=1, label=lambda i: 0 if i == 0 else 7)
    (tmp_path / "val" / "classnames.txt").write_text("even\nodd\n")
    result = train(tmp_path / "run", tmp_path / "cache", *webdataset_run_overrides(train_dir),
                   f"data.val_shards={tmp_path}/val")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "evaluation of val failed (ValueError: eval set val: label 7 but only 2 class names)" in result.stdout + result.stderr
    assert [row["eval_errors"] for row in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert (tmp_path / "run" / "checkpoints" / "step_00000004.dcp").is_dir()
    assert len(read_jsonl(tmp_path / "run" / "train_log.jsonl")) == 4


