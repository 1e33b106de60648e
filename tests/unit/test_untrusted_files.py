"""Nothing clipdist reads runs code: checkpoints and weights that would run `touch <marker>` when unpickled are
refused in one line, before any rank starts, by every route a user hands them over — and the marker never
appears. Real clipdist checkpoints with one extra object in one part each (DCP progress, DCP metadata, a DCP
item, a .pt checkpoint), weights files, a protocol-0 INST pickle."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from fixtures import untrusted_checkpoints
from helpers import refusal

from clipdist.cli import main as cli

CHECKPOINTS = ["dcp_progress", "dcp_metadata", "dcp_item", "pt_checkpoint"]
WEIGHTS = ["pt_weights", "inst_weights", *CHECKPOINTS]


@pytest.fixture(scope="module")
def untrusted(trained_run, tmp_path_factory):
    folder = tmp_path_factory.mktemp("untrusted")
    marker = folder / "code-ran"
    made = untrusted_checkpoints(trained_run / "checkpoints" / "step_00000030.dcp", folder, marker)
    assert not marker.exists()
    return made, marker


def refused_in_one_line(lines: list[str], path) -> None:
    assert len(lines) == 1 and lines[0].startswith("error: ") and "refused" in lines[0], lines
    assert str(path) in lines[0] and "clipdist trust" in lines[0], lines


@pytest.mark.parametrize("name", WEIGHTS)
def test_model_checkpoint_that_would_run_code_is_refused(untrusted, tmp_path, cache_dir, capsys, monkeypatch, name):
    made, marker = untrusted
    code, lines = refusal(
        capsys,
        monkeypatch,
        f"run_dir={tmp_path / 'run'}",
        f"data.cache_dir={cache_dir}",
        f"model.checkpoint={made[name]}",
    )
    assert code == 2 and not marker.exists()
    refused_in_one_line(lines, made[name].parent if name.startswith("dcp") else made[name])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_resume_from_a_checkpoint_that_would_run_code_is_refused(
    untrusted, tmp_path, cache_dir, capsys, monkeypatch, name
):
    made, marker = untrusted
    code, lines = refusal(
        capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}", f"resume={made[name]}"
    )
    assert code == 2 and not marker.exists()
    refused_in_one_line(lines, made[name])


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_checkpoint_dropped_into_a_run_is_refused_not_resumed(
    untrusted, trained_run, tmp_path, cache_dir, capsys, monkeypatch, name
):
    """The silent route: a real run (resume=auto) whose newest checkpoint someone replaced."""
    made, marker = untrusted
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    shutil.move(made[name], run_dir / "checkpoints" / made[name].name)
    code, lines = refusal(
        capsys, monkeypatch, f"run_dir={run_dir}", f"data.cache_dir={cache_dir}", "optim.max_steps=200"
    )
    assert code == 2 and not marker.exists()
    refused_in_one_line(lines, run_dir / "checkpoints" / made[name].name)
    shutil.move(run_dir / "checkpoints" / made[name].name, made[name])


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_export_of_a_checkpoint_that_would_run_code_is_refused(untrusted, tmp_path, capsys, name):
    made, marker = untrusted
    run_dir = made[name].parent.parent  # the run directory the checkpoint is the newest of
    assert cli(["export", str(run_dir), "--out", str(tmp_path / "out")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "refused" in lines[0] and not marker.exists(), lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["pt_weights", "pt_checkpoint", "dcp_progress", "dcp_metadata", "dcp_item"])
def test_a_trusted_file_is_converted_once_and_then_read_safely(untrusted, trained_run, tmp_path, capsys, name):
    """`clipdist trust` reads the file the unsafe way (the code runs: that is what trusting means) and writes a
    copy of tensors and plain values, which clipdist then reads — the same weights, nothing refused."""
    from clipdist.checkpoint.weights import read_run_checkpoint, read_weights, verify

    made, marker = untrusted
    out = tmp_path / ("copy.dcp" if made[name].is_dir() else "copy.pt")
    assert cli(["trust", str(made[name]), "--out", str(out)]) == 0, capsys.readouterr().err
    assert marker.exists()  # trusting ran it, as the command says it will
    marker.unlink()
    if name != "pt_weights":
        verify(out)
    weights = read_weights(out)
    expected = read_run_checkpoint(trained_run / "checkpoints" / "step_00000030.dcp")[0]
    assert weights.keys() == expected.keys() and all(torch.equal(weights[key], expected[key]) for key in weights)
    assert not marker.exists()  # reading the copy ran nothing


def test_trust_refuses_what_no_checkpoint_holds(tmp_path, capsys):
    torch.save({"state_dict": {"w": torch.ones(2)}, "hook": print}, tmp_path / "odd.pt")
    assert cli(["trust", str(tmp_path / "odd.pt")]) == 2
    assert (
        "['hook'] is a builtins.builtin_function_or_method, which no checkpoint or weights file holds"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "odd.trusted.pt").exists()


def test_trust_of_a_file_torch_cannot_read_is_one_line(tmp_path, capsys):
    """Not a pickle, a truncated zip, a checkpoint folder whose metadata is damaged (DCP's failure is a BaseException,
    past `except Exception`; its loader logs a traceback of its own): one line naming the file, nothing written."""
    (tmp_path / "text.pt").write_text("not a checkpoint\n")
    torch.save({"w": torch.ones(64)}, tmp_path / "whole.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "whole.pt").read_bytes()[:200])
    folder = tmp_path / "damaged.dcp"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"\x05 not a pickle")
    torch.save({"step": 1}, folder / "progress.pt")
    for source in ("text.pt", "cut.pt", "damaged.dcp"):
        assert cli(["trust", str(tmp_path / source), "--out", str(tmp_path / f"out-{source}")]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and f"{tmp_path / source} cannot be read by torch (" in lines[0], lines
        assert not (tmp_path / f"out-{source}").exists()
    assert not list(tmp_path.glob("clipdist-bug-*")) and not list(Path.cwd().glob("clipdist-bug-*"))


def test_a_base_exception_that_is_not_an_exit_is_reported_as_a_bug(capsys, monkeypatch, tmp_path):
    """DCP's CheckpointException derives from BaseException: where one escapes, it is one line and a file, not the
    interpreter's traceback; Ctrl-C, exits and other BaseExceptions (a test's own outcome) pass as they mean to."""
    from torch.distributed.checkpoint.api import CheckpointException

    from clipdist.tools import report

    class Outcome(BaseException):
        pass

    monkeypatch.chdir(tmp_path)
    for raised, expected in (
        (CheckpointException("x", {}), 1),
        (KeyboardInterrupt(), KeyboardInterrupt),
        (Outcome(), Outcome),
    ):

        def failing(_run_dir, raised=raised):
            raise raised

        monkeypatch.setattr(report, "write_report", failing)
        if expected != 1:
            with pytest.raises(expected):
                cli(["report", str(tmp_path)])
            continue
        assert cli(["report", str(tmp_path)]) == expected
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "internal error (a bug in clipdist" in lines[0], lines
        assert "CheckpointException" in lines[0] and list(tmp_path.glob("clipdist-bug-*"))


def test_dcp_metadata_may_name_an_enum_member_by_getattr_and_nothing_else(tmp_path):
    """Python 3.11.2 (Debian's) pickles an enum member as getattr(Enum, 'NAME'): DCP's metadata then holds
    builtins.getattr. Allowed for a member of an allowed enum; any other getattr is refused."""
    import io
    import pathlib
    import pickle

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from clipdist.checkpoint.weights import UnsafeFileError, _MetadataUnpickler

    class ByGetattr:
        def __init__(self, owner, name):
            self.owner, self.name = owner, name

        def __reduce__(self):
            return getattr, (self.owner, self.name)

    member = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    loaded = _MetadataUnpickler(io.BytesIO(pickle.dumps(ByGetattr(_MEM_FORMAT_ENCODING, member.name))), tmp_path).load()
    assert loaded is member
    for owner, name in ((_MEM_FORMAT_ENCODING, "__class__"), (pathlib.Path, "__init__")):
        with pytest.raises(UnsafeFileError, match="refused"):
            _MetadataUnpickler(io.BytesIO(pickle.dumps(ByGetattr(owner, name))), tmp_path).load()


def test_one_huge_caption_is_bounded_before_bpe_and_real_captions_keep_their_tokens():
    """A 1 MB single-word caption would cost BPE minutes (the tokenizer is not bounded per caption); bounded, it is
    milliseconds, and captions a dataset really holds tokenize exactly as open_clip's tokenizer does."""
    import random
    import string
    import time

    import open_clip
    import torch

    from clipdist.model.factory import get_tokenizer

    tokenizer = get_tokenizer()
    theirs = open_clip.get_tokenizer("ViT-B-32", context_length=tokenizer.context_length)
    rng = random.Random(0)
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(1_000_000))
    started = time.process_time()
    assert tokenizer([word]).shape == (1, tokenizer.context_length)
    assert time.process_time() - started < 2  # unbounded: 8,000 letters alone take ~2 s
    real = [
        "a photo of a cat",
        "A   spaced\\tcaption\\n" * 40,
        "é" * 300 + " tail",
        "numbers 123 and ünïcode, punctuation!",
    ]
    assert torch.equal(tokenizer(real), theirs(real))


