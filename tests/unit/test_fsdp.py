"""FSDP2 (world.parallel=fsdp): exact gradients for every backend, sharded state as planned, sharded
checkpoints that are atomic and reshard on resume, and clear errors before any rank starts."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from clipdist.checkpoint.manager import Checkpointer, CheckpointFiles
from clipdist.compat import NEWER_APIS, release
from clipdist.config import TrainConfig, as_dict
from clipdist.errors import CheckpointError, ConfigError


@pytest.fixture
def single_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def test_a_save_is_atomic_and_retained(tmp_path, single_rank_group):
    files = CheckpointFiles(tmp_path, keep=2)
    for step in (1, 2, 3):
        files.save({"weights": torch.full((4,), float(step))}, {"step": step}, step, is_main=True)
    assert [path.name for path in files.checkpoints()] == ["step_00000003.dcp", "step_00000002.dcp"]
    # A save that fails mid-write (an object DCP cannot pickle) leaves no folder and no newer "latest".
    with pytest.raises(CheckpointError, match="step_00000004.dcp.*step_00000003.dcp is intact"):
        files.save({"weights": torch.ones(4), "bad": lambda: None}, {"step": 4}, 4, is_main=True)
    assert files.checkpoints()[0].name == "step_00000003.dcp"
    assert sorted(path.name for path in files.directory.iterdir()) == ["step_00000002.dcp", "step_00000003.dcp"]
    # A crash mid-save (the process killed) leaves only a hidden .partial folder: never picked up.
    (files.directory / ".step_00000005.dcp.partial").mkdir()
    assert files.checkpoints()[0].name == "step_00000003.dcp"


def test_a_checkpoint_of_the_pt_days_is_resumed_under_ddp_only(tmp_path):
    """DDP and FSDP share the .dcp format; a step_*.pt file (DDP, before it) cannot be resharded."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    cfg = TrainConfig(name="x", run_dir=str(tmp_path))
    torch.save({"step": 2, "world_size": 1, "rng": [{}], "config": as_dict(cfg)}, folder / "step_00000002.pt")
    assert Checkpointer.check_resume(cfg, 1) == []
    cfg.world.parallel = "fsdp"
    with pytest.raises(ConfigError, match="checkpoint of the .pt days .*resume it with world.parallel=ddp"):
        Checkpointer.check_resume(cfg, 1)


FSDP2_SCALARS = pytest.mark.skipif(
    (release("torch") or (0, 0)) < NEWER_APIS["torch.distributed.fsdp.fully_shard(ignored_params)"],
    reason="FSDP2's ignored_params (the scalars left whole) is torch 2.7's; preflight refuses fsdp before it",
)


@FSDP2_SCALARS
def test_a_model_without_transformer_blocks_is_refused_for_fsdp(monkeypatch):
    from clipdist import preflight
    from clipdist.distributed import parallel
    from clipdist.model.factory import create_model

    model = create_model("clipdist-tiny", device="meta")
    preflight.check_shardable(model, "clipdist-tiny")  # has blocks: fine
    monkeypatch.setattr(parallel, "transformer_blocks", lambda model: [])
    with pytest.raises(ConfigError, match="no transformer blocks.*world.parallel=ddp"):
        preflight.check_shardable(model, "clipdist-tiny")


