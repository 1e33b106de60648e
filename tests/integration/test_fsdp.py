"""FSDP2 (world.parallel=fsdp): exact gradients for every backend, sharded state as planned, sharded
checkpoints that are atomic and reshard on resume, and clear errors before any rank starts."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import read_jsonl, train

from clipdist.checkpoint.manager import Checkpointer
from clipdist.config import TrainConfig
from clipdist.losses import BACKENDS
from clipdist.model.factory import create_model
from clipdist.tools import plan
from clipdist.tools.gradcheck import run_gradchecks
from clipdist.tools.memory import measure_state_bytes, state_bytes_after_a_step

TRAIN = [
    "logging.log_every=1",
    "eval_every=1000",
    "checkpoint_every=6",
    "optim.warmup_steps=2",
    "world.batch_per_device=8",
]


@pytest.mark.parametrize(
    "world_size, local_batch, chunks, reshard_after_forward",
    [(2, 4, 2, True), (3, [4, 3, 5], 1, True), (4, 3, 1, True), (3, [3, 5, 4], 3, False)],
)
def test_fsdp_gradients_match_single_process_for_every_backend(world_size, local_batch, chunks, reshard_after_forward):
    reports = run_gradchecks(
        list(BACKENDS),
        world_size,
        local_batch=local_batch,
        chunks=chunks,
        parallel="fsdp",
        reshard_after_forward=reshard_after_forward,
    )
    for report in reports:
        assert report.parallel == "fsdp" and report.reshard_after_forward is reshard_after_forward
        assert report.exact, (report.backend, report.max_rel_err, report.diagnosis)


def test_fsdp_shards_parameters_gradients_and_adamw_state_as_planned():
    measured = plan.Measurements(None, {}, 4, *plan.parameter_layout(create_model("clipdist-tiny", device="meta")))
    per_rank = {}
    for parallel, world_size in [("ddp", 1), ("fsdp", 2), ("fsdp", 4)]:  # DDP's replica is the same at any N
        ranks = (
            [state_bytes_after_a_step("clipdist-tiny", "ddp", 4)]
            if parallel == "ddp"
            else measure_state_bytes("clipdist-tiny", parallel, world_size)
        )
        per_rank[parallel, world_size] = max(sum(rank.values()) for rank in ranks)
        assert all(rank["gradients"] == rank["parameters"] for rank in ranks)  # one fp32 gradient per weight
        assert per_rank[parallel, world_size] == pytest.approx(measured.state_bytes(world_size, parallel), rel=0.2)
    assert per_rank["fsdp", 2] < 0.55 * per_rank["ddp", 1]
    assert per_rank["fsdp", 4] < 0.3 * per_rank["ddp", 1]


@pytest.mark.parametrize(
    "variant",
    [
        {"schedule": {"0": [16], "5": [32]}},
        {"terms": {"masked": {"ratio": 0.5, "start_at": 0.0, "weight": 0.25}}},
        {"terms": {"self_distill": {"crops": 2, "start_at": 0.0}}},
        {"chunks": 2},
        {"loss": "siglip"},
    ],
    ids=["resolution_schedule", "masked", "self_distill", "grad_cache", "siglip"],
)
def test_an_fsdp_runs_recipe_is_the_ddp_runs(tmp_path, variant):
    """Built as a rank builds them (one process, a group of one), an FSDP2 run and a DDP run of the same config say
    the same recipe in the banner (model, optimizer, terms, batch, captions) and make the same optimizer groups:
    FSDP2's own classes for its units changed nothing (they once stopped an FSDP2 run cutting captions)."""
    from types import SimpleNamespace

    from clipdist.tools.gpu_battery import config, one_rank_group
    from clipdist.train.parts import build_parts
    from clipdist.train.recipe import recipe

    said = {}
    variant = dict(variant)
    schedule = variant.pop("schedule", None)
    with one_rank_group(torch.device("cpu")):
        for parallel in ("ddp", "fsdp"):
            cfg = config(tmp_path / parallel, "clipdist-tiny", "fp32", 4, parallel=parallel, **variant)
            cfg.data.resolution_schedule = schedule or {}
            parts = build_parts(cfg, torch.device("cpu"))
            shards = SimpleNamespace(train=[], sources=[], evals=[])
            chunks = cfg.grad_cache.chunks_for(4)
            lines = recipe(
                cfg, parts.model, parts.step.objective, 1, chunks, "fp32", shards, trim_text=parts.step.trim_text
            )
            groups = [(len(group["params"]), group["lr"]) for group in parts.optimizer.param_groups]
            said[parallel] = ([line.removesuffix(f"; {parallel}") for line in lines], groups, parts.step.trim_text)
    assert said["fsdp"] == said["ddp"]


