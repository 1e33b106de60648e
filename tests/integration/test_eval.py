"""Evaluation on the sets people have: clip_benchmark's zero-shot folders (.webp + .cls), retrieval
sets with several captions per image, mixed labelled/unlabelled shards, several sets in one run —
and an evaluation that fails never stops training."""

from __future__ import annotations

import pytest
from fixtures import caption_shards, pets
from helpers import read_jsonl, train


def webdataset_run_overrides(shards):
    return [
        "data=webdataset",
        f"data.train_shards={shards}",
        "data.workers=0",
        "data.shuffle_buffer=0",
        "world.batch_per_device=8",
        "optim.max_steps=4",
        "eval_every=2",
        "checkpoint_every=2",
        "logging.log_every=1",
    ]


def test_several_eval_sets_in_one_run_each_under_its_own_name(tmp_path):
    train_dir = caption_shards(tmp_path / "train")
    caption_shards(tmp_path / "val", shards=1, label=lambda i: i % 2)
    (tmp_path / "val" / "classnames.txt").write_text("even\nodd\n")
    pets_set = pets(tmp_path / "wds_pets")
    result = train(
        tmp_path / "run",
        tmp_path / "cache",
        *webdataset_run_overrides(train_dir),
        f"data.val_shards={tmp_path}/val",
        f"+data.eval_sets.pets={pets_set}",
    )
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
    result = train(
        tmp_path / "run", tmp_path / "cache", *webdataset_run_overrides(train_dir), f"data.val_shards={tmp_path}/val"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "evaluation of val failed (ValueError: eval set val: label 7 but only 2 class names)"
        in result.stdout + result.stderr
    )
    assert [row["eval_errors"] for row in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert (tmp_path / "run" / "checkpoints" / "step_00000004.dcp").is_dir()
    assert len(read_jsonl(tmp_path / "run" / "train_log.jsonl")) == 4


def _noise_set(folder, shards=3, per_shard=23):
    """Distinct random images, each with one or two distinct captions and a label of 3 classes; a few undecodable."""
    import io

    import numpy as np
    from fixtures import write_samples
    from PIL import Image

    generator = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for shard in range(shards):
        samples = []
        for i in range(per_shard):
            buffer = io.BytesIO()
            Image.fromarray(generator.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(buffer, format="PNG")
            captions = f"picture {shard} {i}" + (f"\nanother view of {i} in {shard}" if i % 4 == 0 else "")
            samples.append(
                {
                    "__key__": f"{shard}-{i:03d}",
                    "png": buffer.getvalue() if i != 5 else b"not a png",
                    "txt": captions.encode(),
                    "cls": str((shard + i) % 3).encode(),
                }
            )
        write_samples(folder / f"{shard}.tar", samples)
    (folder / "classnames.txt").write_text("red\ngreen\nblue\n")
    return folder


def _evaluate_on_ranks(folder, parallel):
    import torch

    from clipdist.config import DataConfig
    from clipdist.data.sources import EvalSet
    from clipdist.data.transforms import image_transforms
    from clipdist.distributed.parallel import wrap_model
    from clipdist.model.factory import create_model, get_tokenizer
    from clipdist.train.evaluate import evaluate

    torch.manual_seed(0)
    model = create_model("clipdist-tiny")
    if parallel == "fsdp":
        wrap_model(model, parallel="fsdp")
    evalset = EvalSet(
        "val",
        sorted(str(path) for path in folder.glob("*.tar")),
        ["red", "green", "blue"],
        ["a {} photo.", "a photo of {}."],
    )
    _, transform = image_transforms(model, DataConfig())
    return evaluate(
        model,
        get_tokenizer(),
        evalset,
        transform,
        torch.device("cpu"),
        max_skips_in_a_row=100,
        batch_size=8,
        lockstep=parallel == "fsdp",
    )


@pytest.mark.parametrize(
    "world_size, parallel", [(2, "ddp"), (3, "ddp"), (4, "ddp"), (2, "fsdp")]
)  # 3 shards: split by shard, and by sample at 4
def test_every_rank_evaluates_its_share_and_gets_the_one_process_metrics(tmp_path, world_size, parallel):
    from clipdist.distributed.launch import launch_local

    folder = _noise_set(tmp_path / "val")
    alone = _evaluate_on_ranks(folder, "ddp")
    assert alone["val_samples"] == 66 and alone["val_skipped"] == 3 and alone["zeroshot_samples"] == 66
    assert {"i2t_mean_rank", "i2t_median_rank", "t2i_mean_rank", "t2i_median_rank", "val_clip_loss"} <= set(alone)
    ranks = launch_local(_evaluate_on_ranks, world_size, folder, parallel, timeout_s=120)
    for metrics in ranks.values():
        assert metrics.keys() == alone.keys()
        assert metrics.pop("val_clip_loss") == pytest.approx(alone["val_clip_loss"], rel=1e-5)
        assert metrics == {key: value for key, value in alone.items() if key != "val_clip_loss"}


def test_clipdist_eval_dense_probes_a_runs_patch_tokens(tmp_path, trained_run):
    """`clipdist eval RUN --dense` (no other set): the probe's two figures, the same on a second call, written to
    --out; and a model without patch tokens refused in one line (exit 2)."""
    import json

    from clipdist.cli import main as cli

    out = tmp_path / "dense.json"
    assert cli(["eval", str(trained_run), "--dense", "--out", str(out)]) == 0
    first = json.loads(out.read_text())
    assert set(first) == {"dense/miou", "dense/patch_accuracy"}
    assert 0 < first["dense/miou"] < 1 and 0 < first["dense/patch_accuracy"] < 1
    assert cli(["eval", str(trained_run), "--dense", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == first
    assert cli(["eval", "clipdist-naflex-tiny", "--dense"]) == 2