@FSDP2_SCALARS
def test_the_plain_structure_of_a_sharded_model_runs_with_whole_tensors(single_rank_group):
    """What a teacher's forward runs on under FSDP2: the model as it was before sharding, on the meta device, without
    the hooks sharding put on it (which would gather the model's own shards in place of the tensors given)."""
    from torch.func import functional_call

    from clipdist.distributed.parallel import plain_structure, wrap_model
    from clipdist.model.factory import create_model

    torch.manual_seed(0)
    model = create_model("clipdist-tiny")
    images = torch.randn(2, 3, 32, 32)
    whole = {name: tensor.detach().clone() for name, tensor in model.visual.named_parameters()}
    with torch.no_grad():
        expected = model.visual(images)
        other = {name: tensor * 1.5 for name, tensor in whole.items()}
        expected_other = functional_call(model.visual, other, (images,))
    wrap_model(model, parallel="fsdp")
    plain = plain_structure(model)
    assert plain is plain_structure(model)  # kept by wrap_model, not copied again
    visual = plain.get_submodule("visual")
    assert all(tensor.is_meta for tensor in visual.parameters()) and not visual.transformer.resblocks[0]._forward_hooks
    with torch.no_grad():
        torch.testing.assert_close(functional_call(visual, whole, (images,)), expected)
        torch.testing.assert_close(functional_call(visual, other, (images,)), expected_other)
    assert not torch.allclose(expected, expected_other)


def test_fsdp_on_a_torch_without_ignored_params_is_refused_in_one_line(monkeypatch):
    from clipdist import compat, preflight
    from clipdist.model.factory import create_model

    monkeypatch.setattr(compat, "release", lambda package: (2, 6))
    with pytest.raises(ConfigError, match=r"fully_shard\(ignored_params\) needs torch >= 2.7 \(installed"):
        preflight.check_shardable(create_model("clipdist-tiny", device="meta"), "clipdist-tiny")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_the_compile_mode_reaches_torch_compile(single_rank_group, monkeypatch, parallel):
    """model.compile_mode (reduce_overhead: CUDA graphs) is the mode every compiled module is given: the towers under
    DDP, each transformer block under FSDP2; nothing is compiled where compile is off."""
    from clipdist.config import CompileMode
    from clipdist.distributed.parallel import transformer_blocks, wrap_model
    from clipdist.model.factory import create_model

    compiled: list[tuple[torch.nn.Module, dict]] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda module, **kwargs: compiled.append((module, kwargs)))
    model = create_model("clipdist-tiny")
    wrap_model(model, parallel=parallel, compile=False, compile_mode=str(CompileMode.reduce_overhead))
    assert compiled == []
    model = create_model("clipdist-tiny")
    wrap_model(model, parallel=parallel, compile=True, compile_mode=str(CompileMode.reduce_overhead))
    expected = transformer_blocks(model) if parallel == "fsdp" else [model]
    assert [module for module, _ in compiled] == expected
    assert all(kwargs == {"mode": "reduce-overhead"} for _, kwargs in compiled)


@FSDP2_SCALARS
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_the_gathered_weights_a_forward_leaves_are_what_the_plan_counts(single_rank_group, reshard_after_forward):
    """world.reshard_after_forward: after the model's forward FSDP2 holds the root's gathered weights (every block
    resharded), or every block's as well where they are kept for backward; `clipdist plan` counts the same."""
    from torch.distributed.tensor import DTensor

    from clipdist.distributed.parallel import wrap_model
    from clipdist.model.factory import create_model, random_tokens
    from clipdist.tools import plan
    from clipdist.tools.memory import LOSS_TERMS, ActivationFit, LossFit

    torch.manual_seed(0)
    model = create_model("clipdist-tiny")
    shapes, blocks = plan.parameter_layout(model)
    total = sum(parameter.numel() for parameter in model.parameters())
    fit = {"disco": LossFit("disco", (0.0,) * len(LOSS_TERMS), 0.0)}
    measured = plan.Measurements(ActivationFit(0.0, 0.0, 64, total), fit, 4, shapes, blocks)
    measured.reshard_after_forward = reshard_after_forward
    wrap_model(model, parallel="fsdp", reshard_after_forward=reshard_after_forward)
    model(torch.randn(2, 3, 32, 32), random_tokens(2, model.context_length))
    held = sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor) and p.ndim)  # 0-dim: never sharded
    scalars = sum(1 for p in model.parameters() if p.ndim == 0)
    blocks_in_flight = 0 if not reshard_after_forward else 2 * max(blocks)  # freed by the end of forward
    assert held + scalars == measured.gathered_parameters() - blocks_in_flight
    assert (held + scalars == total) is (not reshard_after_forward)
    sent = {}
    for reshard in (True, False):
        measured.reshard_after_forward = reshard
        sent[reshard] = plan.sent_bytes(measured, "disco", 4, 8, "fsdp")
    assert sent[True] - sent[False] == pytest.approx(3 / 4 * total * 4)  # one all-gather of fp32 weights fewer


