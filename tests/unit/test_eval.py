"""Evaluation on the sets people have: clip_benchmark's zero-shot folders (.webp + .cls), retrieval
sets with several captions per image, mixed labelled/unlabelled shards, several sets in one run —
and an evaluation that fails never stops training."""

from __future__ import annotations

import json

import open_clip
import pytest
import torch
from fixtures import caption_shards, image_bytes, pets, write_samples
from helpers import refusal

from clipdist.config import DataConfig
from clipdist.data.sources import EvalSet, eval_set
from clipdist.model.factory import create_model, get_tokenizer
from clipdist.train.evaluate import evaluate, fill_template, recall_at_k


def test_recall_counts_an_image_right_when_any_of_its_captions_is_among_the_best():
    similarity = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.3, 0.4]])
    owner = torch.tensor([0, 0, 1])  # image 0 has captions 0 and 1, image 1 has caption 2
    image_to_text, text_to_image = recall_at_k(similarity, owner, ks=(1, 2))
    assert image_to_text == {1: 1.0, 2: 1.0}
    assert text_to_image == {1: pytest.approx(1 / 3), 2: 1.0}  # captions 1 and 2 rank their image second


def test_templates_in_either_placeholder_style():
    assert fill_template("a photo of a {}.", "cat") == fill_template("a photo of a {c}.", "cat") == "a photo of a cat."


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = create_model()
    visual = model.visual
    transform = open_clip.image_transform(
        visual.image_size, is_train=False, mean=visual.preprocess_cfg["mean"], std=visual.preprocess_cfg["std"]
    )
    return model, get_tokenizer(), transform


def run_eval(tiny, evalset):
    model, tokenizer, transform = tiny
    return evaluate(
        model,
        tokenizer,
        evalset,
        transform,
        torch.device("cpu"),
        batch_size=4,
        max_skips_in_a_row=DataConfig.max_skips_in_a_row,
    )


def test_clip_benchmark_classification_set(tmp_path, tiny):
    """...and evaluation keeps nothing for a backward: its features are gathered for the whole set, so a graph behind
    them would hold every batch's activations (ViT-B/32 on 2,560 web photos reached 23 GB and was killed)."""
    from clipdist.tools.memory import SavedTensorMeter

    root = pets(tmp_path / "wds_pets", samples_per_shard=5, shards=2)
    with SavedTensorMeter() as meter:
        metrics = run_eval(tiny, eval_set("pets", str(root), [], ["a photo of {}."]))
    assert meter.peak == 0, meter.peak
    assert metrics["pets/samples"] == 10 and metrics["pets/zeroshot_samples"] == 10 and metrics["pets/skipped"] == 0
    assert 0 <= metrics["pets/zeroshot_top1"] <= 1 and metrics["pets/zeroshot_top5"] == 1.0  # 2 classes
    assert not any("i2t" in key for key in metrics)  # no captions: no retrieval


def test_retrieval_with_several_captions_and_partly_labelled_samples(tmp_path, tiny):
    write_samples(
        tmp_path / "0.tar",
        [
            {"__key__": "a", "png": image_bytes(10), "txt": b"a dark square\nsomething black"},
            {"__key__": "b", "png": image_bytes(240), "txt": b"a white square", "json": b'{"label": 1}'},
            {"__key__": "c", "png": image_bytes(120), "cls": b"0"},  # labelled, no caption
            {"__key__": "d", "png": image_bytes(60), "json": b"{}"},  # neither: skipped, counted
        ],
    )
    metrics = run_eval(tiny, EvalSet("val", [str(tmp_path / "0.tar")], ["dark", "light"], ["a {} photo"]))
    assert metrics["val_samples"] == 3 and metrics["val_skipped"] == 1
    assert metrics["zeroshot_samples"] == 2  # b and c
    assert metrics["i2t_r5"] == 1.0 and metrics["t2i_r5"] == 1.0  # 2 images, 3 captions: all within 5


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


