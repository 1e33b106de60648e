"""A trained model leaves clipdist: `clipdist export` writes what open_clip loads without clipdist (same image
and text features), and clip_benchmark — the tool people evaluate with — scores it as clipdist's own zero-shot does."""

from __future__ import annotations

import pytest
import torch

from clipdist.cli import main as cli


def test_export_refuses_to_overwrite_and_names_a_missing_source(trained_run, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    assert cli(["export", str(trained_run), "--out", str(tmp_path / "taken")]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert (tmp_path / "taken" / "x").read_text() == "mine"
    assert cli(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "out")]) == 2
    assert "no such run directory, checkpoint folder or file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_run_checkpoint_an_export_and_an_open_clip_file_give_the_same_weights(trained_run, tmp_path):
    from clipdist.checkpoint.weights import read_run_checkpoint, read_weights

    checkpoint = trained_run / "checkpoints" / "step_00000030.dcp"
    expected = read_run_checkpoint(checkpoint)[0]
    assert cli(["export", str(trained_run), "--out", str(tmp_path / "model")]) == 0
    torch.save(
        {"epoch": 3, "state_dict": {f"module.{key}": value for key, value in expected.items()}},
        tmp_path / "open_clip_train.pt",
    )  # what open_clip_train saves
    for source in (checkpoint, trained_run, tmp_path / "model", tmp_path / "open_clip_train.pt"):
        weights = read_weights(source)
        assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in expected), source


def test_an_hf_hub_model_comes_from_the_cache_offline(trained_run, tmp_path, monkeypatch):
    """model.name=hf-hub:ORG/REPO: an export published as a hub repo (config + weights), read from the cache."""
    import shutil

    import huggingface_hub.constants

    from clipdist.checkpoint.weights import read_weights
    from clipdist.model.factory import create_model, get_tokenizer

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert cli(["export", str(trained_run), "--out", str(tmp_path / "export")]) == 0
    hub, commit = tmp_path / "hub", "fedcba9876543210fedcba9876543210fedcba98"
    repo = hub / "models--someone--tiny-clip"
    shutil.copytree(tmp_path / "export", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    model = create_model("hf-hub:someone/tiny-clip", cache_dir=str(hub))
    exported = read_weights(tmp_path / "export")
    assert all(torch.equal(value, exported[key]) for key, value in model.state_dict().items())
    assert get_tokenizer("hf-hub:someone/tiny-clip", str(hub))(["a cat"]).shape[1] == model.context_length


@pytest.mark.parametrize(
    "weights, message",
    [
        (None, "model.checkpoint: {path}: no such file or folder"),
        (
            {"visual.conv1.weight": torch.zeros(3)},
            "does not fit the model: visual.conv1.weight is (3,) there, (64, 3, 8, 8) here",
        ),
        ({"the": torch.zeros(1)}, "does not fit the model: positional_embedding is missing (62 missing, 1 unexpected)"),
        ("not a checkpoint", "holds no state dict of tensors"),
    ],
)
def test_a_checkpoint_that_cannot_be_used_is_one_line_and_leaves_no_run(
    tmp_path, cache_dir, capsys, monkeypatch, weights, message
):
    from helpers import refusal

    path = tmp_path / "weights.pt"
    if weights is not None:
        torch.save(weights, path)
    code, lines = refusal(
        capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}", f"model.checkpoint={path}"
    )
    assert code == 2 and len(lines) == 1 and message.format(path=path) in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_a_transformers_export_of_a_bare_model_name_is_refused_not_random(tmp_path, capsys):
    """`clipdist export ViT-B-32 --format transformers` without --pretrained would write random weights: one line."""
    from clipdist.cli import main

    assert main(["export", "clipdist-tiny", "--out", str(tmp_path / "x"), "--format", "transformers"]) == 2
    error = capsys.readouterr().err.strip()
    assert "would export random weights" in error and "--pretrained" in error and "\n" not in error
    assert not (tmp_path / "x").exists()


def test_a_transformers_export_without_transformers_says_what_to_install(tmp_path, capsys, monkeypatch):
    import importlib.util

    from clipdist.cli import main

    real = importlib.util.find_spec
    absent = lambda name, *rest: None if name == "transformers" else real(name, *rest)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", absent)
    assert main(["export", "clipdist-tiny", "--out", str(tmp_path / "x"), "--format", "transformers"]) == 2
    assert "pip install 'clipdist[transformers]'" in capsys.readouterr().err
