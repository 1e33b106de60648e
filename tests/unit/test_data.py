import io
import logging
import math
import tarfile

import numpy as np
import pytest
import torch
import webdataset as wds
from fixtures import caption_shards, image_bytes, pets, write_samples, write_tar
from helpers import identity_transform, refusal, train_stream
from PIL import Image

from clipdist.cli import main as cli
from clipdist.data.batch import zero_counts
from clipdist.data.builtin import builtin_shards
from clipdist.data.faults import DataError, SkipCounter
from clipdist.data.images import CaptionTokens, ImageBatcher
from clipdist.data.samples import (
    SampleError,
    decode_image,
    eval_record,
    label_of,
    to_rgb,
)
from clipdist.data.sources import eval_set, expand_shards
from clipdist.data.tar_samples import TruncatedShardError, tar_files, tar_samples
from clipdist.errors import said
from clipdist.files import PUBLISHED
from clipdist.model.factory import get_tokenizer


def png(value):
    return image_bytes(value)


@pytest.mark.parametrize("is_train", [True, False])
def test_batched_image_conversion_is_bit_identical_to_the_transform(is_train):
    """ToTensor + Normalize once per batch (and PixelNormalize after a copy of uint8 pixels) give the
    per-image transform's floats bit for bit, from the same decoded crop."""
    import open_clip
    from torchvision import transforms as T

    from clipdist.data.images import PixelNormalize

    transform = open_clip.image_transform(
        32, is_train=is_train, mean=open_clip.OPENAI_DATASET_MEAN, std=open_clip.OPENAI_DATASET_STD
    )
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(8, 8), (40, 31), (32, 32)]]
    images += [Image.fromarray(rng.integers(0, 256, (20, 24), dtype=np.uint8))]  # L: open_clip converts it to RGB
    batcher = ImageBatcher(transform)
    after_crop = T.Compose(transform.transforms[1:]) if is_train else transform  # the batcher crops as it decodes
    expected, parts = [], []
    for seed, image in enumerate(images):
        torch.manual_seed(seed)
        expected.append(after_crop(batcher.decode(image.copy())))
        torch.manual_seed(seed)
        parts.append(batcher(image))
    assert all(part.dtype == torch.uint8 for part in parts)  # the batched path was taken
    assert torch.equal(batcher.stack(parts), torch.stack(expected))
    pixels = batcher.stack(parts, pixels=True)
    assert pixels.dtype == torch.uint8 and pixels.shape == (4, 32, 32, 3)
    normalize = PixelNormalize(open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD)
    assert torch.equal(normalize(pixels), torch.stack(expected))  # on the device: the same floats
    mixed = [parts[0], transform.transforms[-1](transform.transforms[-2](np.asarray(parts[1])))]  # one converted alone
    assert torch.equal(batcher.stack(mixed), torch.stack(expected[:2]))
    assert batcher.stack(mixed, pixels=True).dtype == torch.float32  # not all pixels: normalized where made


def test_a_transform_without_totensor_and_normalize_is_applied_per_image():
    batcher = ImageBatcher(identity_transform)
    image = Image.new("L", (4, 4), 7)
    assert torch.equal(batcher.stack([batcher(image), batcher(image)]), torch.tensor([7.0, 7.0]))


def test_caption_tokens_are_the_tokenizers_and_the_cache_is_bounded():
    tokenizer = get_tokenizer()
    calls = []

    def counting(texts):
        calls.append(list(texts))
        return tokenizer(texts)

    tokens = CaptionTokens(counting, capacity=3)
    batch = ["a cat", "a dog", "a cat", "two birds", "a fish", "a dog"]
    assert torch.equal(tokens(batch), tokenizer(batch))  # more new captions than the capacity
    assert calls == [["a cat", "a dog", "two birds", "a fish"]]  # each new caption once, in one call
    assert len(tokens.known) == 3
    assert torch.equal(tokens(["a fish", "a cat"]), tokenizer(["a fish", "a cat"]))
    assert calls[-1] == ["a cat"]  # forgotten: the oldest first


def test_corrupt_image_and_empty_caption_are_skipped_and_counted(tmp_path):
    members = []
    for i in range(6):
        members += [(f"{i:03d}.png", png(i * 10)), (f"{i:03d}.txt", b"a caption")]
    members[2] = ("001.png", b"not an image")  # undecodable image
    members[5] = ("002.txt", b"   ")  # empty caption
    write_tar(tmp_path / "a.tar", members)
    stream = train_stream([tmp_path / "a.tar"], 2, identity_transform)
    batch = next(stream)
    assert batch["image"].tolist() == [0.0, 30.0]  # samples 1 (bad image) and 2 (empty caption) skipped
    assert batch["text"].shape[0] == 2 and batch.rows == 2
    assert batch.counts == [2, 0, 2]  # the skips made while reading it (samples, shards), its samples of the one source
    assert len(zero_counts(1)) == len(batch.counts)  # what a rank stopped while waiting sends to the step's agreement
    assert next(stream).counts[0] == 0


def eight_sample_shard(path):
    members = []
    for i in range(8):
        members += [(f"{i:03d}.png", png(i * 10)), (f"{i:03d}.txt", b"a caption")]
    write_tar(path, members)
    return path.read_bytes()