@FSDP2_SCALARS
def test_encode_image_alone_gathers_the_root_after_a_forward_that_failed(single_rank_group):
    """Inside the model's forward encode_image runs plain (the root is gathered already); alone, as evaluation calls
    it, FSDP2 gathers the root for it, also after a forward that raised."""
    from clipdist.distributed.parallel import wrap_model
    from clipdist.model.factory import create_model, random_tokens

    torch.manual_seed(0)
    model = create_model("clipdist-tiny")
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model.encode_image(images)
    wrap_model(model, parallel="fsdp")
    with pytest.raises(RuntimeError):
        model(images, torch.zeros(2, 3, 5, dtype=torch.long))  # tokens of the wrong shape
    features = model(images, random_tokens(2, model.context_length))
    (features[0].sum() + features[1].sum()).backward()  # the root resharded after it
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image(images), expected)


@FSDP2_SCALARS
def test_an_fsdp_run_cuts_captions_and_resizes_images_as_a_ddp_run_does(tmp_path, single_rank_group):
    """FSDP2 gives each unit a class of its own (FSDPCLIP; the image tower's where a term runs it alone, as the masked
    term does): the short-text and any-grid classes are set before it wraps, so an fp32 FSDP run pads captions to the
    batch's longest as DDP's does (it padded every caption to 77 tokens, 2.6× the text tower's work in the CPU
    benchmark, and its banner blamed a teacher there was none of), and a resolution schedule's tower takes its sizes."""
    from clipdist.model.flexible_grid import FlexibleGridViT
    from clipdist.tools.gpu_battery import RECIPE_TERMS, config, synthetic_batch
    from clipdist.train.parts import build_parts
    from clipdist.train.recipe import captions_line

    cfg = config(tmp_path, "clipdist-tiny", "fp32", 2, parallel="fsdp", terms={"masked": RECIPE_TERMS["masked"]})
    cfg.data.resolution_schedule = {"0": [16], "5": [32]}
    parts = build_parts(cfg, torch.device("cpu"))
    assert type(parts.model).__name__ == "FSDPShortTextCLIP" and parts.step.trim_text
    assert type(parts.model.visual).__name__ == "FSDPFlexibleGridViT"
    assert isinstance(parts.model.visual, FlexibleGridViT)
    batch = synthetic_batch(parts.model, 2, torch.device("cpu"))
    assert parts.step.inputs(batch)["text"].shape[1] < parts.tokenizer.context_length
    assert captions_line(cfg, parts.model, parts.step.trim_text) == "captions padded to the batch's longest"


@FSDP2_SCALARS
def test_a_tower_wrapped_before_its_class_is_changed_is_a_bug_said_so(single_rank_group):
    """Changing a wrapped unit's class would drop FSDP2's own; passing over it was the silent bug above."""
    from clipdist.distributed.parallel import wrap_model
    from clipdist.model.factory import create_model
    from clipdist.model.flexible_grid import allow_other_sizes
    from clipdist.model.short_text import allow_short_text

    model = wrap_model(create_model("clipdist-tiny"), parallel="fsdp")
    with pytest.raises(RuntimeError, match="FSDPCLIP: FSDP2 has wrapped it; make it a ShortTextCLIP before"):
        allow_short_text(model)
    model.visual.__class__ = type("FSDPVisionTransformer", (FSDPModule, type(model.visual)), {})
    with pytest.raises(RuntimeError, match="FSDP2 has wrapped it; make it a FlexibleGridViT before"):
        allow_other_sizes(model)
