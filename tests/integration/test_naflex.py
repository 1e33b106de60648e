"""NaFlex towers: exact distributed gradients with every backend at unequal rows, and token-budget batches that a
run stopped on 2 ranks continues sample for sample — the same keys at the same sequence lengths — on 1 and 4."""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import read_jsonl, train, train_until

from clipdist.cli import main as cli
from clipdist.data.batch import Batch
from clipdist.losses import BACKENDS, build
from clipdist.model.factory import create_model, create_model_for_loss, random_tokens
from clipdist.model.timm_towers import full_patches, random_patches
from clipdist.tools import plan
from clipdist.tools.gradcheck import run_gradchecks
from clipdist.tools.memory import SavedTensorMeter
from clipdist.train.step import build_step

NAFLEX = "clipdist-naflex-tiny"


@pytest.mark.parametrize(
    "world_size, local_batch, options",
    [
        (3, [1, 4, 2], {}),
        (4, [2, 3, 1, 4], {}),
        (2, [3, 4], {"chunks": 2}),
        (2, [3, 4], {"parallel": "fsdp"}),
    ],
)
def test_a_naflex_tower_gets_the_single_process_gradients_from_every_backend(world_size, local_batch, options):
    """Every row its own grid of patches (aspect ratios from 1×L to L×1, padded), unequal rows per rank."""
    for report in run_gradchecks(list(BACKENDS), world_size, local_batch, model=NAFLEX, **options):
        assert report.exact, (report.backend, report.max_rel_err, report.diagnosis)
        assert report.max_rel_err < 1e-9
        # timm resamples the position table in float32 whatever the dtype: that one gradient to float32's round-off
        assert report.float32_parameters == ["visual.trunk.embeds.pos_embed"]
        table = next(check for check in report.parameters if check.name == "visual.trunk.embeds.pos_embed")
        assert table.rel_err < 1e-6 and table.verdict == "exact"


STEPS = 8
SEQ_LENS = "data.seq_lens=[16,36]"
SCHEDULE = "+data.resolution_schedule.6=[64]"  # steps 7-8 at 64 patches: the resumes cross the switch
WORLDS = {"cpu2": 2, "local": 1, "cpu4": 4}


def naflex_overrides(world: str, *more: str) -> list[str]:
    # the budget is the first run's (2 ranks × 8 × 64 patches: 64, 28 or 16 images a batch); a resume keeps it
    return [
        "model=naflex_tiny",
        "data=web_photos",
        "data.workers=0",
        SEQ_LENS,
        SCHEDULE,
        f"world={world}",
        "world.batch_per_device=8",
        f"optim.max_steps={STEPS}",
        "eval_every=1000",
        "checkpoint_every=1000",
        "logging.sample_keys=true",
        *more,
    ]


def naflex_batches(run_dir) -> dict[int, tuple[int, list[str]]]:
    """Each step's (sequence length, global batch) as logging.sample_keys has them (the ranks' rows in rank order)."""
    steps: dict[int, dict[int, dict]] = collections.defaultdict(dict)
    for path in (run_dir / "samples").glob("rank_*.jsonl"):
        for row in read_jsonl(path):
            steps[row["step"]][int(path.stem.split("_")[1])] = row
    batches = {}
    for step, rows in steps.items():
        lengths = {row["seq_len"] for row in rows.values()}
        assert len(lengths) == 1, (step, lengths)  # every rank's rows at the batch's one length
        batches[step] = (lengths.pop(), [key for rank in sorted(rows) for key in rows[rank]["keys"]])
    return batches


