"""A trained model leaves for Hugging Face: `clipdist export --format transformers` writes a folder that
transformers alone (no clipdist, no open_clip importable) loads as CLIPModel + CLIPProcessor, with the model's image
and text features, open_clip's token ids, and the zero-shot pipeline's top-1 equal to `clipdist eval`'s."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tarfile

import pytest
import torch
from fixtures import clip_benchmark_set, tiny_open_clip

from clipdist.cli import main as cli
from clipdist.tools import to_transformers

pytest.importorskip("transformers")

# A fresh interpreter where neither clipdist nor open_clip can be imported: only transformers reads the export.
TRANSFORMERS_ALONE = """
import io, json, sys
sys.modules["clipdist"] = None
sys.modules["open_clip"] = None
import torch
from PIL import Image
from transformers import CLIPModel, CLIPProcessor, pipeline
folder, inputs, out = sys.argv[1:4]
inputs = torch.load(inputs)
model, processor = CLIPModel.from_pretrained(folder).eval(), CLIPProcessor.from_pretrained(folder)
ids = [processor.tokenizer(caption, truncation=True)["input_ids"] for caption in inputs["captions"]]
tokens = processor.tokenizer(inputs["captions"], padding=True, truncation=True, return_tensors="pt")
features = lambda output: output if isinstance(output, torch.Tensor) else output.pooler_output  # 4.x / 5.x
with torch.no_grad():
    result = {"image": features(model.get_image_features(pixel_values=inputs["images"])),
              "text": features(model.get_text_features(**tokens)), "ids": ids}
if inputs["labels"]:
    classify = pipeline("zero-shot-image-classification", model=folder, device="cpu")
    images = [Image.open(io.BytesIO(data)) for data in inputs["pngs"]]
    guesses = classify(images, candidate_labels=inputs["labels"], hypothesis_template=inputs["template"], batch_size=64)
    result["top1"] = [guess[0]["label"] for guess in guesses]
