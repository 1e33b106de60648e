"""A model config is data: nothing a config file, an export folder or a `local-dir:` folder carries makes clipdist
import code or reach the network (issue: open_clip hands `text_cfg.tokenizer_kwargs` and `hf_tokenizer_name` to
transformers' AutoTokenizer, which imports the .py files a tokenizer_config.json's auto_map names). Every route
refuses such a config in one line, before anything is built; the marker the hostile code would write never appears."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from fixtures import caption_shards
from helpers import refusal

from clipdist.checkpoint.weights import UnsafeFileError
from clipdist.cli import main as cli
from clipdist.model.factory import CONFIG_DIR, check_config_is_data, resolve_model_name


def _hostile_tokenizer(folder: Path, marker: Path) -> Path:
    """A tokenizer folder whose tokenizer_config.json names code (auto_map) that writes `marker` when imported."""
    folder.mkdir(parents=True)
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}, "tokenizer_class": "EvilTokenizer"})
    )
    return folder


def _config(tmp_path: Path, marker: Path, case: str) -> dict:
    config = json.loads((CONFIG_DIR / "clipdist-tiny.json").read_text())
    text = config["text_cfg"]
    if case == "trust_remote_code":
        text.update(
            hf_tokenizer_name=str(_hostile_tokenizer(tmp_path / "tok", marker)),
            tokenizer_kwargs={"trust_remote_code": True},
        )
    elif case == "auto_map":
        text.update(hf_tokenizer_name=str(_hostile_tokenizer(tmp_path / "tok", marker)))
    elif case == "hub_tokenizer":
        text.update(hf_tokenizer_name="someone/their-tokenizer")
    elif case == "hub_text_tower":
        text.update(hf_model_name="someone/their-model", hf_tokenizer_name="someone/their-model")
    elif case == "tokenizer_option":
        text.update(hf_tokenizer_name="xlm-roberta-base", tokenizer_kwargs={"cache_dir": "/tmp/x"})
    elif case == "timm_weights":
        config["vision_cfg"].update(timm_model_name="vit_tiny_patch16_224", timm_model_pretrained=True)
    elif case == "timm_kwargs_weights":  # timm would read a file as the tower's weights (pretrained_cfg_overlay)
        config["vision_cfg"] = {
            "timm_model_name": "naflexvit_base_patch16_gap",
            "timm_model_kwargs": {
                "embed_dim": 64,
                "depth": 1,
                "num_heads": 2,
                "pretrained_cfg_overlay": {"file": str(marker)},
            },
        }
    elif case == "timm_kwargs_object":  # only plain values pass to timm.create_model
        config["vision_cfg"] = {
            "timm_model_name": "naflexvit_base_patch16_gap",
            "timm_model_kwargs": {"embed_dim": 64, "depth": 1, "num_heads": 2, "act_layer": {}},
        }
    return config


CASES = [
    "trust_remote_code",
    "auto_map",
    "hub_tokenizer",
    "hub_text_tower",
    "tokenizer_option",
    "timm_weights",
    "timm_kwargs_weights",
    "timm_kwargs_object",
]


@pytest.fixture(params=CASES)
def hostile(request, tmp_path):
    marker = tmp_path / "code-ran"
    config = _config(tmp_path, marker, request.param)
    config_file = tmp_path / f"hostile-{request.param}.json"
    config_file.write_text(json.dumps(config))
    export = tmp_path / "export"
    export.mkdir()
    (export / "open_clip_config.json").write_text(json.dumps({"model_cfg": config, "preprocess_cfg": {}}))
    return config_file, export, marker


def _one_refusal(lines: list[str]) -> None:
    assert len(lines) == 1 and "error: " in lines[0] and "refused" in lines[0], lines


@pytest.mark.parametrize("route", ["config_file", "local_dir"])
def test_training_refuses_a_model_config_that_would_run_code_or_fetch(hostile, route, tmp_path, capsys, monkeypatch):
    config_file, export, marker = hostile
    name = str(config_file) if route == "config_file" else f"local-dir:{export}"
    code, lines = refusal(capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", f"model.name={name}")
    assert code != 0 and not marker.exists()
    _one_refusal(lines)


def test_eval_refuses_an_export_or_a_config_that_would_run_code(hostile, tmp_path, capsys):
    config_file, export, marker = hostile
    val = caption_shards(tmp_path / "val", shards=1, per_shard=4)
    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(b"")
    for argv in (
        ["eval", str(export), "--set", f"val={val}"],
        ["eval", str(weights), "--model", str(config_file), "--set", f"val={val}"],
    ):
        code = cli(argv)
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert code != 0 and not marker.exists(), argv
        _one_refusal(lines)


def test_open_clips_own_configs_and_plain_local_tokenizers_are_data(tmp_path):
    """What is not refused: a config naming a tokenizer open_clip's own configs use, and a local tokenizer folder
    without an auto_map (the check is not a blanket ban on Hugging Face tokenizers)."""
    siglip = json.loads(json.dumps(__import__("open_clip").get_model_config("ViT-B-16-SigLIP")))
    check_config_is_data(siglip, "ViT-B-16-SigLIP")
    local = tmp_path / "tok"
    local.mkdir()
    (local / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    config = json.loads((CONFIG_DIR / "clipdist-tiny.json").read_text())
    config["text_cfg"]["hf_tokenizer_name"] = str(local)
    check_config_is_data(config, "local")
    (tmp_path / "plain.json").write_text(json.dumps(config))
    assert resolve_model_name(str(tmp_path / "plain.json")) == "plain"
    with pytest.raises(UnsafeFileError, match=r"refused: .*'org/\\x1b\[2J"):  # text from the file is escaped
        config["text_cfg"]["hf_tokenizer_name"] = "org/\x1b[2Jname"
        check_config_is_data(config, "escaped")


@pytest.mark.parametrize(
    "which, kind",
    [
        ("tokenizer_config", "fifo"),
        ("tokenizer_config", "dev_zero"),
        ("tokenizer_config", "huge"),
        ("model_config", "huge"),
    ],
)
def test_a_config_that_is_a_fifo_a_device_or_huge_is_refused_without_reading_it(tmp_path, which, kind):
    """The tokenizer config a model config names, as a FIFO (reading would hang), /dev/zero (reading would never
    end) or a 17 MiB file, and a 17 MiB model config: refused at once, in one line, before a byte is read. (A model
    config path that is not a regular file is not taken for a config at all.)"""
    config = json.loads((CONFIG_DIR / "clipdist-tiny.json").read_text())
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    config["text_cfg"]["hf_tokenizer_name"] = str(tokenizer)
    folder = tmp_path / "export"
    folder.mkdir()
    hostile = folder / "open_clip_config.json" if which == "model_config" else tokenizer / "tokenizer_config.json"
    if which == "tokenizer_config":
        (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": config}))
    if kind == "fifo":
        os.mkfifo(hostile)
    elif kind == "dev_zero":
        hostile.symlink_to("/dev/zero")
    else:
        with hostile.open("wb") as file:
            file.truncate(17 << 20)  # sparse: no disk used
    started = time.monotonic()
    with pytest.raises(UnsafeFileError, match="refused: (not a regular file|larger than 16 MiB)") as refused:
        resolve_model_name(f"local-dir:{folder}")
    assert time.monotonic() - started < 5 and "\n" not in str(refused.value)


@pytest.mark.parametrize("route", ["vocab_file", "link", "fifo"])
def test_a_tokenizer_folder_that_reaches_outside_or_hangs_is_refused(tmp_path, route):
    """A model JSON's hf_tokenizer_name folder whose tokenizer_config.json names vocab_file=/etc/passwd, whose vocab
    is a link out of the folder, or a FIFO: one line, before transformers opens anything."""
    folder = tmp_path / "tok"
    folder.mkdir()
    config = {"tokenizer_class": "CLIPTokenizer"}
    if route == "vocab_file":
        config["vocab_file"] = "/etc/passwd"
    elif route == "link":
        (folder / "vocab.json").symlink_to("/etc/passwd")
    else:
        os.mkfifo(folder / "vocab.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    model = json.loads((CONFIG_DIR / "clipdist-tiny.json").read_text())
    model["text_cfg"]["hf_tokenizer_name"] = str(folder)
    with pytest.raises(UnsafeFileError, match="outside its folder|not a regular file") as raised:
        check_config_is_data(model, "model.name=x.json")
    assert "\n" not in str(raised.value)


def test_a_timm_tower_named_on_the_hub_is_refused():
    """vision_cfg.timm_model_name=hf-hub:...: timm fetches its config (and more) from the hub when built."""
    model = json.loads((CONFIG_DIR / "clipdist-tiny.json").read_text())
    model["vision_cfg"] = {"timm_model_name": "hf-hub:timm/vit_tiny_patch16_224"}
    with pytest.raises(UnsafeFileError, match="timm would fetch it from the hub"):
        check_config_is_data(model, "model.name=x.json")


def test_a_config_files_name_does_not_choose_its_tokenizer(tmp_path, monkeypatch):
    """open_clip picks SigLIP's Gemma tokenizer, fetched from the network, for any model whose name holds "siglip2";
    a config file's name is its stem. The tokenizer of a config file is what its text_cfg says: open_clip's BPE,
    from its wheel, where it names no Hugging Face tokenizer."""
    import open_clip

    from clipdist.model.factory import get_tokenizer

    config = json.loads((CONFIG_DIR / "clipdist-tiny.json").read_text())
    path = tmp_path / "my-siglip2-tiny.json"
    path.write_text(json.dumps(config))
    monkeypatch.setattr(open_clip.tokenizer, "SigLipTokenizer", None)  # reaching for it would fail the test
    tokenizer = get_tokenizer(str(path))
    assert tokenizer(["a photo of a cat"]).shape == (1, config["text_cfg"]["context_length"])
    assert tokenizer(["a photo of a cat"]).tolist() == get_tokenizer("clipdist-tiny")(["a photo of a cat"]).tolist()