def test_an_image_under_pils_pixel_limit_is_still_bounded_by_its_decoded_bytes(monkeypatch):
    """An RGBA PNG of 81 Mpixel (a few hundred KB, under PIL's 89-Mpixel limit) would cost ~2.5 GB to decode and
    convert: refused as a decompression bomb before decoding (here at a bound of 8 MiB and 1.5 Mpixel, to stay
    fast: the same arithmetic); a smaller one decodes."""
    import io

    from PIL import Image

    from clipdist.data import samples

    def png(size):
        buffer = io.BytesIO()
        Image.new("RGBA", size, (1, 2, 3, 4)).save(buffer, "PNG")
        return buffer.getvalue()

    assert 9000 * 9000 * (4 + 3 + 4) > samples.MAX_DECODE_BYTES and 9000 * 9000 < Image.MAX_IMAGE_PIXELS
    monkeypatch.setattr(samples, "MAX_DECODE_BYTES", 8 << 20)
    big = png((1200, 1200))  # 1200² × 11 bytes: 15 MiB
    with pytest.raises(Image.DecompressionBombError, match="MiB to decode and convert"):
        samples.load_rgb(samples.EncodedImage(big, Image.open(io.BytesIO(big))), (224, 224))
    ok = png((600, 600))  # 3.8 MiB
    assert samples.load_rgb(samples.EncodedImage(ok, Image.open(io.BytesIO(ok))), (224, 224))[0].size == (600, 600)


