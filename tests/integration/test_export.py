"""A trained model leaves clipdist: `clipdist export` writes what open_clip loads without clipdist (same image
and text features), and clip_benchmark — the tool people evaluate with — scores it as clipdist's own zero-shot does."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile

import pytest
import torch
from fixtures import clip_benchmark_set, pets
from helpers import train

from clipdist.cli import main as cli
from clipdist.files import PUBLISHED

# Run in a fresh interpreter where clipdist cannot be imported: only open_clip reads the export.
OPEN_CLIP_ALONE = """
import sys
sys.modules["clipdist"] = None
import open_clip, torch
model, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + sys.argv[1])
tokenizer = open_clip.get_tokenizer("local-dir:" + sys.argv[1])
inputs = torch.load(sys.argv[2])
model.eval()
with torch.no_grad():
    features = {"image": model.encode_image(inputs["images"]), "text": model.encode_text(tokenizer(inputs["captions"]))}
torch.save({**features, "image_size": list(preprocess.transforms[1].size)}, sys.argv[3])
"""


def open_clip_features(model_dir, images, captions, work) -> dict:
    """Image and text features (and the transform's image size) of an export as open_clip alone computes them."""
    torch.save({"images": images, "captions": captions}, work / "inputs.pt")
    result = subprocess.run(
        [sys.executable, "-c", OPEN_CLIP_ALONE, str(model_dir), str(work / "inputs.pt"), str(work / "features.pt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(work / "features.pt")


def test_open_clip_loads_the_export_with_the_same_features(trained_run, tmp_path, capsys):
    from clipdist.checkpoint.weights import read_run_checkpoint
    from clipdist.model.factory import create_model, get_tokenizer

    assert cli(["export", str(trained_run), "--out", str(tmp_path / "model")]) == 0
    assert "exported" in capsys.readouterr().out
    assert sorted(path.name for path in (tmp_path / "model").iterdir()) == [
        PUBLISHED,
        "open_clip_config.json",
        "open_clip_model.safetensors",
    ]
    assert cli(["export", str(trained_run), "--out", str(tmp_path / "model"), "--overwrite"]) == 0  # its own: replaced
    for out in (trained_run, trained_run / "checkpoints"):  # --overwrite never replaces the run it exports
        kept = sorted(path.name for path in out.iterdir())
        assert cli(["export", str(trained_run), "--out", str(out), "--overwrite"]) == 2
        assert f"{out} is not a folder clipdist wrote" in capsys.readouterr().err
        assert sorted(path.name for path in out.iterdir()) == kept
    ours = create_model("clipdist-tiny")
    ours.load_state_dict(read_run_checkpoint(trained_run / "checkpoints" / "step_00000030.dcp")[0])
    ours.eval()
    images, captions = torch.randn(3, 3, 32, 32), ["a photo of a 3.", "a drawing of a 7.", "a seven"]
    theirs = open_clip_features(tmp_path / "model", images, captions, tmp_path)
    with torch.no_grad():
        assert torch.equal(theirs["image"], ours.encode_image(images))
        assert torch.equal(theirs["text"], ours.encode_text(get_tokenizer("clipdist-tiny")(captions)))
    assert theirs["image_size"] == [32, 32]


# clip_benchmark's own CLI, with one shim: its `accuracy` turns a 1-element array into a float, which NumPy 2.4
# refuses (the same sum, read with .item()).
CLIP_BENCHMARK = """
import sys
import clip_benchmark.metrics.zeroshot_classification as zeroshot
def accuracy(output, target, topk=(1,)):
    pred = output.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [correct[:k].reshape(-1).float().sum().item() / len(target) for k in topk]
zeroshot.accuracy = accuracy
from clip_benchmark.cli import main
sys.argv = ["clip_benchmark", *sys.argv[1:]]
sys.exit(main())
"""


def digits_as_clip_benchmark(root, val_shard, classnames, templates):
    """clip_benchmark's webdataset layout from a shard of digits (.png + .json labels -> .png + .cls)."""
    with tarfile.open(val_shard) as source:
        members = {member.name: source.extractfile(member).read() for member in source.getmembers()}
    samples = [
        {"__key__": name[:-4], "png": data, "cls": str(json.loads(members[f"{name[:-4]}.json"])["label"]).encode()}
        for name, data in members.items()
        if name.endswith(".png")
    ]
    return clip_benchmark_set(root, [samples], classnames, templates)


def test_clip_benchmark_scores_the_export_as_clipdist_and_clipdist_eval_do(trained_run, tmp_path, cache_dir):
    pytest.importorskip("clip_benchmark")
    from clipdist.checkpoint.weights import read_run_checkpoint
    from clipdist.config import DataConfig
    from clipdist.data.builtin import builtin_shards, classnames_of
    from clipdist.data.sources import eval_set, expand_shards
    from clipdist.model.factory import create_model, get_tokenizer
    from clipdist.train.evaluate import evaluate

    assert cli(["export", str(trained_run), "--out", str(tmp_path / "model")]) == 0
    templates = ["a photo of the number {c}.", "a drawing of a {c}."]
    root = digits_as_clip_benchmark(
        tmp_path / "wds_digits",
        expand_shards(builtin_shards("digits", str(cache_dir))[1])[0],
        classnames_of("digits"),
        templates,
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            CLIP_BENCHMARK,
            "eval",
            "--dataset",
            "wds/digits",
            "--dataset_root",
            str(root),
            "--task",
            "zeroshot_classification",
            "--model",
            f"local-dir:{tmp_path / 'model'}",
            "--pretrained",
            "",
            "--no_amp",
            "--num_workers",
            "0",
            "--batch_size",
            "64",
            "--output",
            str(tmp_path / "result.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = json.loads((tmp_path / "result.json").read_text())["metrics"]["acc1"]

    model = create_model("clipdist-tiny")
    model.load_state_dict(read_run_checkpoint(trained_run / "checkpoints" / "step_00000030.dcp")[0])
    evalset = eval_set("digits", str(root), [], [])
    assert evalset.templates == templates and evalset.classnames == classnames_of("digits")
    import open_clip

    transform = open_clip.image_transform(
        32, is_train=False, mean=model.visual.preprocess_cfg["mean"], std=model.visual.preprocess_cfg["std"]
    )
    ours = evaluate(
        model,
        get_tokenizer("clipdist-tiny"),
        evalset,
        transform,
        torch.device("cpu"),
        max_skips_in_a_row=DataConfig.max_skips_in_a_row,
    )
    assert ours["digits/zeroshot_samples"] == 359
    assert theirs == pytest.approx(ours["digits/zeroshot_top1"], abs=0.5 / 359), (theirs, ours)
    # `clipdist eval` on the run (its checkpoint), on its export, and on 2 ranks: the same metrics as evaluate()
    for name, target, world in (("run", trained_run, 1), ("export", tmp_path / "model", 1), ("ranks", trained_run, 2)):
        assert (
            cli(
                [
                    "eval",
                    str(target),
                    "--set",
                    f"digits={root}",
                    "--world",
                    str(world),
                    "--out",
                    str(tmp_path / f"{name}.json"),
                ]
            )
            == 0
        )
        assert json.loads((tmp_path / f"{name}.json").read_text()) == ours, name


def test_fine_tuning_starts_from_a_run_checkpoint(trained_run, tmp_path, cache_dir):
    from helpers import read_jsonl

    checkpoint = trained_run / "checkpoints" / "step_00000030.dcp"
    fine_tuned = train(
        tmp_path / "fine",
        cache_dir,
        f"model.checkpoint={checkpoint}",
        "optim.max_steps=1",
        "eval_every=1000",
        "checkpoint_every=1000",
    )
    assert fine_tuned.returncode == 0, fine_tuned.stderr[-3000:]
    first = read_jsonl(tmp_path / "fine" / "train_log.jsonl")[0]["loss"]
    scratch = read_jsonl(trained_run / "train_log.jsonl")[0]["loss"]  # the same first batch, from random weights
    assert first < scratch - 0.2, (first, scratch)


def test_a_local_dir_model_starts_from_its_weights(trained_run, tmp_path, cache_dir):
    """model.name=local-dir:<export>, as open_clip names it: with lr 0 the run's weights stay the export's."""
    from clipdist.checkpoint.weights import read_weights

    assert cli(["export", str(trained_run), "--out", str(tmp_path / "model")]) == 0
    run = train(
        tmp_path / "run",
        cache_dir,
        f"model.name=local-dir:{tmp_path / 'model'}",
        "optim.lr=0",
        "optim.max_steps=1",
        "world.batch_per_device=8",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    exported, trained = read_weights(tmp_path / "model"), read_weights(tmp_path / "run")
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in exported)


@pytest.mark.parametrize(
    "target, message",
    [
        ("no-such-model", "unknown model 'no-such-model'"),
        ("ViT-B-32 --pretrained nope", "model.pretrained=nope: open_clip has no such tag for ViT-B-32"),
    ],
)
def test_clipdist_eval_refuses_a_target_it_cannot_load_in_one_line(tmp_path, capsys, target, message):
    code = cli(["eval", *target.split(), "--set", f"val={pets(tmp_path / 'pets')}", "--world", "2"])
    err = capsys.readouterr().err
    assert code != 0 and message in err and len(err.strip().splitlines()) == 1, err


def test_eval_and_export_take_the_weight_average_with_ema(trained_run, tmp_path, cache_dir, capsys):
    """optim.ema: `clipdist export --ema` writes the checkpoint's average (not its weights) and `clipdist eval --ema`
    scores it; a run trained without one says so in one line."""
    from clipdist.checkpoint.weights import find_checkpoint, read_run_checkpoint, read_weights

    run = tmp_path / "run"
    result = train(run, cache_dir, "optim.max_steps=4", "eval_every=100", "checkpoint_every=4", "optim.ema.decay=0.5")
    assert result.returncode == 0, result.stderr[-3000:]
    assert cli(["export", str(run), "--ema", "--out", str(tmp_path / "model")]) == 0
    assert "weight average" in capsys.readouterr().out
    exported = read_weights(tmp_path / "model")
    average, _ = read_run_checkpoint(find_checkpoint(run), ema=True)
    weights, _ = read_run_checkpoint(find_checkpoint(run))
    assert exported.keys() == average.keys() and all(torch.equal(exported[k], average[k]) for k in exported)
    assert any(not torch.equal(average[k], weights[k]) for k in average)
    evalset = f"val={cache_dir / 'digits' / 'val-000000.tar'}"  # captioned: a validation loss to tell them apart
    assert cli(["eval", str(run), "--ema", "--set", evalset, "--json"]) == 0
    with_average = json.loads(capsys.readouterr().out)
    assert cli(["eval", str(run), "--set", evalset, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) != with_average
    assert cli(["eval", str(trained_run), "--ema", "--set", evalset]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no weight average" in err[0], err


def test_a_pretrained_tag_starts_from_its_cached_weights_and_offline_without_them_is_one_line(
    tmp_path, cache_dir, capsys, monkeypatch
):
    """open_clip's ViT-B-32 `openai` weights, placed in a Hugging Face cache as a download leaves them, with the
    hub offline: the model starts from them, with the tag's preprocessing; another tag, not cached, is refused."""
    import huggingface_hub.constants
    import open_clip
    from helpers import refusal
    from safetensors.torch import save_file

    from clipdist.model.factory import create_model

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hub, commit = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo = hub / "models--timm--vit_base_patch32_clip_224.openai"  # open_clip's pretrained entry for the tag
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    torch.manual_seed(1)
    weights = {key: value.half() for key, value in create_model("ViT-B-32").state_dict().items()}
    save_file(weights, repo / "snapshots" / commit / "open_clip_model.safetensors")

    model = create_model("ViT-B-32", pretrained="openai", cache_dir=str(hub))
    assert all(torch.equal(value, weights[key].float()) for key, value in model.state_dict().items())
    assert model.visual.preprocess_cfg["mean"] == open_clip.OPENAI_DATASET_MEAN

    code, lines = refusal(
        capsys,
        monkeypatch,
        f"run_dir={tmp_path / 'run'}",
        f"data.cache_dir={cache_dir}",
        "model.name=ViT-B-32",
        "model.pretrained=laion2b_s34b_b79k",
        f"model.cache_dir={hub}",
    )
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: model.pretrained=laion2b_s34b_b79k: the weights are not in the cache ({hub})")
    assert not (tmp_path / "run").exists()