@pytest.fixture(scope="module")
def whole(tmp_path_factory, cache_dir):
    """The uninterrupted run on 2 ranks."""
    run_dir = tmp_path_factory.mktemp("naflex") / "whole"
    result = train(run_dir, cache_dir, *naflex_overrides("cpu2"))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_token_budget_batches_resume_on_other_world_sizes_sample_for_sample(whole, tmp_path, cache_dir):
    expected = naflex_batches(whole)
    assert sorted(expected) == list(range(1, STEPS + 1))
    sizes = {16: 64, 36: 28, 64: 16}  # ⌊1024 / L⌋
    assert all(len(keys) == sizes[length] and "" not in keys for length, keys in expected.values())
    assert {length for step, (length, _) in expected.items() if step <= 6} == {16, 36}  # drawn, not one
    assert {length for step, (length, _) in expected.items() if step > 6} == {64}  # the schedule's
    whole_losses = np.array([row["loss"] for row in read_jsonl(whole / "train_log.jsonl")])

    stopped = tmp_path / "stopped"
    assert (
        3 <= train_until(stopped, cache_dir, naflex_overrides("cpu2"), 3) <= 6
    )  # before the switch: the resumes cross it
    for world in ("local", "cpu4"):
        run_dir = tmp_path / world
        shutil.copytree(stopped, run_dir)
        result = train(run_dir, cache_dir, *naflex_overrides(world))
        assert result.returncode == 0, result.stderr[-3000:]
        assert "cannot continue sample for sample" not in result.stderr
        assert naflex_batches(run_dir) == expected, world
        losses = np.array([row["loss"] for row in read_jsonl(run_dir / "train_log.jsonl")])
        assert len(losses) == STEPS
        assert np.max(np.abs(losses - whole_losses) / np.abs(whole_losses)) <= 1e-5, world


TIMM_ALONE = """
import sys
sys.modules["clipdist"] = sys.modules["open_clip"] = None  # neither importable: timm alone
import timm, torch
tower = timm.create_model("local-dir:" + sys.argv[1], pretrained=True).eval()
inputs = torch.load(sys.argv[2])
torch.save(tower(inputs).detach(), sys.argv[3])
"""


def test_an_export_evaluates_as_the_run_and_timm_alone_loads_its_image_tower(whole, tmp_path, cache_dir, capsys):
    export = tmp_path / "export"
    assert cli(["export", str(whole), "--out", str(export)]) == 0
    assert "timm.create_model('local-dir:" in capsys.readouterr().out
    val = "val=" + "::".join(str(path) for path in sorted((cache_dir / "web_photos").glob("val-*.tar")))
    metrics = []
    for target in (whole, export):
        assert cli(["eval", str(target), "--set", val, "--json"]) == 0
        metrics.append(json.loads(capsys.readouterr().out))
    assert metrics[0] == metrics[1]
    model = create_model(f"local-dir:{export}").eval()
    inputs = random_patches(3, 16, 64, torch.Generator().manual_seed(0))
    torch.save(inputs, tmp_path / "inputs.pt")
    subprocess.run(
        [
            sys.executable,
            "-c",
            TIMM_ALONE,
            str(export / "image_tower"),
            str(tmp_path / "inputs.pt"),
            str(tmp_path / "features.pt"),
        ],
        check=True,
        timeout=120,
    )
    torch.testing.assert_close(
        torch.load(tmp_path / "features.pt"), model.visual.trunk(inputs).detach(), rtol=0, atol=1e-6
    )


def test_plan_counts_a_naflex_step_at_the_sequence_length_it_is_given():
    measured = {
        length: plan.measure(NAFLEX, ["disco"], "fp32", progress=lambda _: None, seq_len=length) for length in (16, 64)
    }
    assert measured[64].activations.per_sample > 2 * measured[16].activations.per_sample
    torch.manual_seed(0)
    loss_fn = build("disco")
    model = create_model_for_loss(NAFLEX, loss_fn)
    with SavedTensorMeter(exclude=list(model.parameters())) as meter:  # a real step: 16 images of 64 patches
        build_step(model, loss_fn).gradients(Batch.of(full_patches(16, 16, 64), random_tokens(16, 32)))
    predicted = plan.breakdown(measured[64], "disco", 1, 16, 16)["kept_for_backward"]
    assert predicted == pytest.approx(meter.peak, rel=0.2), (predicted, meter.peak)
