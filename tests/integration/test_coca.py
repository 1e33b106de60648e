"""CoCa (contrastive + captioning) trains with clipdist: exact under DDP / FSDP with unequal batches and gradient
caching (against open_clip's CoCaLoss definition at world size 1), end to end, and its export is open_clip's CoCa."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import read_jsonl, train

from clipdist.cli import main as cli
from clipdist.losses import BACKENDS
from clipdist.tools.gradcheck import run_gradchecks

COCA = "clipdist-coca-tiny"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_coca_objective_gives_ddp_the_single_process_gradients(world_size):
    """Every backend with the caption term; local batches and caption lengths differ by rank (random tokens pad at
    random places), so a per-rank token mean (open_clip's) would not be the global one."""
    sizes = [2 + rank for rank in range(world_size)]
    for report in run_gradchecks(list(BACKENDS), world_size, local_batch=sizes, model=COCA):
        assert report.exact, (report.backend, report.max_rel_err, report.diagnosis)
        decoder = [check for check in report.parameters if check.name.startswith("text_decoder.")]
        assert len(decoder) > 20 and all(check.verdict == "exact" for check in decoder)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_coca_with_gradient_caching_and_the_fp16_scaler_is_exact(parallel):
    """The caption term's gradient comes chunk by chunk in the re-forward, scaled like the features' gradients."""
    for report in run_gradchecks(
        ["tiled", "siglip"], 3, local_batch=[4, 2, 5], chunks=2, parallel=parallel, scaler=True, model=COCA
    ):
        assert report.exact, (report.backend, report.max_rel_err, report.diagnosis)


GENERATE = """
import sys
sys.modules["clipdist"] = None
import open_clip, torch
model = open_clip.create_model("local-dir:" + sys.argv[1]).eval()
assert type(model).__name__ == "CoCa", type(model)
tokens = model.generate(torch.zeros(2, 3, 32, 32), seq_len=6)
print(tuple(tokens.shape))
"""


def test_coca_trains_three_steps_on_two_ranks_and_exports_to_open_clip(tmp_path, cache_dir):
    run = tmp_path / "run"
    result = train(
        run,
        cache_dir,
        f"model.name={COCA}",
        "world=cpu2",
        "grad_cache.chunks=2",
        "loss=tiled",
        "optim.max_steps=3",
        "eval_every=3",
        "logging.log_every=1",
        "loss.caption_weight=1.5",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = read_jsonl(run / "train_log.jsonl")
    assert [row["step"] for row in log] == [1, 2, 3]
    for row in log:  # the total is the weighted sum of the logged global terms
        assert row["loss"] == pytest.approx(row["contrastive_loss"] + 1.5 * row["caption_loss"], rel=1e-5)
    metrics = read_jsonl(run / "metrics.jsonl")[-1]
    assert 0 < metrics["val_caption_loss"] < 11.5 and "val_clip_loss" in metrics  # ln(49408) = 10.8 at random
    val = next(cache_dir.rglob("digits/val-*.tar"))  # the built-in set's validation shard, as the run evaluated it
    for world in (1, 2):  # `clipdist eval` of the run: its caption loss, on one process or split over ranks
        assert (
            cli(
                [
                    "eval",
                    str(run),
                    "--set",
                    f"val={val}",
                    "--world",
                    str(world),
                    "--out",
                    str(tmp_path / f"eval{world}.json"),
                ]
            )
            == 0
        )
        evaluated = json.loads((tmp_path / f"eval{world}.json").read_text())
        assert evaluated["val_caption_loss"] == pytest.approx(metrics["val_caption_loss"], rel=1e-6), world
    assert cli(["export", str(run), "--out", str(tmp_path / "export")]) == 0
    generated = subprocess.run(
        [sys.executable, "-c", GENERATE, str(tmp_path / "export")], capture_output=True, text=True, timeout=300
    )
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert generated.stdout.strip() == "(2, 6)"