def member_offsets(data):
    """Byte offset of every member header in an uncompressed tar."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [member.offset for member in tar.getmembers()]


def read_all_once(urls):
    skips = SkipCounter(max_in_a_row=1000)
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(urls), tar_samples(handler=skips), wds.to_tuple("png", "txt", handler=skips)
    )
    return [key for key, _ in pipeline], skips.take()  # (samples, shards) skipped


def tar_of(format, members, compression=""):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=f"w:{compression}", format=format) as tar:
        for name, data in members:
            if data is None:  # a directory
                tar.addfile(_directory(name))
                continue
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1.5e9 + 0.25  # a float mtime: pax writes a header for it
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("a-link")
        link.type, link.linkname = tarfile.SYMTYPE, "x" * (60 if format == tarfile.USTAR_FORMAT else 120)
        tar.addfile(link)
    return buffer.getvalue()


def _directory(name):
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    return info


@pytest.mark.parametrize("format", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("compression", ["", "gz", "bz2", "xz"])
def test_tar_files_reads_what_tarfile_reads(format, compression):
    long_dir = "d" * 90 + "/" + "e" * 60  # ustar prefix field
    members = [
        ("s1.txt", b"caption"),
        ("dir", None),
        ("s1.png", bytes(range(256)) * 5),
        ("empty.cls", b""),
        (f"{long_dir}/s2.txt", b"in a deep folder"),
    ]
    if format != tarfile.USTAR_FORMAT:
        members += [("n" * 150 + ".txt", b"long name"), ("caf\u00e9-\u5b57.txt", b"unicode")]
    data = tar_of(format, members, compression)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        expected = [(m.name, tar.extractfile(m).read()) for m in tar if m.isreg()]
    assert list(tar_files(io.BytesIO(data))) == expected
    assert len(expected) == len(members) - 1


def test_tar_files_refuses_what_is_not_a_whole_tar():
    data = tar_of(tarfile.PAX_FORMAT, [("a.txt", b"x" * 700), ("b.txt", b"y")])
    with pytest.raises(tarfile.ReadError, match="empty file"):
        list(tar_files(io.BytesIO(b"")))
    with pytest.raises(tarfile.ReadError, match="invalid header"):
        list(tar_files(io.BytesIO(b"<html>not found</html>" * 40)))
    with pytest.raises(TruncatedShardError, match="inside a member"):
        list(tar_files(io.BytesIO(data[: 1024 + 600])))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        ends = tar.getmember("b.txt").offset  # where b.txt's pax header starts
    with pytest.raises(TruncatedShardError, match=f"at byte {ends}"):
        list(tar_files(io.BytesIO(data[:ends])))
    with pytest.raises(TruncatedShardError, match=f"damaged at byte {ends}"):
        list(tar_files(io.BytesIO(data[:ends] + b"\x7f" * 512 + data[ends + 512 :])))


@pytest.mark.parametrize("cut", ["at_member_boundary", "inside_data", "inside_header", "damaged_header"])
def test_truncated_or_damaged_shard_is_counted_and_reading_goes_on(tmp_path, cut):
    data = eight_sample_shard(tmp_path / "whole.tar")
    offsets = member_offsets(data)
    sixth_sample = offsets[10]  # header of 005.png
    damaged = {
        "at_member_boundary": data[:sixth_sample],
        "inside_data": data[: sixth_sample + 512 + 40],
        "inside_header": data[: sixth_sample + 100],
        "damaged_header": data[:sixth_sample] + b"\x7fgarbage" * 64 + data[sixth_sample + 512 :],
    }[cut]
    (tmp_path / "bad.tar").write_bytes(damaged)
    keys, skipped = read_all_once([str(tmp_path / "bad.tar"), str(tmp_path / "whole.tar")])
    assert skipped == (0, 1)  # the rest of the shard: one shard, counted apart from samples
    assert len(keys) == 5 + 8  # the five samples before the cut, then every sample of the next shard


def test_intact_shards_skip_nothing(tmp_path):
    eight_sample_shard(tmp_path / "whole.tar")
    keys, skipped = read_all_once([str(tmp_path / "whole.tar")] * 2)
    assert (len(keys), skipped) == (16, (0, 0))


def test_missing_shards_and_only_empty_ones_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="2 of 2 shards not found"):
        expand_shards(f"{tmp_path}/x-{{0..1}}.tar")
    (tmp_path / "empty.tar").write_bytes(b"")
    with pytest.raises(ValueError, match="every shard is an empty file"):
        expand_shards(str(tmp_path / "empty.tar"))


def test_an_empty_shard_among_good_ones_is_skipped_and_counted_as_a_bad_shard(tmp_path):
    """One failed download (a 0-byte file) among many does not block a run: it is skipped like any unreadable
    shard (it refused the whole run before)."""
    eight_sample_shard(tmp_path / "a.tar")
    (tmp_path / "b.tar").write_bytes(b"")
    urls = expand_shards(f"{tmp_path}/{{a,b}}.tar")
    assert urls == [str(tmp_path / "a.tar"), str(tmp_path / "b.tar")]
    keys, skipped = read_all_once(urls)
    assert (len(keys), skipped) == (8, (0, 1))  # no sample lost, one shard skipped


def test_fewer_shards_than_workers_times_ranks_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="1 shard\\(s\\) for 4 reader\\(s\\).*every reader needs at least one shard"):
        next(train_stream(["a.tar"], 2, identity_transform, workers=2, world_size=2))


def test_digits_become_cached_shards(tmp_path):
    train, val = builtin_shards("digits", str(tmp_path))
    train_urls, val_urls = expand_shards(train), expand_shards(val)
    assert len(train_urls) == 4 and len(val_urls) == 1
    with tarfile.open(val_urls[0]) as tar:
        names = tar.getnames()
    assert len([n for n in names if n.endswith(".png")]) == 359  # 20% of 1,797, held out
    assert builtin_shards("digits", str(tmp_path)) == (train, val)  # cached


def test_web_photos_are_web_like_jpegs_of_real_photographs():
    """The 224-px loader workload: JPEGs of 256-512 px on the short side, tens of KB, labelled by photograph."""
    import io

    from PIL import Image

    from clipdist.data.builtin import CLASSNAMES, _web_photos

    images, labels, names = _web_photos(None, samples=64)
    decoded = [Image.open(io.BytesIO(data)) for data in images]
    assert {image.format for image in decoded} == {"JPEG"} and {image.mode for image in decoded} == {"RGB"}
    assert all(256 <= min(image.size) <= 512 for image in decoded)
    assert 15_000 < np.mean([len(data) for data in images]) < 100_000
    assert names == CLASSNAMES["web_photos"] and len(set(labels.tolist())) > len(names) // 2


def test_fashion_mnist_without_the_package_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        builtin_shards("fashion_mnist", str(tmp_path), source_dir=str(tmp_path / "none"))


def test_make_shards_from_csv(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.png").write_bytes(png(i))
    (tmp_path / "pairs.csv").write_text("filepath\ttitle\n0.png\tzero\n1.png\tone\n2.png\ttwo\n")  # open_clip's
    assert (
        cli(
            [
                "make-shards",
                "--csv",
                str(tmp_path / "pairs.csv"),
                "--out",
                str(tmp_path / "out"),
                "--samples-per-shard",
                "2",
            ]
        )
        == 0
    )
    shards = sorted((tmp_path / "out").glob("*.tar"))
    assert [s.name for s in shards] == ["shard-000000.tar", "shard-000001.tar"]
    with tarfile.open(shards[0]) as tar:
        assert tar.extractfile("000000001.txt").read() == b"one"


# --- images of every mode ---------------------------------------------------------------------


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def decoded_mean(data: bytes, ext: str = "png") -> np.ndarray:
    image = decode_image({"__key__": "k", "__url__": "u", ext: data})
    assert image.mode == "RGB"
    return np.asarray(image, dtype=np.float64).mean(axis=(0, 1))


def test_16_bit_greyscale_is_scaled_not_clipped():
    data = encoded(Image.fromarray(np.full((4, 4), 30000, np.uint16)))
    assert Image.open(io.BytesIO(data)).mode.startswith("I")  # PIL reads it as 16-bit
    assert decoded_mean(data) == pytest.approx([30000 / 257] * 3, abs=0.6)  # PIL's convert gives 255


def test_alpha_is_composited_on_white_and_palettes_keep_their_colours():
    transparent_red = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    assert decoded_mean(encoded(transparent_red)) == pytest.approx([255, 255, 255])
    half_red = Image.new("RGBA", (4, 4), (255, 0, 0, 128))
    assert decoded_mean(encoded(half_red)) == pytest.approx([255, 127, 127], abs=1.5)
    grey_alpha = Image.new("LA", (4, 4), (0, 0))
    assert decoded_mean(encoded(grey_alpha)) == pytest.approx([255, 255, 255])
    palette = Image.new("RGB", (4, 4), (10, 200, 30)).convert("P", palette=Image.Palette.ADAPTIVE)
    assert decoded_mean(encoded(palette)) == pytest.approx([10, 200, 30], abs=2)
    palette.info["transparency"] = 0
    assert decoded_mean(encoded(palette)) == pytest.approx([255, 255, 255])  # its only colour is transparent


@pytest.mark.parametrize(
    "mode, value, expected",
    [("1", 1, 255), ("L", 77, 77), ("CMYK", (0, 0, 0, 0), 255), ("I", 65535, 255), ("F", 300.0, 255)],
)
def test_every_mode_becomes_rgb(mode, value, expected):
    image = to_rgb(Image.new(mode, (4, 4), value))
    assert image.mode == "RGB" and np.asarray(image).mean() == pytest.approx(expected, abs=1)


def test_16_bit_greyscale_scales_as_v_over_257_rounded_in_blocks_of_rows():
    values = (np.arange(1300 * 50, dtype=np.int64) * 7 % 65536).astype(np.uint16).reshape(1300, 50)  # > one block
    image = to_rgb(Image.fromarray(values))
    expected = np.round(values.astype(np.float64) / 257.0).astype(np.uint8)
    assert image.mode == "RGB" and (np.asarray(image)[..., 0] == expected).all()
    assert (np.asarray(to_rgb(Image.fromarray(np.array([[-5, 70000]], np.int32), "I")))[..., 0] == [0, 255]).all()


def test_webp_jpeg_and_bmp_decode():
    for fmt, ext in [("WEBP", "webp"), ("JPEG", "jpg"), ("BMP", "bmp")]:
        assert decoded_mean(image_bytes(200, fmt), ext) == pytest.approx([200] * 3, abs=3)


def test_sample_errors_name_the_shard_the_key_and_the_reason():
    with pytest.raises(SampleError, match=r"s\.tar: sample 'k7': \.jpg does not decode"):
        decode_image({"__url__": "s.tar", "__key__": "k7", "jpg": b"garbage"})
    with pytest.raises(SampleError, match=r"no image .*it has \.caption, \.json"):
        decode_image({"__url__": "s.tar", "__key__": "k7", "caption": b"x", "json": b"{}"})


# --- labels and captions --------------------------------------------------------------------------


def test_labels_from_cls_or_json_and_unlabelled_samples_with_captions_are_kept():
    png8 = image_bytes()
    assert label_of({"cls": b"3\n"}) == 3
    assert label_of({"json": b'{"label": 5}'}) == 5
    assert label_of({"json": b'{"caption": "x"}'}) is None
    assert eval_record({"png": png8, "cls": b"2"})[1:] == ([], 2)  # zero-shot only
    assert eval_record({"png": png8, "txt": b"a cat\n\na dog\n"})[1:] == (["a cat", "a dog"], -1)  # retrieval only
    with pytest.raises(SampleError, match="neither a .txt caption nor a label"):
        eval_record({"png": png8, "json": b"{}"})


# --- shard specs ----------------------------------------------------------------------------------


def test_directories_and_globs_are_shard_specs(tmp_path):
    for name in ["b-10.tar", "b-2.tar", "a-1.tar", "notes.txt"]:
        write_tar(tmp_path / name, [("x.txt", b"x")]) if name.endswith(".tar") else (tmp_path / name).write_text("x")
    in_order = [str(tmp_path / n) for n in ["a-1.tar", "b-2.tar", "b-10.tar"]]  # natural order
    assert expand_shards(str(tmp_path)) == in_order
    assert expand_shards(f"{tmp_path}/b-*.tar") == in_order[1:]
    assert expand_shards(f"{tmp_path}/a-1.tar::{tmp_path}/b-{{2,10}}.tar") == in_order
    with pytest.raises(FileNotFoundError, match="the glob .* matches no file"):
        expand_shards(f"{tmp_path}/c-*.tar")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no .tar files"):
        expand_shards(str(tmp_path / "empty"))


def test_a_listed_files_name_is_never_read_as_a_command_or_url(tmp_path, monkeypatch):
    """A shard a directory or a glob lists is a local file, whatever its name says: `pipe:touch ran;cat a.tar`, listed
    from `.` or `*.tar` in the working directory, was run by the shell (webdataset's gopen) as the stream's source."""
    from clipdist.files import open_stream

    monkeypatch.chdir(tmp_path)
    name = "pipe:touch ran;cat a.tar"
    write_tar(tmp_path / "a.tar", [("k.txt", b"a")])
    write_tar(tmp_path / name, [("k.txt", b"named")])
    for spec in (".", "*.tar", "pipe*.tar"):
        listed = expand_shards(spec)
        assert f"./{name}" in listed and all(not url.startswith("pipe:") for url in listed), (spec, listed)
    with open_stream(f"./{name}") as stream:
        contents = [data for _, data in tar_files(stream)]
    assert contents == [b"named"] and not (tmp_path / "ran").exists()  # the file's own bytes, no command
    assert expand_shards(f"pipe:cat {tmp_path}/a.tar") == [f"pipe:cat {tmp_path}/a.tar"]  # one typed is the user's


def test_a_clip_benchmark_folder_is_an_eval_set(tmp_path):
    root = pets(tmp_path / "wds_pets", shards=11)
    evalset = eval_set("pets", str(root), [], ["a photo of {}."])
    assert evalset.urls[:3] == [str(root / "test" / f"{i}.tar") for i in (0, 1, 2)] and len(evalset.urls) == 11
    assert evalset.classnames == ["cat", "dog"]
    assert evalset.templates == ["a photo of a {c}.", "a drawing of a {c}."]
    assert eval_set("pets", f"{root}/test/{{0..3}}.tar", [], []).classnames == ["cat", "dog"]  # beside the split folder
    assert eval_set("pets", str(root), ["x", "y"], []).classnames == ["x", "y"]  # given names win


# --- sources that keep failing --------------------------------------------------------------------


def stream(urls, workers=0, resampled=False, max_skips_in_a_row=1000, batch=2):
    return train_stream(
        urls, batch, identity_transform, workers=workers, resampled=resampled, max_skips_in_a_row=max_skips_in_a_row
    )


@pytest.mark.parametrize("resampled", [False, True])
def test_a_shard_that_is_not_a_tar_is_counted_and_the_others_are_read(tmp_path, resampled, caplog):
    (tmp_path / "bad.tar").write_text("this is a text file, not a tar\n" * 20)
    caption_shards(tmp_path / "good", shards=1, per_shard=6)
    batches = stream([tmp_path / "bad.tar", tmp_path / "good" / "0.tar"], resampled=resampled)
    with caplog.at_level(logging.WARNING, logger="clipdist.data"):
        counts = [next(batches).counts for _ in range(12)]
    assert sum(count[1] for count in counts) >= 1  # the text file: one shard skipped (at most once per pass)
    assert sum(count[0] for count in counts) == 0  # and not counted as samples; the rest trains
    assert f"{tmp_path / 'bad.tar'}: cannot be read as a tar file" in caplog.records[0].getMessage()


def test_shards_in_the_wrong_layout_stop_with_the_reason(tmp_path):
    write_samples(
        tmp_path / "s.tar",
        [{"__key__": f"{i:04d}", "jpg": image_bytes(fmt="JPEG"), "caption": b"x"} for i in range(40)],
    )
    with pytest.raises(DataError, match="25 samples in a row could not be used.*no .txt caption"):
        next(stream([tmp_path / "s.tar"], resampled=True, max_skips_in_a_row=25))


def test_skip_warnings_are_rate_limited_and_say_where(tmp_path, caplog):
    skips = SkipCounter(max_in_a_row=0, first_warnings=3, every_s=3600)
    with caplog.at_level(logging.WARNING, logger="clipdist.data"):
        for i in range(200):
            skips(SampleError({"__url__": "/d/s.tar", "__key__": f"k{i}"}, "empty caption"))
    assert skips.count == 200 and len(caplog.records) == 3
    assert "/d/s.tar: sample 'k0': empty caption" in caplog.records[0].getMessage()


def test_a_duplicate_member_is_skipped_in_one_plain_line(tmp_path, caplog):
    """webdataset appends (stream, url) to an error's args: the warning was the tuple's repr."""
    members = [("k0.png", png(0)), ("k0.txt", b"x"), ("k0.png", png(1)), ("k1.png", png(2)), ("k1.txt", b"y")]
    shard = write_tar(tmp_path / "dup.tar", members)
    skips = SkipCounter(max_in_a_row=0)
    with caplog.at_level(logging.WARNING, logger="clipdist.data"):
        pipeline = wds.DataPipeline(wds.SimpleShardList([str(shard)]), tar_samples(handler=skips))
        keys = [sample["__key__"] for sample in pipeline]
    assert skips.samples == 1 and "k1" in keys, keys
    said = caplog.records[0].getMessage()
    assert said.startswith("skipped: ValueError: k0.png: duplicate file name in tar file png") and "None" not in said


# --- make-shards ----------------------------------------------------------------------------------


def test_make_shards_refuses_a_non_empty_folder_and_overwrites_it_whole(tmp_path, capsys):
    images = tmp_path / "images" / "cat"
    images.mkdir(parents=True)
    for i in range(5):
        (images / f"{i}.png").write_bytes(png(i))
    out = tmp_path / "out"
    assert (
        cli(["make-shards", "--images", str(tmp_path / "images"), "--out", str(out), "--samples-per-shard", "2"]) == 0
    )
    shards = [f"shard-00000{i}" for i in range(3)]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [PUBLISHED] + [f"{s}.tar" for s in shards] + [f"{s}_stats.json" for s in shards]
    )
    (images / "3.png").unlink()
    (images / "4.png").unlink()
    assert cli(["make-shards", "--images", str(tmp_path / "images"), "--out", str(out)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert cli(["make-shards", "--images", str(tmp_path / "images"), "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [PUBLISHED, "shard-000000.tar", "shard-000000_stats.json"]
    assert not list(tmp_path.glob(".out*"))
    # --overwrite replaces only a folder clipdist wrote: not the images' own folder, not one that holds anything else
    for folder in (tmp_path / "images", tmp_path):
        command = ["make-shards", "--images", str(tmp_path / "images"), "--out", str(folder), "--overwrite"]
        assert cli(command) == 2
        assert f"{folder} is not a folder clipdist wrote" in capsys.readouterr().err
    assert sorted(p.name for p in images.iterdir()) == ["0.png", "1.png", "2.png"]


def test_a_table_that_is_not_there_or_not_a_file_is_one_line_naming_it(tmp_path, capsys):
    """An OSError the system raises is said as `PATH: reason` by every subcommand (errors.said), not in Python's
    words (`[Errno 2] No such file or directory: 'x'`)."""
    for table, reason in ((tmp_path / "absent.tsv", "no such file or directory"), (tmp_path, "not a regular file")):
        assert cli(["make-shards", "--csv", str(table), "--out", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err.strip() == f"clipdist make-shards: error: {table}: {reason}"
    moved = OSError(18, "Invalid cross-device link", "a", None, "b")
    assert said(moved) == "a -> b: invalid cross-device link" and said(OSError("mine")) == "mine"
    forged = tmp_path / "t.tsv\nclipdist make-shards: error: forged"  # a name cannot add a line
    assert cli(["make-shards", "--csv", str(forged), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"clipdist make-shards: error: {tmp_path}/t.tsv\\nclipdist make-shards: error: forged: "
        "no such file or directory"
    ]

    class Worded(OSError):
        def __str__(self):
            return "its own words"

    assert said(Worded(2, "No such file or directory", "x")) == "its own words"


def test_make_shards_leaves_out_unreadable_images_and_never_leaves_partial_files(tmp_path, capsys):
    (tmp_path / "ok.png").write_bytes(png(1))
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    (tmp_path / "pairs.csv").write_text("path,caption\nok.png,fine\nbroken.jpg,broken\n")
    comma = ["--separator", ",", "--path-column", "path", "--caption-column", "caption"]
    assert cli(["make-shards", "--csv", str(tmp_path / "pairs.csv"), "--out", str(tmp_path / "a"), *comma]) == 0
    captured = capsys.readouterr()
    assert "broken.jpg: not a readable image" in captured.err and "1 unreadable image(s) left out" in captured.out
    with tarfile.open(tmp_path / "a" / "shard-000000.tar") as tar:
        assert sorted(tar.getnames()) == ["000000000.json", "000000000.png", "000000000.txt"]

    (tmp_path / "pairs.csv").write_text("path,caption\nok.png,fine\nmissing.png,gone\n")
    assert cli(["make-shards", "--csv", str(tmp_path / "pairs.csv"), "--out", str(tmp_path / "b"), *comma]) == 2
    assert "line 3: image 'missing.png' not found" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b*"))  # nothing half-written


@pytest.mark.parametrize("prefix", ["../out2/evil", "sub/dir", "", "a%d", "{0..9}", ".hidden", "-x"])
def test_make_shards_takes_a_prefix_that_names_files_in_the_output_folder_only(tmp_path, capsys, prefix):
    """A '/' or '..' wrote outside --out, '%' broke the writer's pattern, braces the spec it prints: refused in one
    line, and nothing written anywhere."""
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "0.png").write_bytes(png(0))
    out = tmp_path / "out"
    assert cli(["make-shards", "--images", str(tmp_path / "images"), "--out", str(out), f"--prefix={prefix}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"--prefix {prefix!r}: the start of the shards' file names" in line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["images"]


def photo_like(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth image with sharp edges (gradients, discs): resampling differences show, a crop in another
    place shows much more."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    image = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], axis=-1)
    for _ in range(12):
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(10, width / 4)
        image[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
    return Image.fromarray(image.astype(np.uint8))


def jpeg_sample(image: Image.Image, **save) -> dict:
    return {"__url__": "s.tar", "__key__": "k", "jpg": encoded(image, "JPEG") if not save else _jpeg(image, **save)}


def _jpeg(image: Image.Image, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", **save)
    return buffer.getvalue()


@pytest.mark.parametrize("size", [(640, 520), (520, 680), (300, 260), (200, 150)])
def test_the_crop_decodes_at_the_size_it_needs_with_the_transforms_boxes(size):
    """open_clip's training crop on an image not decoded yet: the box drawn as RandomResizedCrop draws it
    (same seed, same box), the JPEG decoded at the fewest eighths that still cover the output, and the
    224-px result within ~1 level of 255 of the full-size decode + crop + resize."""
    import open_clip

    from clipdist.data.samples import load_rgb, open_image

    transform = open_clip.image_transform(224, is_train=True)
    crop = transform.transforms[0]
    batcher = ImageBatcher(transform)
    sample = jpeg_sample(photo_like(*size), quality=90)
    for seed in range(6):
        torch.manual_seed(seed)
        expected = np.asarray(crop(decode_image(sample)), dtype=np.float32)
        torch.manual_seed(seed)
        got = np.asarray(batcher.decode(open_image(sample)), dtype=np.float32)
        assert got.shape == expected.shape == (224, 224, 3)
        assert np.abs(got - expected).mean() < 1, seed
        torch.manual_seed(seed + 100)  # another box: far apart (the test can tell a box from another)
        other = np.asarray(crop(decode_image(sample)), dtype=np.float32)
        assert np.abs(other - expected).mean() > 3 * np.abs(got - expected).mean()
    image, scale = load_rgb(open_image(sample), (224, 224))
    assert scale == pytest.approx(min(1.0, math.ceil(8 * 224 / min(size)) / 8), abs=1 / 8)
    assert image.size == (math.ceil(size[0] * scale), math.ceil(size[1] * scale)) and image.mode == "RGB"


def test_jpegs_of_every_kind_decode_like_pil():
    """Greyscale, CMYK, progressive and 4:4:4 JPEGs decode (reduced or not) to what PIL decodes."""
    from clipdist.data.samples import load_rgb, open_image

    photo = photo_like(400, 320)
    for image, save in [
        (photo.convert("L"), {}),
        (photo.convert("CMYK"), {}),
        (photo, {"progressive": True}),
        (photo, {"subsampling": 0}),
        (photo, {"quality": 75}),
    ]:
        sample = jpeg_sample(image, **save)
        reference = decode_image(sample)
        assert np.abs(np.asarray(reference, np.float32) - np.asarray(image.convert("RGB"), np.float32)).mean() < 6
        whole, scale = load_rgb(open_image(sample))
        assert scale == 1 and whole.mode == "RGB"
        assert np.abs(np.asarray(whole, np.float32) - np.asarray(reference, np.float32)).mean() < 1
        half, scale = load_rgb(open_image(sample), (200, 160))
        assert scale == 0.5 and half.size == (200, 160)
        shrunk = np.asarray(reference.resize((200, 160), Image.BICUBIC), np.float32)
        assert np.abs(np.asarray(half, np.float32) - shrunk).mean() < 3


def test_exif_orientation_is_not_applied_as_in_open_clip():
    """open_clip's loader (webdataset's pilrgb) uses an image as stored, whatever its EXIF orientation says."""
    from clipdist.data.samples import open_image

    image = photo_like(64, 32)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to view"
    sample = {"__url__": "s.tar", "__key__": "k", "jpg": _jpeg(image, exif=exif.tobytes())}
    assert open_image(sample).opened.getexif()[0x0112] == 6
    assert decode_image(sample).size == (64, 32)
    assert ImageBatcher(lambda x: x).decode(open_image(sample)).size == (64, 32)


def test_a_png_or_webp_named_jpg_decodes_as_what_it_is():
    from clipdist.data.samples import load_rgb, open_image

    for fmt in ("PNG", "WEBP"):
        sample = {"__url__": "s.tar", "__key__": "k", "jpg": encoded(photo_like(300, 200), fmt)}
        image, scale = load_rgb(open_image(sample), (100, 60))  # no DCT scaling: decoded whole
        assert open_image(sample).opened.format == fmt and scale == 1 and image.size == (300, 200)


@pytest.fixture(scope="module")
def huge_jpeg():
    """A 12,000 x 12,000 JPEG (144 M pixels, 432 MB decoded whole; PIL warns above 89 M)."""
    image = Image.new("L", (12_000, 12_000), 90)
    image.paste(200, (0, 0, 6_000, 6_000))
    return _jpeg(image, quality=70)


def test_a_huge_jpeg_is_decoded_at_the_crops_size_and_a_huge_png_is_refused(huge_jpeg):
    import open_clip

    from clipdist.data.samples import load_rgb, open_image

    sample = {"__url__": "s.tar", "__key__": "big", "jpg": huge_jpeg}
    batcher = ImageBatcher(open_clip.image_transform(224, is_train=True))
    torch.manual_seed(0)
    crop = batcher.decode(open_image(sample))  # decoded at 1/8 at most: 1,500 x 1,500
    assert crop.size == (224, 224)
    assert np.asarray(crop).min() <= 95 and np.asarray(crop).max() >= 195  # both halves are in it
    with pytest.raises(Image.DecompressionBombError, match="MAX_IMAGE_PIXELS"):
        load_rgb(open_image(sample))  # whole: more than PIL's limit
    with pytest.raises(SampleError, match=r"sample 'big': \.jpg does not decode \(DecompressionBombError"):
        decode_image(sample)
    png_bomb = {"__url__": "s.tar", "__key__": "big", "png": encoded(Image.new("1", (12_000, 12_000)))}
    with pytest.raises(Image.DecompressionBombError):
        load_rgb(open_image(png_bomb), (224, 224))  # not a JPEG: no reduced decode, so refused


def test_bad_images_are_skipped_and_counted_in_the_stream(tmp_path, huge_jpeg):
    """A truncated JPEG and a PNG bomb are skipped (counted, named); CMYK, progressive, greyscale JPEGs, a
    PNG named .jpg and a 12,000-px JPEG are trained on."""
    import open_clip

    photo = photo_like(300, 260)
    good = [
        _jpeg(photo.convert("CMYK")),
        _jpeg(photo, progressive=True),
        _jpeg(photo.convert("L")),
        encoded(photo, "PNG"),
        huge_jpeg,
    ]
    bad = [_jpeg(photo)[:2000], encoded(Image.new("1", (12_000, 12_000)))]
    members = [
        item
        for i, data in enumerate(good[:2] + bad[:1] + good[2:4] + bad[1:] + good[4:])
        for item in [(f"{i:03d}.jpg", data), (f"{i:03d}.txt", b"a photo")]
    ]
    write_tar(tmp_path / "a.tar", members)
    stream = train_stream([tmp_path / "a.tar"], 5, open_clip.image_transform(224, is_train=True))
    batch = next(stream)
    assert batch["image"].shape == (5, 3, 224, 224) and batch.counts == [2, 0, 5]
    stream.close()


def _open_clip_table(folder, rows=21, missing=(), separator="\t"):
    """An open_clip-style table: filepath<sep>title, images in a subfolder, some rows' images absent."""
    import numpy as np
    from PIL import Image

    (folder / "images").mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(0)
    lines = [f"filepath{separator}title"]
    for i in range(rows):
        if i not in missing:
            Image.fromarray(generator.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(
                folder / "images" / f"{i}.png"
            )
        lines.append(f"images/{i}.png{separator}a photo of thing {i}")
    (folder / "table.tsv").write_text("\n".join(lines) + "\n")
    return folder / "table.tsv"


def test_a_table_is_read_in_parts_row_for_row_as_open_clip_reads_it(tmp_path):
    from clipdist.data.sources import expand_shards
    from clipdist.data.tar_samples import tar_samples
    from clipdist.registry.kinds import TableOptions

    table = _open_clip_table(tmp_path, rows=21, missing=(4,))
    parts = expand_shards(str(table), "data.train_shards", {"table": TableOptions(rows_per_part=8)})
    assert len(parts) == 3  # 8 + 8 + 5 rows
    samples = list(tar_samples(handler=lambda exn: True)([{"url": url} for url in parts]))
    samples = [sample for sample in samples if sample]
    assert [sample["txt"].decode() for sample in samples] == [f"a photo of thing {i}" for i in range(21)]
    assert "missing" in samples[4] and all("png" in sample for i, sample in enumerate(samples) if i != 4)
    assert samples[7]["png"] == (tmp_path / "images" / "7.png").read_bytes()
    pandas = pytest.importorskip("pandas")
    from open_clip_train.data import CsvDataset

    theirs = CsvDataset(str(table), transforms=None, img_key="filepath", caption_key="title", sep="\t")
    assert [str(caption) for caption in theirs.captions] == [sample["txt"].decode() for sample in samples]
    assert [tmp_path / path for path in theirs.images] == [tmp_path / "images" / f"{i}.png" for i in range(21)]
    assert pandas is not None


def test_a_table_without_the_columns_is_one_line_before_the_ranks(tmp_path, capsys, monkeypatch):
    table = _open_clip_table(tmp_path, rows=3, separator=",")
    code, lines = refusal(
        capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", "data.source=null", f"data.train_shards={table}"
    )
    assert code == 2 and len(lines) == 1, lines
    assert "has no column 'filepath' (its columns, split at '\\t': ['filepath,title'])" in lines[0]


def _recaptioned(key: str, **fields) -> dict:
    import json

    return {
        "__key__": key,
        "__url__": "shard-0.tar",
        "png": image_bytes(),
        "txt": b"the alt text",
        "json": json.dumps(fields).encode(),
    }


def test_captions_from_json_fields_lists_and_by_probability_seeded_per_sample():
    from clipdist.data.samples import SampleKeys, training_pair

    sample = _recaptioned("a", caption="a dense caption", captions=["first", "second", "third"])
    assert training_pair(sample)[1] == "the alt text"  # the default: .txt
    assert training_pair(sample, SampleKeys(("json:caption", "txt")))[1] == "a dense caption"
    assert training_pair(sample, SampleKeys(("json:captions.1",)))[1] == "second"
    assert training_pair(_recaptioned("b"), SampleKeys(("json:caption", "txt")))[1] == "the alt text"  # fallback
    keys = SampleKeys(("json:caption", "txt"), (3.0, 1.0), seed=7)
    drawn = [training_pair(_recaptioned(str(i), caption="dense"), keys)[1] for i in range(400)]
    assert drawn == [training_pair(_recaptioned(str(i), caption="dense"), keys)[1] for i in range(400)]  # seeded
    assert 0.68 < drawn.count("dense") / 400 < 0.82  # 3 : 1
    picks = {
        training_pair(_recaptioned(str(i), captions=["x", "y"]), SampleKeys(("json:captions",)))[1] for i in range(40)
    }
    assert picks == {"x", "y"}
    with pytest.raises(
        SampleError, match=r"no caption at json:caption; it has \.json, \.png, \.txt \(\.json fields: alt\)"
    ):
        training_pair(_recaptioned("c", alt="x"), SampleKeys(("json:caption",)))
    with pytest.raises(SampleError, match=r"\.txt holds no text; it has \.png, \.txt"):  # there, but blank
        SampleKeys(("txt",)).caption({"__key__": "e", "__url__": "s.tar", "png": b"", "txt": b"  \n "})


def test_caption_probabilities_that_do_not_fit_the_keys_are_one_line_before_the_ranks(tmp_path, capsys, monkeypatch):
    code, lines = refusal(
        capsys,
        monkeypatch,
        f"run_dir={tmp_path / 'run'}",
        "data.caption_keys=[json:caption,txt]",
        "data.caption_probs=[1.0]",
    )
    assert code == 2 and len(lines) == 1 and "data.caption_probs=[1.0]: one probability above 0 per" in lines[0], lines


def test_the_stream_reads_captions_from_the_keys_it_is_given(tmp_path):
    import json

    from torchvision import transforms as T

    write_samples(
        tmp_path / "0.tar",
        [
            {
                "__key__": f"k{i}",
                "png": image_bytes(i * 20),
                "json": json.dumps({"caption": f"json caption {i}"}).encode(),
            }
            for i in range(8)
        ],
    )
    to_tensor = T.Compose([T.Resize((8, 8)), T.ToTensor()])
    without = train_stream([tmp_path / "0.tar"], 4, to_tensor, max_skips_in_a_row=4)
    with pytest.raises(DataError, match="no .txt caption; it has .json, .png"):
        next(without)
    without.close()
    stream = train_stream([tmp_path / "0.tar"], 4, to_tensor, caption_keys=["json:caption"])
    batch = next(stream)
    stream.close()
    assert batch["text"].shape[0] == 4 and stream.skipped_samples == 0


def test_make_shards_captions_a_folder_as_evaluation_names_its_class(tmp_path):
    """make-shards' caption for an image without a .txt: 'a photo of a <folder>', its `_` a space, as an
    ImageFolder's class names are read (it kept 'blue_circle')."""
    from clipdist.data.shard_writer import pairs_from_folder

    (tmp_path / "blue_circle").mkdir()
    (tmp_path / "blue_circle" / "a.png").write_bytes(png(10))
    (tmp_path / "blue_circle" / "b.png").write_bytes(png(20))
    (tmp_path / "blue_circle" / "b.txt").write_text("a round blue thing\n")
    assert [caption for _, caption, _ in pairs_from_folder(tmp_path)] == [
        "a photo of a blue circle",
        "a round blue thing",
    ]


def test_too_few_shards_for_the_readers_is_refused_only_where_sizes_are_unknown():
    """Shards of known size are cut into each reader's rows (data/epochs.py): one shard (a small table) serves any
    number of readers; whole shards dealt (sizes unknown) need one per reader, and the refusal says why."""
    from clipdist.data.stream import check_shard_count

    check_shard_count(1, 2, resampled=False, sized=True)
    with pytest.raises(ValueError, match=r"1 shard\(s\) for 2 reader\(s\).*sizes are unknown"):
        check_shard_count(1, 2, resampled=False)
    check_shard_count(1, 2, resampled=True)


def test_a_caption_key_that_matches_nothing_is_refused_before_any_rank_starts(tmp_path):
    """data.caption_keys=[json:recaption] on shards whose samples have .txt and a .json without it: one line naming
    what the first samples have; a key that matches passes."""
    from clipdist.data.samples import SampleKeys
    from clipdist.data.stream import check_caption_keys

    for i in range(3):
        (tmp_path / f"{i}.png").write_bytes(png(i))
    (tmp_path / "pairs.tsv").write_text("filepath\ttitle\n0.png\tzero\n1.png\tone\n2.png\ttwo\n")
    assert cli(["make-shards", "--csv", str(tmp_path / "pairs.tsv"), "--out", str(tmp_path / "out")]) == 0
    shards = [str(path) for path in sorted((tmp_path / "out").glob("*.tar"))]
    with pytest.raises(ValueError, match=r"none of the first 3 samples .* no caption at json:recaption; it has"):
        check_caption_keys(shards, SampleKeys(("json:recaption",)))
    check_caption_keys(shards, SampleKeys(("json:recaption", "txt")))  # the second key matches
    check_caption_keys(["pipe:curl -s https://example.invalid/x.tar"], SampleKeys(("nothing",)))  # not read here
    # a first shard shorter than the samples read: the next ones are read on (its one sample had no caption; the
    # run was refused though the next shard's all have one)
    write_samples(tmp_path / "short.tar", [{"__key__": "a", "png": png(0)}])
    write_samples(tmp_path / "full.tar", [{"__key__": f"b{i}", "png": png(i), "txt": b"x"} for i in range(3)])
    check_caption_keys([str(tmp_path / "short.tar"), str(tmp_path / "full.tar")], SampleKeys(("txt",)))
    with pytest.raises(ValueError, match=r"none of the first 4 samples of 2 shards from .*short.tar"):
        check_caption_keys([str(tmp_path / "short.tar"), str(tmp_path / "full.tar")], SampleKeys(("json:x",)))


@pytest.mark.parametrize(
    "item",
    ["table:/tmp/x.csv#rows=0-9&at=999999999&sep=%09", "table:/tmp/x.csv#rows=0-9&at=0&skip=-1", "folder:/tmp/x#y"],
)
def test_a_kinds_internal_part_is_not_a_shard_spec(item):
    """A part URL is made by its kind's expand, which checks its bounds; typed by a user it is refused (an `at=` past
    the end or `skip=-1` read from the command line hung the run)."""
    with pytest.raises(ValueError, match="is an internal part of a data kind"):
        expand_shards(item)


def test_an_empty_tar_said_to_hold_samples_is_counted_and_refused(tmp_path):
    """Two valid but empty tar shards whose stats files each say 360: the hints exceed what their bytes can hold,
    so both are counted (0 samples) and the run is refused before it starts instead of reading nothing forever."""
    from clipdist.data.epochs import RowDeal, shard_sizes, stats_path

    urls = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.tar"
        tarfile.open(path, "w").close()
        stats_path(str(path)).write_text('{"successes": 360}')
        urls.append(str(path))
    sizes, how = shard_sizes(urls)
    assert sizes == [0, 0] and "2 statistics file(s) not used" in how, how
    with pytest.raises(ValueError, match="hold no samples"):
        RowDeal(sizes, 0, None, None)


def test_a_folder_of_the_users_own_where_the_built_in_shards_go_is_refused_never_removed(tmp_path):
    """A built-in set's folder without its `done` marker (an older version's) is replaced; one that holds anything
    else was removed with it (data.cache_dir=/data beside the user's /data/digits): now refused before any write."""
    from clipdist.errors import ConfigError

    own = tmp_path / "mine" / "digits"
    own.mkdir(parents=True)
    (own / "notes.txt").write_text("precious")
    with pytest.raises(ConfigError, match=r"digits holds files clipdist did not write \(notes.txt, 1 in all\)"):
        builtin_shards("digits", str(tmp_path / "mine"))
    assert sorted(path.name for path in (tmp_path / "mine").iterdir()) == ["digits"]
    assert [path.name for path in own.iterdir()] == ["notes.txt"]
    stale = tmp_path / "old" / "digits"  # what an older version left: shards, no marker
    stale.mkdir(parents=True)
    (stale / "train-000000.tar").write_bytes(b"half")
    (stale / "train-000000_stats.json").write_text("{}")
    builtin_shards("digits", str(tmp_path / "old"))
    assert (stale / "done").is_file() and (stale / "train-000000.tar").stat().st_size > 4