@pytest.mark.parametrize(
    "make_val, message",
    [
        (lambda d: (d / "val.tar").write_text("not a tar"), "cannot read its first sample"),
        (
            lambda d: write_samples(d / "val.tar", [{"__key__": "a", "png": image_bytes(), "cls": b"1"}]),
            "samples have labels but no captions, and the set has no class names",
        ),
        (
            lambda d: write_samples(d / "val.tar", [{"__key__": "a", "jpg": b"garbage", "txt": b"x"}]),
            ".jpg does not decode",
        ),
    ],
)
def test_a_bad_eval_set_is_refused_before_training(tmp_path, capsys, monkeypatch, make_val, message):
    train_dir = caption_shards(tmp_path / "train")
    make_val(tmp_path)
    code, lines = refusal(
        capsys,
        monkeypatch,
        f"run_dir={tmp_path / 'run'}",
        *webdataset_run_overrides(train_dir),
        f"data.val_shards={tmp_path}/val.tar",
    )
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: data.val_shards") and message in lines[0], (
        lines
    )


def test_retrieval_metrics_equal_open_clip_trains_get_clip_metrics():
    """One caption per image (open_clip's case): recall@k, mean and median rank as open_clip_train computes them."""
    from open_clip_train.train import get_clip_metrics

    from clipdist.train.evaluate import SIMILARITY_BLOCK, retrieval_metrics

    generator = torch.Generator().manual_seed(0)
    images = torch.nn.functional.normalize(torch.randn(300, 16, generator=generator), dim=-1)
    texts = torch.nn.functional.normalize(images + 0.9 * torch.randn(300, 16, generator=generator), dim=-1)
    theirs = get_clip_metrics(images, texts, 1.0)
    ours = retrieval_metrics(images, texts, torch.arange(300))
    for name, short in (("image_to_text", "i2t"), ("text_to_image", "t2i")):
        assert ours[f"{short}_mean_rank"] == pytest.approx(float(theirs[f"{name}_mean_rank"]))
        assert ours[f"{short}_median_rank"] == theirs[f"{name}_median_rank"]
        for k in (1, 5, 10):
            assert ours[f"{short}_r{k}"] == pytest.approx(float(theirs[f"{name}_R@{k}"]))
    assert SIMILARITY_BLOCK > 300 * 300  # one block here; the blocked path is the integration test's (3 ranks)


def test_tied_captions_and_images_count_against_retrieval_not_for_it():
    """200 captions holding 10 distinct strings (each shared by 20 images): a caption tied with its copies is no
    hit. Pessimistic ranks: every copy that belongs to another image counts above the true one, so R@1 is 0 and
    the mean rank at least 19 (strict ranks gave 0.905 on such a set); the same for duplicated images."""
    from clipdist.train.evaluate import SIMILARITY_BLOCK, retrieval_metrics

    generator = torch.Generator().manual_seed(3)
    images = torch.nn.functional.normalize(torch.randn(200, 16, generator=generator), dim=-1)
    distinct = torch.nn.functional.normalize(torch.randn(10, 16, generator=generator), dim=-1)
    texts = distinct[torch.arange(200) % 10]
    metrics = retrieval_metrics(images, texts, torch.arange(200))
    assert metrics["i2t_r1"] == 0.0 and metrics["i2t_mean_rank"] >= 20  # ranks are 1-based
    assert metrics["i2t_r10"] == 0.0  # 19 copies of the own caption tie with it
    same_images = images[torch.arange(200) % 10]  # every image repeated: no caption finds its own image for free
    assert retrieval_metrics(same_images, images, torch.arange(200))["t2i_r1"] == 0.0
    unique = retrieval_metrics(images, images, torch.arange(200))  # no ties: every image finds its own caption
    assert unique["i2t_r1"] == 1.0 and unique["t2i_r1"] == 1.0
    assert SIMILARITY_BLOCK > 200 * 200


def test_the_validation_loss_is_open_clips_clip_loss_over_blocks():
    from open_clip.loss import ClipLoss

    from clipdist.train.evaluate import clip_loss_in_blocks

    generator = torch.Generator().manual_seed(1)
    images = torch.nn.functional.normalize(torch.randn(20, 8, generator=generator), dim=-1)
    texts = torch.nn.functional.normalize(torch.randn(20, 8, generator=generator), dim=-1)
    blocks = [(0, 8), (8, 16), (16, 20)]
    expected = sum(ClipLoss()(images[a:b], texts[a:b], torch.tensor(10.0)).item() * (b - a) for a, b in blocks) / 20
    assert clip_loss_in_blocks(images, texts, 10.0, 8) == pytest.approx(expected, rel=1e-6)