torch.save(result, out)
"""


def converted(model, tokenizer=None):
    import open_clip
    from transformers import CLIPConfig, CLIPModel

    tokenizer = tokenizer or open_clip.tokenizer._tokenizer
    theirs = CLIPModel(CLIPConfig(**to_transformers.clip_config(model, tokenizer))).eval()
    theirs.load_state_dict(to_transformers.clip_weights(model), strict=True)
    return theirs, to_transformers.check_same(model, theirs, tokenizer, 32)


@pytest.mark.parametrize(
    "options", [{}, {"quick_gelu": True}, {"init_logit_bias": -10.0}], ids=["gelu", "quick_gelu", "siglip_bias"]
)
def test_clip_variants_convert_with_the_models_features(options):
    model = tiny_open_clip(**options)
    theirs, difference = converted(model)
    assert difference <= 1e-5
    assert theirs.config.vision_config.hidden_act == ("quick_gelu" if options.get("quick_gelu") else "gelu")
    assert theirs.logit_scale.item() == pytest.approx(model.logit_scale.item())
    bias = getattr(model, "logit_bias", None)
    assert getattr(theirs.config, "logit_bias", None) == (None if bias is None else pytest.approx(bias.item()))


def test_a_mapping_that_drops_a_tensor_is_caught_by_the_feature_check(monkeypatch):
    """The self-check is what stands between a variant the mapping misses and a different model on disk."""
    model = tiny_open_clip()
    real = to_transformers.clip_weights

    def swapped(model):  # q and k exchanged in one block: loads, runs, is wrong
        weights = real(model)
        layer = "vision_model.encoder.layers.1.self_attn."
        weights[layer + "q_proj.weight"], weights[layer + "k_proj.weight"] = (
            weights[layer + "k_proj.weight"],
            weights[layer + "q_proj.weight"],
        )
        return weights

    monkeypatch.setattr(to_transformers, "clip_weights", swapped)
    with pytest.raises(to_transformers.NoCounterpart, match="features differ from the model's"):
        converted(model)


def transformers_alone(folder, work, images, captions, labels=(), template="", pngs=(), env=None) -> dict:
    torch.save(
        {"images": images, "captions": captions, "labels": list(labels), "template": template, "pngs": list(pngs)},
        work / "inputs.pt",
    )
    result = subprocess.run(
        [sys.executable, "-c", TRANSFORMERS_ALONE, str(folder), str(work / "inputs.pt"), str(work / "out.pt")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(work / "out.pt")


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


CAPTIONS = ["a photo of the number 7.", "A DRAWING of a seven!", "digits: 0, 1, 2 — and café's 3", "x " * 40]
TEMPLATE = "a photo of the number {}."


@pytest.fixture(scope="module")
def exported(trained_run, cache_dir, tmp_path_factory):
    """The trained run exported with --format transformers, what transformers alone computes from it (features of
    random images and CAPTIONS, their token ids, the pipeline's top-1 guess on the 359 digits: one interpreter for
    both tests) and the digits as (keys, pngs, labels)."""
    from clipdist.data.builtin import builtin_shards, classnames_of
    from clipdist.data.sources import expand_shards

    work = tmp_path_factory.mktemp("transformers")
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        assert cli(["export", str(trained_run), "--out", str(work / "hf"), "--format", "transformers"]) == 0
    with tarfile.open(expand_shards(builtin_shards("digits", str(cache_dir))[1])[0]) as shard:
        members = {member.name: shard.extractfile(member).read() for member in shard.getmembers()}
    keys = sorted(name[:-4] for name in members if name.endswith(".png"))
    digits = (
        keys,
        [members[f"{key}.png"] for key in keys],
        [json.loads(members[f"{key}.json"])["label"] for key in keys],
    )
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    theirs = transformers_alone(work / "hf", work, images, CAPTIONS, classnames_of("digits"), TEMPLATE, digits[1])
    return work / "hf", said.getvalue(), images, theirs, digits


def test_transformers_alone_loads_the_export_with_the_same_features_and_token_ids(trained_run, exported):
    from clipdist.model import targets
    from clipdist.model.factory import get_tokenizer

    out, said, images, theirs, _ = exported
    assert "CLIPModel.from_pretrained" in said
    assert {
        "config.json",
        "model.safetensors",
        "preprocessor_config.json",
        "tokenizer.json",
        "vocab.json",
        "merges.txt",
    } <= {path.name for path in out.iterdir()}
    model, name = targets.load(targets.resolve(str(trained_run)))
    model.eval()
    tokenizer = get_tokenizer(name)
    with torch.no_grad():
        image, text = model.encode_image(images), model.encode_text(tokenizer(CAPTIONS))
    assert relative(theirs["image"], image) <= 1e-5 and relative(theirs["text"], text) <= 1e-5
    for caption, ids, ours in zip(CAPTIONS, theirs["ids"], tokenizer(CAPTIONS)):
        assert ids == ours[: len(ids)].tolist(), caption  # the same ids up to and with the end-of-text token
    assert len(theirs["ids"][-1]) == 16  # truncated to the context length, ending in <|endoftext|>


def test_the_zero_shot_pipeline_scores_the_export_as_clipdist_eval_does(trained_run, exported, tmp_path):
    from clipdist.data.builtin import classnames_of

    _, _, _, theirs, (keys, pngs, labels) = exported
    classnames = classnames_of("digits")
    root = clip_benchmark_set(
        tmp_path / "digits",
        [[{"__key__": key, "png": png, "cls": str(label).encode()} for key, png, label in zip(keys, pngs, labels)]],
        classnames,
        [TEMPLATE],
    )
    assert cli(["eval", str(trained_run), "--set", f"digits={root}", "--out", str(tmp_path / "eval.json")]) == 0
    ours = json.loads((tmp_path / "eval.json").read_text())["digits/zeroshot_top1"]
    top1 = sum(guess == classnames[label] for guess, label in zip(theirs["top1"], labels)) / len(labels)
    assert len(labels) == 359 and 0.2 < ours < 1.0  # a model that learned something, so agreement means something
    assert top1 == pytest.approx(ours, abs=0.5 / len(labels)), (top1, ours)


def test_the_export_works_with_the_newest_transformers_release(trained_run, tmp_path):
    """The transformers extra at the top of its range (requirements/transformers-newest.txt, installed into a folder
    of its own in front of the venv's 4.56): `clipdist export --format transformers` converts, checks the features
    through transformers' own CLIPModel (5.x returns them in an output object), and transformers alone reads the
    result with the same features."""
    from helpers import REPO

    target = tmp_path / "newest"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
        + ["-r", str(REPO / "requirements" / "transformers-newest.txt")],
        capture_output=True,
        text=True,
        timeout=400,
    )
    if install.returncode != 0 and "Could not find" in install.stderr + install.stdout:
        pytest.skip(f"the package index cannot be reached: {install.stderr[-300:]}")
    assert install.returncode == 0, install.stderr[-2000:]
    pinned = (REPO / "requirements" / "transformers-newest.txt").read_text().split("transformers==")[1].split()[0]
    environment = {**os.environ, "PYTHONPATH": str(target)}
    version = subprocess.run(
        [sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
    )
    assert version.stdout.strip() == pinned, (version.stdout, version.stderr[-1000:])
    out = tmp_path / "hf"
    export = subprocess.run(
        [sys.executable, "-m", "clipdist", "export", str(trained_run), "--out", str(out), "--format", "transformers"],
        capture_output=True,
        text=True,
        timeout=400,
        env=environment,
    )
    assert export.returncode == 0 and "features within" in export.stdout, (export.stdout, export.stderr[-2000:])
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    theirs = transformers_alone(out, tmp_path, images, CAPTIONS[:2], env=environment)
    from clipdist.model import targets

    model, _ = targets.load(targets.resolve(str(trained_run)))
    with torch.no_grad():
        assert relative(theirs["image"], model.eval().encode_image(images)) <= 1e-5