def test_a_model_folders_weights_linked_outside_it_are_refused_but_a_hub_caches_layout_reads(tmp_path):
    """An export / local-dir folder whose weights file is a link to a file elsewhere: refused, nothing read
    through it; a link inside the folder, or a hub cache's snapshots/<rev>/x -> ../../blobs/<hash>, reads."""
    import torch
    from safetensors.torch import save_file

    from clipdist.checkpoint.weights import UnsafeFileError, read_weights

    elsewhere = tmp_path / "elsewhere.safetensors"
    save_file({"w": torch.ones(2)}, elsewhere)
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "open_clip_model.safetensors").symlink_to(elsewhere)
    with pytest.raises(UnsafeFileError, match="symbolic link to a file outside its folder"):
        read_weights(folder)
    cache = tmp_path / "models--org--name"
    (cache / "blobs").mkdir(parents=True)
    (cache / "snapshots" / "abc").mkdir(parents=True)
    save_file({"w": torch.ones(2)}, cache / "blobs" / "123")
    (cache / "snapshots" / "abc" / "open_clip_model.safetensors").symlink_to("../../blobs/123")
    assert torch.equal(read_weights(cache / "snapshots" / "abc")["w"], torch.ones(2))


def test_json_nested_past_the_parser_is_refused_like_any_json_that_does_not_parse(tmp_path):
    """`[[[…` 100,000 deep raised RecursionError out of json.loads, past every `except ValueError`: a shard's .json
    ended the loader, a model folder's config an evaluation. Every JSON reader goes through files.json_of."""
    from clipdist.checkpoint.weights import read_small_json
    from clipdist.data.samples import SampleError, SampleKeys, label_of
    from clipdist.files import json_of

    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(ValueError, match="nested too deeply"):
        json_of(deep)
    (tmp_path / "open_clip_config.json").write_bytes(deep)
    with pytest.raises(ValueError, match="nested too deeply"):
        read_small_json(tmp_path / "open_clip_config.json")
    sample = {"__key__": "000", "__url__": "shard.tar", "json": deep, "txt": b"a cat"}
    with pytest.raises(SampleError, match=r"\.json does not parse \(nested too deeply"):
        label_of(sample)
    with pytest.raises(SampleError, match=r"\.json does not parse \(nested too deeply"):
        SampleKeys(caption_keys=("json:caption",)).caption(sample)