def test_ranking_in_small_blocks_equals_ranking_the_whole_matrix(monkeypatch):
    from clipdist.train import evaluate as evaluation

    generator = torch.Generator().manual_seed(2)
    images = torch.nn.functional.normalize(torch.randn(50, 8, generator=generator), dim=-1)
    texts = torch.nn.functional.normalize(torch.randn(80, 8, generator=generator), dim=-1)
    owners = torch.randint(0, 50, (80,), generator=generator).sort().values
    whole = evaluation.retrieval_metrics(images, texts, owners)
    monkeypatch.setattr(evaluation, "SIMILARITY_BLOCK", 7 * 80)  # 7 images (or captions) at a time
    assert evaluation.retrieval_metrics(images, texts, owners) == whole


def test_your_own_val_shards_beside_a_built_in_training_source_are_the_ones_evaluated(tmp_path, cache_dir):
    """data.val_shards with data.source=digits was ignored for the source's own set (a silent fallback)."""
    from omegaconf import OmegaConf

    from clipdist.data.sources import resolve_shards

    root = pets(tmp_path / "wds_pets")
    data = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(DataConfig), {"val_shards": str(root), "cache_dir": str(cache_dir)})
    )
    (val,) = resolve_shards(data).evals
    assert all(url.startswith(str(root)) for url in val.urls) and val.classnames == ["cat", "dog"]


