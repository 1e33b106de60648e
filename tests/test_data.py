import io
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from clipdist.cli import main as cli
from clipdist.data.builtin import builtin_shards
import webdataset as wds

from clipdist.data.pipeline import SkipCounter, expand_shards, train_stream
from clipdist.data.tar_samples import tar_samples
from clipdist.models import get_tokenizer


def write_tar(path, members):
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def png(value):
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (value, value, value)).save(buffer, format="PNG")
    return buffer.getvalue()


def identity_transform(image):
    return torch.from_numpy(np.array(image)).float().mean()


def test_corrupt_image_and_empty_caption_are_skipped_and_counted(tmp_path):
    members = []
    for i in range(6):
        members += [(f"{i:03d}.png", png(i * 10)), (f"{i:03d}.txt", b"a caption")]
    members[2] = ("001.png", b"not an image")  # undecodable image
    members[5] = ("002.txt", b"   ")  # empty caption
    write_tar(tmp_path / "a.tar", members)
    skips = SkipCounter()
    stream = train_stream([str(tmp_path / "a.tar")], 2, identity_transform, get_tokenizer(), resampled=False,
                          split="node", shuffle_buffer=0, workers=0, rank=0, world_size=1, seed=0, skips=skips)
    images, tokens, skipped = next(stream)
    assert images.tolist() == [0.0, 30.0]  # samples 1 (bad image) and 2 (empty caption) skipped
    assert tokens.shape[0] == 2
    assert skipped == 2 and skips.count == 2  # the batch carries the skips made while reading it
    assert next(stream)[2] == 0


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
    skips = SkipCounter()
    pipeline = wds.DataPipeline(wds.SimpleShardList(urls), tar_samples(handler=skips),
                                wds.to_tuple("png", "txt", handler=skips))
    return [key for key, _ in pipeline], skips.count


@pytest.mark.parametrize("cut", ["at_member_boundary", "inside_data", "inside_header", "damaged_header"])
def test_truncated_or_damaged_shard_is_counted_and_reading_goes_on(tmp_path, cut):
    data = eight_sample_shard(tmp_path / "whole.tar")
    offsets = member_offsets(data)
    sixth_sample = offsets[10]  # header of 005.png
    damaged = {
        "at_member_boundary": data[:sixth_sample],
        "inside_data": data[:sixth_sample + 512 + 40],
        "inside_header": data[:sixth_sample + 100],
        "damaged_header": data[:sixth_sample] + b"\x7fgarbage" * 64 + data[sixth_sample + 512:],
    }[cut]
    (tmp_path / "bad.tar").write_bytes(damaged)
    keys, skipped = read_all_once([str(tmp_path / "bad.tar"), str(tmp_path / "whole.tar")])
    assert skipped == 1
    assert len(keys) == 5 + 8  # the five samples before the cut, then every sample of the next shard


def test_intact_shards_skip_nothing(tmp_path):
    eight_sample_shard(tmp_path / "whole.tar")
    keys, skipped = read_all_once([str(tmp_path / "whole.tar")] * 2)
    assert (len(keys), skipped) == (16, 0)


def test_missing_and_empty_shards_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="2 of 2 shards not found"):
        expand_shards(f"{tmp_path}/x-{{0..1}}.tar")
    (tmp_path / "empty.tar").write_bytes(b"")
    with pytest.raises(ValueError, match="empty shard"):
        expand_shards(str(tmp_path / "empty.tar"))


def test_fewer_shards_than_workers_times_ranks_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="every worker needs at least one shard"):
        train_stream(["a.tar"], 2, identity_transform, get_tokenizer(), resampled=False, split="node",
                     shuffle_buffer=0, workers=2, rank=0, world_size=2, seed=0, skips=SkipCounter())


def test_digits_become_cached_shards(tmp_path):
    train, val = builtin_shards("digits", str(tmp_path))
    train_urls, val_urls = expand_shards(train), expand_shards(val)
    assert len(train_urls) == 4 and len(val_urls) == 1
    with tarfile.open(val_urls[0]) as tar:
        names = tar.getnames()
    assert len([n for n in names if n.endswith(".png")]) == 359  # 20% of 1,797, held out
    assert builtin_shards("digits", str(tmp_path)) == (train, val)  # cached


def test_fashion_mnist_without_the_package_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        builtin_shards("fashion_mnist", str(tmp_path), source_dir=str(tmp_path / "none"))


def test_make_shards_from_csv(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.png").write_bytes(png(i))
    (tmp_path / "pairs.csv").write_text("path,caption\n0.png,zero\n1.png,one\n2.png,two\n")
    assert cli(["make-shards", "--csv", str(tmp_path / "pairs.csv"), "--out", str(tmp_path / "out"),
                "--samples-per-shard", "2"]) == 0
    shards = sorted((tmp_path / "out").glob("*.tar"))
    assert [s.name for s in shards] == ["shard-000000.tar", "shard-000001.tar"]
    with tarfile.open(shards[0]) as tar:
        assert tar.extractfile("000000001.txt").read() == b"one"
