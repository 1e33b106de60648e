"""The terms that train a module of their own — loss.self_distill (SILC's local-to-global self-distillation) and
loss.masked (TIPS's masked prediction) against the EMA teacher, loss.decoder (LocCa's captioning decoder): exact
against their one-process definitions at 1–4 ranks with and without gradient caching, started late in a run, resumed
on another world size as the run never stopped (their heads, centres, mask tokens and decoder, and the EMA teacher
with them), and left out of exports."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import REPO, read_jsonl, run_log, train

from clipdist.objective.signal import collapse
from clipdist.tools.gradcheck import run_gradchecks
from integration.test_elastic import assert_same_run, overrides, resume, stop_at
from integration.test_naflex import STEPS as NAFLEX_STEPS
from integration.test_naflex import naflex_batches, naflex_overrides


# worlds 1-4, chunks 1 and 2 at each of 2 and 4 ranks, both kinds of contrastive loss (softmax, sigmoid)
@pytest.mark.parametrize(
    ("sizes", "chunks", "loss"),
    [
        ([5], 2, "siglip"),
        ([3, 2], 1, "disco"),
        ([3, 2], 2, "siglip"),
        ([2, 2, 3], 1, "siglip"),
        ([2, 3, 2, 2], 2, "disco"),
    ],
)
def test_the_terms_with_their_own_modules_give_ddp_the_single_process_loss_and_gradients(sizes, chunks, loss):
    """Unequal local batches; the teacher another model's weights, the centres drawn at random, two 16 px views an
    image (the 32 px tower's position table resampled), half the patches masked, half the captions predicted in
    parallel: the heads, the mask tokens, the decoder, both towers and the scalars exact in fp64."""
    terms = ["self_distill", "masked", "decoder"]
    for report in run_gradchecks([loss], len(sizes), local_batch=sizes, chunks=chunks, terms=terms):
        assert report.exact, (report.backend, report.max_rel_err, report.diagnosis)
        own = [c for c in report.parameters if c.name.startswith(("self_distill_head.", "masked_head.", "caption_"))]
        assert len(own) == 11 + 27 and all(check.verdict == "exact" for check in own)
        assert report.loss_rel_err <= 1e-9


@pytest.mark.parametrize(("sizes", "chunks", "loss"), [([3, 2], 1, "disco"), ([2, 3, 2, 2], 2, "siglip")])
def test_the_terms_are_exact_under_fsdp(sizes, chunks, loss):
    """Under FSDP2 each term's module is a unit of its own (called outside the model's forward), the image tower too
    where a teacher term runs it on views or masked patches; the teacher's forward runs on the model's structure as it
    was before sharding (parallel.plain_structure), not on the sharded modules."""
    terms = ["self_distill", "masked", "decoder"]
    for report in run_gradchecks([loss], len(sizes), local_batch=sizes, chunks=chunks, parallel="fsdp", terms=terms):
        assert report.exact, (report.max_rel_err, report.diagnosis)
        own = [c for c in report.parameters if c.name.startswith(("self_distill_head.", "masked_head.", "caption_"))]
        assert len(own) == 11 + 27 and all(check.verdict == "exact" for check in own)


@pytest.mark.parametrize(("parallel", "sizes", "chunks"), [("ddp", [3, 2, 2], 2), ("fsdp", [2, 3], 2)])
def test_the_terms_on_a_naflex_tower_are_exact(parallel, sizes, chunks):
    """On a NaFlex tower self-distillation's views are boxes of each image's patch grid, masked prediction masks each
    row's own patches (its padding never), the decoder reads the trunk's patch tokens with each row's padding masked:
    rows of other grids and lengths, unequal batches, gradient caching, DDP and FSDP2."""
    for report in run_gradchecks(
        ["siglip"],
        len(sizes),
        local_batch=sizes,
        chunks=chunks,
        model="clipdist-naflex-tiny",
        parallel=parallel,
        terms=["self_distill", "masked", "decoder"],
    ):
        assert report.exact, (report.max_rel_err, report.diagnosis)
        own = [c for c in report.parameters if c.name.startswith(("self_distill_head.", "masked_head.", "caption_"))]
        assert len(own) == 11 + 27 and all(check.verdict == "exact" for check in own)


STEPS = 16
# SigLIP with an EMA teacher, masked prediction from step 8 and self-distillation from step 11 (start_at 0.4 and 0.6
# of 16 steps): a stop before both on 2 ranks, resumed on 1 across both
RECIPE = (
    "data.workers=2",  # fixed, as test_elastic's runs: the batches' order follows the loader's workers
    "loss=siglip",
    "optim.ema.decay=0.9",
    "loss.self_distill.crops=2",
    "loss.self_distill.crop_size=16",
    "loss.self_distill.start_at=0.6",
    "loss.self_distill.weight=0.5",
    "loss.masked.ratio=0.5",
    "loss.masked.start_at=0.4",
    "loss.masked.weight=0.25",
    "loss.decoder.layers=1",
    "loss.decoder.width=32",
    "loss.decoder.heads=2",
    "checkpoint_every=1000",
)


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, cache_dir):
    whole = tmp_path_factory.mktemp("self_distill") / "whole"
    result = resume(whole, cache_dir, "cpu2", *RECIPE, steps=STEPS)
    assert "self_distill_loss × 0.5 from step 11" in result
    assert "masked_loss × 0.25 from step 8" in result
    assert "captions padded to the batch's longest" in result  # cut: a stop's stand-in batch must still decode
    assert not any("teacher targets have collapsed" in line for line in run_log(whole))
    return whole


def test_a_run_stopped_on_two_ranks_and_resumed_on_one_is_the_run_never_stopped(tmp_path, cache_dir, whole_run):
    run_dir = tmp_path / "run"
    step = stop_at(run_dir, cache_dir, "cpu2", 4, *RECIPE, steps=STEPS)
    assert 4 <= step < 8
    resume(run_dir, cache_dir, "local", *RECIPE, steps=STEPS)
    worst = assert_same_run(run_dir, whole_run, step, steps=STEPS)
    print(f"cpu2 -> local across the term's start: worst relative loss difference {worst:.2e}")
    log = read_jsonl(run_dir / "train_log.jsonl")
    assert all("self_distill_loss" not in row for row in log[:10])
    assert all(row["self_distill_loss"] > 0 for row in log[10:])
    assert all("masked_loss" not in row for row in log[:7]) and all(row["masked_loss"] > 0 for row in log[7:])
    said = run_log(run_dir)
    assert any("step 11: self_distill_loss counts from this step on" in line for line in said)
    assert any("step 8: masked_loss counts from this step on" in line for line in said)
    # the model (the head and its centre included) and its average: the uninterrupted run's
    ours, theirs = _final_state(run_dir), _final_state(whole_run)
    assert ours.keys() == theirs.keys() and "model.self_distill_head.centre" in ours
    assert "ema.self_distill_head.prototypes.weight" in ours and "ema.masked_head.mask_token" in ours
    assert "model.caption_decoder.mask_token" in ours
    assert all(row["decoder_loss"] > 0 for row in log)
    worst_state = max(float((ours[key] - theirs[key]).abs().max()) for key in ours)
    print(f"weights, centre and average: worst absolute difference {worst_state:.1e}")
    assert worst_state <= 1e-5
    for part in (
        "self_distill_head.centre",
        "masked_head.centre",
        "masked_head.mask_token",
        "caption_decoder.mask_token",
    ):
        assert float(ours[f"model.{part}"].abs().max()) > 0  # moved from its zeros


def test_the_teacher_targets_never_collapse(whole_run):
    """At every step a teacher term counts (from its first: the head's input moments are the batch's own there), its
    targets tell the images apart and are neither uniform nor one prototype. The floors: the information H(p̄) − H̄
    (image and prototype's mutual information: 0 when every image gets one target) above 0.1 nat, where the collapse
    this guards against measured 0.03; the mean entropy H̄ below 0.95 ln P (uniform: ln P) and above ln 2 (the mass on
    one or two prototypes)."""
    log = read_jsonl(whole_run / "train_log.jsonl")
    counted = [(row, term) for row in log for term in ("self_distill", "masked") if f"{term}_loss" in row]
    assert {term for _, term in counted} == {"self_distill", "masked"}
    for row, term in counted:
        information, entropy = row[f"{term}_target_information"], row[f"{term}_target_entropy"]
        assert not collapse(information, entropy) and entropy < 0.95 * math.log(1024), (row["step"], term, row)


def test_a_collapse_of_the_targets_is_warned_of_at_the_step_it_happens(tmp_path, cache_dir):
    """A fast teacher (optim.ema.decay=0.9) with a fast head (head_lr=10) on this short run: within 8 steps of its
    start every image gets one target. The run says so once, at the first step below a floor (objective.signal), and
    trains on."""
    run_dir = tmp_path / "collapsing"
    fast = ("loss.self_distill.start_at=0.3", "loss.masked.start_at=0.3", "loss.self_distill.head_lr=10")
    result = train(run_dir, cache_dir, *overrides("local", *RECIPE, *fast, steps=STEPS))
    assert result.returncode == 0, result.stderr[-3000:]
    warned = [line for line in run_log(run_dir) if "teacher targets have collapsed" in line]
    assert len(warned) == 1 and "self_distill's" in warned[0] and "loss.self_distill.head_lr" in warned[0], warned
    collapsed = [
        row["step"]
        for row in read_jsonl(run_dir / "train_log.jsonl")
        if "self_distill_loss" in row
        and collapse(row["self_distill_target_information"], row["self_distill_target_entropy"])
    ]
    assert collapsed and warned[0].startswith(f"warning: step {collapsed[0]}: "), (collapsed, warned)


def test_under_fsdp_the_run_is_the_ddp_run(tmp_path, cache_dir, whole_run):
    """The same run with the model sharded (world.parallel=fsdp): the teacher's forward gathers the average's shards,
    the heads before their terms' starts get FSDP's zero gradients as DDP's (their weight decay moves them alike), so
    every step's loss and the final weights, centres and average are the DDP run's (fp32: to rounding)."""
    run_dir = tmp_path / "fsdp"
    resume(run_dir, cache_dir, "cpu2", *RECIPE, "world.parallel=fsdp", steps=STEPS)
    worst = assert_same_run(run_dir, whole_run, 0, steps=STEPS)
    ours, theirs = _final_state(run_dir), _final_state(whole_run)
    assert ours.keys() == theirs.keys()
    worst_state = max(float((ours[key] - theirs[key]).abs().max()) for key in ours)
    print(f"fsdp against ddp: worst relative loss difference {worst:.2e}, state {worst_state:.1e}")
    assert worst_state <= 1e-5


def test_on_a_naflex_tower_a_run_stopped_on_two_ranks_and_resumed_on_one_is_the_run_never_stopped(tmp_path, cache_dir):
    """The three terms on a NaFlex tower with token-budget batches of two lengths (a rank's rows, so its padding,
    differ with the world size): the views, masks and draws are each sample's own, so a run stopped on 2 ranks and
    resumed on 1 logs the uninterrupted run's batches and losses."""
    from helpers import train, train_until

    terms = (
        "loss=siglip",
        "optim.ema.decay=0.9",
        "loss.self_distill.crops=2",
        "loss.masked.ratio=0.5",
        "loss.decoder.layers=1",
        "loss.decoder.width=32",
        "loss.decoder.heads=2",
    )
    whole = tmp_path / "whole"
    assert train(whole, cache_dir, *naflex_overrides("cpu2", *terms)).returncode == 0
    stopped = tmp_path / "stopped"
    assert 3 <= train_until(stopped, cache_dir, naflex_overrides("cpu2", *terms), 3) < NAFLEX_STEPS
    resumed = train(stopped, cache_dir, *naflex_overrides("local", *terms))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert naflex_batches(stopped) == naflex_batches(whole)
    rows = [read_jsonl(run / "train_log.jsonl") for run in (stopped, whole)]
    assert len(rows[0]) == len(rows[1]) == NAFLEX_STEPS and all("self_distill_loss" in row for row in rows[0])
    worst = max(abs(ours["loss"] - theirs["loss"]) / abs(theirs["loss"]) for ours, theirs in zip(*rows))
    print(f"NaFlex, the three terms, cpu2 -> local: worst relative loss difference {worst:.2e}")
    assert worst <= 1e-5


def _final_state(run_dir) -> dict[str, torch.Tensor]:
    """The newest checkpoint's model and weight average, every tensor by "model.<name>" / "ema.<name>"."""
    from clipdist.checkpoint.weights import find_checkpoint, read_dcp

    checkpoint = find_checkpoint(run_dir)
    assert checkpoint.name == f"step_{STEPS:08d}.dcp"
    parts = read_dcp(checkpoint, {"model", "ema"})
    return {f"{part}.{name}": tensor for part in ("model", "ema") for name, tensor in parts[part].items()}


def test_exports_and_evaluation_leave_the_head_out(whole_run, tmp_path, cache_dir, capsys):
    """`clipdist export` (the weights or their average) writes exactly the model's keys, and `clipdist eval` scores
    the run as it scores its export."""
    from clipdist.checkpoint.weights import read_weights
    from clipdist.cli import main as cli
    from clipdist.losses import build
    from clipdist.model.factory import create_model_for_loss

    evalset = f"val={cache_dir / 'digits' / 'val-000000.tar'}"
    for ema in ([], ["--ema"]):
        out = tmp_path / f"export{len(ema)}"
        assert cli(["export", str(whole_run), *ema, "--out", str(out)]) == 0
        weights = read_weights(out)
        assert not any(name.startswith(("self_distill_head", "masked_head", "caption_decoder")) for name in weights)
        create_model_for_loss("clipdist-tiny", build("siglip")).load_state_dict(weights)  # strict: the model's keys
        capsys.readouterr()
        scores = []
        for target in (whole_run, out):
            assert cli(["eval", str(target), *(ema if target == whole_run else []), "--set", evalset, "--json"]) == 0
            scores.append(json.loads(capsys.readouterr().out))
        assert scores[0] == scores[1]
    # asked for (--parts): the modules beside the model, as the run's checkpoint holds them; the model file unchanged
    out = tmp_path / "with_parts"
    assert cli(["export", str(whole_run), "--ema", "--parts", "--out", str(out)]) == 0
    assert read_weights(out).keys() == read_weights(tmp_path / "export1").keys()
    from safetensors.torch import load_file

    parts, state = load_file(out / "training_parts.safetensors"), _final_state(whole_run)
    assert {name.split(".")[0] for name in parts} == {"self_distill_head", "masked_head", "caption_decoder"}
    for name, tensor in parts.items():
        source = f"ema.{name}" if f"ema.{name}" in state else f"model.{name}"  # the average, its buffers the model's
        assert torch.equal(tensor, state[source]), name
    capsys.readouterr()
    assert cli(["export", str(whole_run), "--parts", "--format", "transformers", "--out", str(tmp_path / "hf")]) == 2
    assert "--parts writes open_clip's layout only" in capsys.readouterr().err


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_map_head_tower_takes_every_term_and_stays_exact(parallel):
    """SigLIP 2's own image tower (a timm ViT whose pooling is an attention head: clipdist-maphead-tiny has its shape)
    takes every term: the decoder and masked prediction on the tokens before the pooling head, as the paper's read
    them, self-distillation on the pooled output of local views at SILC's size."""
    (report,) = run_gradchecks(
        ["siglip"],
        2,
        local_batch=[3, 2],
        chunks=2,
        parallel=parallel,
        terms=["self_distill", "masked", "decoder"],
        model="clipdist-maphead-tiny",
    )
    assert report.exact, (report.max_rel_err, report.diagnosis)
    assert any(check.name.startswith("visual.trunk.attn_pool.") for check in report.parameters)


def _page_commands(page: str) -> list[list[str]]:
    """The commands in a page's bash blocks, as argument lists (comments cut)."""
    import re
    import shlex

    text = (REPO / "docs" / page).read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [shlex.split(line, comments=True) for block in blocks for line in block.splitlines() if line.strip()]


def test_every_command_on_the_siglip2_page_is_accepted_as_written(monkeypatch):
    """docs/siglip2.md's commands run as written: a `train.py` line's overrides compose and pass the checks made
    before any rank starts (the model's, its terms' included, on the meta device), a `clipdist` line parses, a
    script's flags are its own. A renamed key, group or flag on the page fails here."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from clipdist.cli import build_parser
    from clipdist.config import TrainConfig, register
    from clipdist.preflight import check_config
    from clipdist.preflight.model import check_model

    commands = _page_commands("siglip2.md")
    assert sum("train.py" in command for command in commands) >= 4, commands
    register()
    for command in commands:
        if "train.py" in command:
            overrides = command[command.index("train.py") + 1 :]
            with initialize_config_module("clipdist.conf", version_base=None):
                cfg: TrainConfig = OmegaConf.to_object(compose("config", overrides=overrides))  # type: ignore[assignment]
            check_config(cfg)
            check_model(cfg, is_main=False)  # rank 0 alone fetches (a hub tokenizer): not here
        elif command[0] == "clipdist":
            build_parser().parse_args(command[1:])
        else:
            assert command[:2] == ["python", command[1]] and command[1].startswith("scripts/"), command
            source = (REPO / command[1]).read_text()
            assert all(f'"{flag}"' in source for flag in command[2:] if flag.startswith("--")), command