def test_fsdp_run_equals_ddp_and_resumes_on_another_world_size(tmp_path, cache_dir):
    losses, captions = {}, {}
    for parallel in ("ddp", "fsdp"):
        result = train(
            tmp_path / parallel, cache_dir, "world=cpu2", f"world.parallel={parallel}", "optim.max_steps=6", *TRAIN
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert "on one rank: nothing is sharded" not in result.stderr
        losses[parallel] = [row["loss"] for row in read_jsonl(tmp_path / parallel / "train_log.jsonl")]
        captions[parallel] = re.findall(r"captions padded to [^;(\n]*", result.stdout)
    assert losses["fsdp"] == pytest.approx(losses["ddp"], rel=1e-5)  # sharded = replicated
    assert captions["fsdp"] == captions["ddp"] == ["captions padded to the batch's longest"]  # as DDP's, cut
    fsdp_dir = tmp_path / "fsdp"
    assert len(list((fsdp_dir / "checkpoints" / "step_00000006.dcp").glob("*.distcp"))) == 2  # one shard file per rank

    # Resharded: the 2-rank checkpoint continues on 4 ranks (same global batch).
    resumed = train(
        fsdp_dir,
        cache_dir,
        "world=cpu4",
        "world.parallel=fsdp",
        "optim.max_steps=9",
        *TRAIN[:-1],
        "world.batch_per_device=4",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_00000006.dcp at step 6" in resumed.stdout
    assert "the data stream continues at sample" in resumed.stdout and "cannot continue" not in resumed.stderr
    log = read_jsonl(fsdp_dir / "train_log.jsonl")
    assert [row["step"] for row in log] == list(range(1, 10))
    assert log[-1]["loss"] < losses["ddp"][0] - 0.1  # went on from the trained model, not from scratch
    assert (fsdp_dir / "checkpoints" / "step_00000009.dcp").is_dir()

    # The sharded checkpoint leaves clipdist whole: exported, its weights are the model's every tensor.
    from clipdist.checkpoint.weights import read_weights
    from clipdist.cli import main as cli
    from clipdist.model.factory import create_model

    assert cli(["export", str(fsdp_dir), "--out", str(tmp_path / "exported")]) == 0
    exported, sharded = (
        read_weights(tmp_path / "exported"),
        read_weights(fsdp_dir / "checkpoints" / "step_00000009.dcp"),
    )
    assert exported.keys() == sharded.keys() == create_model("clipdist-tiny").state_dict().keys()
    assert all(torch.equal(exported[key], sharded[key]) for key in exported)


def test_fsdp_on_one_rank_trains_and_says_that_it_shards_nothing(tmp_path, cache_dir):
    kept = "world.reshard_after_forward=false"
    result = train(tmp_path / "one", cache_dir, "world=local", "world.parallel=fsdp", kept, "optim.max_steps=2", *TRAIN)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "; fsdp (gathered weights kept)\n" in result.stdout + result.stderr
    assert "warning: world.parallel=fsdp on one rank: nothing is sharded" in result.stderr
    assert "world.parallel=ddp trains the same run faster here" in result.stderr
    assert len(read_jsonl(tmp_path / "one" / "train_log.jsonl")) == 2


def _save_then_load(directory: str) -> tuple[list[str], int]:
    """On each rank: an FSDP model and AdamW after a step, saved by the Checkpointer; a fresh pair restored
    by it. The names of the tensors (weights, AdamW moments) that differ, and how many were compared."""
    from pathlib import Path

    from clipdist.checkpoint.state import TrainState
    from clipdist.config import OptimConfig
    from clipdist.data.batch import Batch
    from clipdist.distributed.launch import detect_env
    from clipdist.distributed.parallel import full_tensor, wrap_model
    from clipdist.losses import build
    from clipdist.model.factory import create_model_for_loss
    from clipdist.optim.optimizer import build_optimizer
    from clipdist.train.step import build_step

    def fresh(seed):
        torch.manual_seed(seed)
        model = wrap_model(create_model_for_loss("clipdist-tiny", build("siglip")), parallel="fsdp")
        return TrainState(model, *build_optimizer(model, OptimConfig()))

    cfg = TrainConfig(name="fsdp", run_dir=directory)
    cfg.world.parallel = "fsdp"
    checkpointer = Checkpointer(cfg, Path(directory), detect_env())
    trained = fresh(0)
    build_step(trained.model, build("siglip")).gradients(
        Batch.of(torch.randn(4, 3, 32, 32), torch.randint(0, 49408, (4, 16)))
    )
    trained.optimizer.step()
    trained.step = 1
    assert checkpointer.save(trained, wait=True)
    loaded = fresh(1)
    assert checkpointer.restore(loaded).name == "step_00000001.dcp" and loaded.step == 1
    checkpointer.close()

    def tensors(state):
        saved = state.sharded_state_dict()
        flat = dict(saved["model"])
        flat.update(
            {
                f"{name}.{key}": value
                for name, moments in saved["optimizer"]["state"].items()
                for key, value in moments.items()
            }
        )
        return {name: full_tensor(value) for name, value in flat.items()}

    before, after = tensors(trained), tensors(loaded)
    return sorted(name for name in before if not torch.equal(before[name], after[name])), len(before)


def test_sharded_checkpoint_restores_weights_and_adamw_state_exactly(tmp_path):
    from clipdist.distributed.launch import launch_local

    for differing, compared in launch_local(_save_then_load, 2, str(tmp_path), timeout_s=120).values():
        assert differing == [] and compared > 100


def test_ddp_and_fsdp_resume_each_others_checkpoints(tmp_path, cache_dir):
    """One checkpoint format: a DDP run's step-3 checkpoint continues under FSDP and an FSDP run's under DDP, each
    later step's loss the uninterrupted run's (sharded = replicated, to float32's reduction order)."""
    common = ["world=cpu2", "optim.max_steps=6", *TRAIN[:2], "checkpoint_every=3", *TRAIN[3:]]
    whole = train(tmp_path / "whole", cache_dir, *common)
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = [row["loss"] for row in read_jsonl(tmp_path / "whole" / "train_log.jsonl")]
    for first, then in (("ddp", "fsdp"), ("fsdp", "ddp")):
        run_dir = tmp_path / f"{first}-then-{then}"
        begun = train(run_dir, cache_dir, *common, f"world.parallel={first}")
        assert begun.returncode == 0, begun.stderr[-3000:]
        checkpoint = run_dir / "checkpoints" / "step_00000003.dcp"
        resumed = train(run_dir, cache_dir, *common, f"world.parallel={then}", f"resume={checkpoint}")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"resumed from {checkpoint} at step 3" in resumed.stdout
        losses = [row["loss"] for row in read_jsonl(run_dir / "train_log.jsonl")]
        assert losses == pytest.approx(expected, rel=1e-5), (first, then)