def _image_folder(root, classes, per_class=4):
    import numpy as np
    from PIL import Image

    generator = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(generator.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


def test_an_image_folder_evaluates_as_the_same_images_in_clip_benchmark_shards(tmp_path, tiny):
    """torchvision's ImageFolder layout (open_clip's --imagenet-val): classes in sorted order, names from the
    folders; the metrics equal those of the same images written as clip_benchmark shards (one per class)."""
    from clipdist.data.sources import eval_set

    root = _image_folder(tmp_path / "folder", ["tabby_cat", "golden_retriever", "red_fox"])
    folder_set = eval_set("imagenet", str(root), [], ["a photo of a {}."])
    assert folder_set.classnames == ["golden retriever", "red fox", "tabby cat"]
    shards = tmp_path / "wds" / "test"
    shards.mkdir(parents=True)
    for label, name in enumerate(sorted(p.name for p in root.iterdir())):
        write_samples(
            shards / f"{label}.tar",
            [
                {"__key__": f"{name}-{i}", "png": (root / name / f"{i}.png").read_bytes(), "cls": str(label).encode()}
                for i in range(4)
            ],
        )
    (tmp_path / "wds" / "classnames.txt").write_text("\n".join(folder_set.classnames) + "\n")
    shard_set = eval_set("imagenet", str(tmp_path / "wds"), [], ["a photo of a {}."])
    ours, theirs = run_eval(tiny, folder_set), run_eval(tiny, shard_set)
    assert ours == theirs and ours["imagenet/zeroshot_samples"] == 12


def test_an_imagenet_folder_gets_open_clips_class_names_and_openais_templates(tmp_path):
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

    from clipdist.data.sources import DEFAULT_TEMPLATES, eval_set

    root = _image_folder(tmp_path / "val", [f"n{index:08d}" for index in range(1000)], per_class=1)
    imagenet = eval_set("imagenet", str(root), [], DEFAULT_TEMPLATES)
    assert imagenet.classnames == list(IMAGENET_CLASSNAMES) and len(imagenet.templates) == 80
    assert imagenet.templates[0] == "a bad photo of a {}." and len(imagenet.urls) == 1000


def test_open_clip_trains_tie_rule_gives_its_numbers_on_repeated_captions():
    """data.retrieval_ties=open_clip: open_clip_train's own get_clip_metrics (from its wheel) on the same features,
    ten captions repeated over 200 images: every metric equal; the default rule stays pessimistic about ties."""
    import torch.nn.functional as F
    from open_clip_train.train import get_clip_metrics

    from clipdist.train.evaluate import retrieval_metrics

    generator = torch.Generator().manual_seed(0)
    images = F.normalize(torch.randn(200, 16, generator=generator), dim=-1)
    prompts = F.normalize(torch.randn(10, 16, generator=generator), dim=-1)
    texts = prompts[torch.arange(200) % 10]
    scale = torch.tensor(14.3)
    theirs = get_clip_metrics(images, texts, scale)
    ours = retrieval_metrics(images, texts, torch.arange(200), ties="open_clip", logit_scale=scale)
    names = {"i2t": "image_to_text", "t2i": "text_to_image"}
    for key, value in ours.items():
        if key.split("_")[0] in names:
            stem, rest = key.split("_", 1)
            other = theirs[
                f"{names[stem]}_{rest.replace('r', 'R@', 1) if rest[0] == 'r' and rest[1].isdigit() else rest}"
            ]
            assert value == pytest.approx(float(other), abs=0), key
    assert retrieval_metrics(images, texts, torch.arange(200))["i2t_r1"] == 0.0  # ties count against the image
    with pytest.raises(ValueError, match="one caption per image"):
        retrieval_metrics(images, texts[:100], torch.arange(100) * 2, ties="open_clip")


def test_a_blank_class_name_and_a_set_named_twice_are_refused(capsys):
    """A blank class name's prompts name no class ("a photo of ."); a second --set of one name was dropped."""
    from clipdist.cli import main as cli

    with pytest.raises(ValueError, match="data.eval_sets.v class names: name 1 of 3 is blank"):
        EvalSet("v", ["x.tar"], ["a", " ", "c"])
    assert cli(["eval", "clipdist-tiny", "--set", "v=/a", "--set", "v=/b"]) == 2
    assert "--set v=... given 2 times: name each set once" in capsys.readouterr().err


def test_an_output_file_a_command_did_not_write_is_refused_before_the_work(tmp_path, capsys, monkeypatch):
    """`--out` replaces its file whole: a run's own log, a folder, a file in a folder that is not there are refused
    before the evaluation (minutes) runs; a result it wrote before is replaced (eval twice into one file)."""
    from clipdist.cli import main
    from clipdist.tools import evaluation

    monkeypatch.setattr(evaluation, "run_eval", lambda *a, **k: {"dense/miou": 0.5})
    log = tmp_path / "train.log"
    log.write_text("[2026-11-29 21:00:00] step 1 loss 2.3\n")
    (tmp_path / "folder").mkdir()
    for out, said in (
        (log, "exists and is not a JSON file a clipdist command wrote"),
        (tmp_path / "folder", "is a folder: name a file"),
        (tmp_path / "missing" / "m.json", f"its folder {tmp_path / 'missing'} does not exist"),
    ):
        assert main(["eval", "run", "--dense", "--out", str(out)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and f"--out {out}" in lines[0] and said in lines[0], lines
    assert log.read_text().startswith("[2026")
    for _ in range(2):
        assert main(["eval", "run", "--dense", "--json", "--out", str(tmp_path / "m.json")]) == 0
    assert json.loads((tmp_path / "m.json").read_text()) == {"dense/miou": 0.5}


def test_the_battery_page_replaces_only_a_page_it_wrote(tmp_path):
    from clipdist.files import check_output
    from clipdist.tools.gpu_battery import is_page, page

    readme = tmp_path / "README.md"
    readme.write_text("# clipdist\n")
    with pytest.raises(ValueError, match="is not a battery page"):
        check_output(readme, "--doc", is_page, kind="a battery page")
    (tmp_path / "bench" / "old.md").parent.mkdir()
    (tmp_path / "bench" / "old.md").write_text(page([{"device": "NVIDIA H200", "section": "step", "what": "B/16"}]))
    check_output(tmp_path / "bench" / "old.md", "--doc", is_page)
    check_output(tmp_path / "new" / "page.md", "--doc", is_page, make_folder=True)  # the battery makes its folder
