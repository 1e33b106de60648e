"""data.decode_on=device: the workers hand over JPEG bytes and the crop boxes the host path would draw; the rank
decodes, crops and resizes them (here on the CPU: the same code nvJPEG runs on CUDA)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from clipdist.config import AugmentationConfig, DataConfig
from clipdist.data import device_decode
from clipdist.data.batch import Batch
from clipdist.data.device_decode import decode_rows, is_encoded
from clipdist.data.images import ImageBatcher
from clipdist.data.loader import assemble
from clipdist.data.samples import EncodedImage
from clipdist.errors import ConfigError
from clipdist.model.factory import create_model
from clipdist.preflight.data import check_decode_on

SIZE = 64


def _photo(width: int, height: int, kind: str = "JPEG", mode: str = "RGB", seed: int = 0) -> bytes:
    """A photograph-like image (smooth gradients and grain) as a file's bytes."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    channels = [np.sin(x / 13.0 + c) * 50 + np.cos(y / 17.0 - c) * 40 + 128 for c in range(3)]
    pixels = (np.stack(channels, -1) + rng.normal(0, 6, (height, width, 3))).clip(0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, kind, **({"quality": 92} if kind == "JPEG" else {}))
    return buffer.getvalue()


def _opened(data: bytes) -> EncodedImage:
    """The file as the reader hands it over: its bytes and PIL's header view (fresh: a decode drafts and loads it)."""
    return EncodedImage(data, Image.open(io.BytesIO(data)))


IMAGES = [
    _photo(320, 256),  # decoded at a DCT scale on the host
    _photo(90, 70, seed=1),  # close to the output's size: decoded whole on both
    _photo(200, 300, mode="L", seed=2),  # greyscale JPEG: RGB on both
    _photo(150, 120, kind="PNG", seed=3),  # no JPEG: its worker decodes it
    _photo(160, 140, mode="CMYK", seed=4),  # a CMYK JPEG: its worker decodes it (PIL), as on the host
]


def _each(batcher: ImageBatcher) -> list:
    """The batcher over IMAGES, each with the generator seeded by its index (as the stream seeds each sample)."""
    out = []
    for index, image in enumerate(IMAGES):
        torch.manual_seed(index)
        out.append(batcher(_opened(image)))
    return out


def test_the_device_sees_the_host_paths_crops_resampled_alike():
    """An encoded batch decodes to the host path's images: the same boxes (drawn from the header with the same
    generator calls), pixels that differ by resampling alone (a mean under one level of 255); images the device
    does not decode (PNG, CMYK) are the host path's exactly."""
    transform = open_clip.image_transform((SIZE, SIZE), is_train=True, resize_mode="shortest")
    host = ImageBatcher(transform)
    encoded = ImageBatcher(transform, encoded=True)
    expected = host.stack(_each(host), pixels=True)
    rows = encoded.stack(_each(encoded))
    assert is_encoded(rows) and set(rows) == {"encoded", "length", "box", "size"}
    crop = transform.transforms[0]
    for index, image in enumerate(IMAGES[:3]):
        torch.manual_seed(index)
        assert rows["box"][index].tolist() == list(crop.get_params(_opened(image).opened, crop.scale, crop.ratio))
    assert rows["box"][3:].eq(-1).all()
    pixels, on_host, unreadable = decode_rows(rows, "cpu")
    assert pixels.shape == expected.shape == (len(IMAGES), SIZE, SIZE, 3) and pixels.dtype == torch.uint8
    assert on_host == 2 and unreadable == []
    difference = (pixels.float() - expected.float()).abs().mean((1, 2, 3))
    assert difference[:3].max() < 1.0, difference
    assert torch.equal(pixels[3:], expected[3:])
    none_to_decode = encoded.stack(_each(encoded)[3:])  # a batch with no JPEG the device takes (the digits' PNGs)
    assert torch.equal(decode_rows(none_to_decode, "cpu").pixels, expected[3:])


def test_a_batch_assembled_from_pieces_of_other_widths_decodes_as_the_whole():
    """The workers' pieces of an encoded batch are of the widths of their largest files: the batch's host buffer
    widens to each, rows in the rank's order, and decodes to the same pixels as one item holding them all."""
    transform = open_clip.image_transform((SIZE, SIZE), is_train=True)
    batcher = ImageBatcher(transform, encoded=True)
    encoded = _each(batcher)
    tokens = torch.zeros(len(IMAGES), 4, dtype=torch.long)
    pieces = [[1, 3], [0, 2, 4]]  # the first piece's files are the smaller ones
    items = iter(
        (
            batcher.stack([encoded[row] for row in rows]),
            tokens[rows],
            {
                "rows": rows,
                "batch_rows": len(IMAGES),
                "keys": [str(row) for row in rows],
                "readers": {},
                "skipped": (0, 0),
                "sources": [len(rows)],
            },
        )
        for rows in pieces
    )
    batch, _ = assemble(items, len(pieces), pin_memory=False)
    assert batch["image"]["encoded"].shape[1] == max(len(image.data.reshape(-1)) for image in encoded)
    assert batch.seq_len is None and batch.rows == len(IMAGES)
    whole = decode_rows(batcher.stack(encoded), "cpu").pixels
    assert torch.equal(decode_rows(batch["image"], "cpu").pixels, whole)
    chunks = Batch(dict(batch)).split(2)  # gradient caching splits an encoded batch as any input
    assert [chunk.rows for chunk in chunks] == [3, 2]


def test_a_jpeg_cut_short_is_the_host_paths_to_skip_and_a_corrupt_one_falls_back_to_pil(monkeypatch):
    """A JPEG whose last scan has no end marker (a truncated download) is not handed over as bytes: its worker decodes
    it as the host path does, raising what the host path raises (the stream skips the sample on both paths). Where the
    device's batched decode fails, each image is decoded alone; one it refuses is decoded by PIL; one nothing reads
    is left black and named."""
    transform = open_clip.image_transform((SIZE, SIZE), is_train=True)
    whole = IMAGES[0]
    cut = whole[: len(whole) // 2]
    errors = []
    for batcher in (ImageBatcher(transform), ImageBatcher(transform, encoded=True)):
        with pytest.raises(Exception) as raised:  # noqa: PT011 -- whatever the host path raises, the same
            batcher(_opened(cut))
        errors.append(type(raised.value))
    assert errors[0] is errors[1]
    encoded = ImageBatcher(transform, encoded=True)
    rows = encoded.stack(_each(encoded)[:3])  # three JPEGs the device takes
    expected = decode_rows(rows, "cpu").pixels
    whose, real = device_decode.jpeg_decoder()
    refused = {int(rows["length"][1])}  # the device refuses the second file: PIL decodes it
    asked = []

    def device(data, **options):
        asked.append(len(data) if isinstance(data, list) else 1)
        if isinstance(data, list) or len(data) in refused:
            if isinstance(data, list) and not any(len(one) in refused for one in data):
                return real(data, **options)
            raise RuntimeError("decode_jpeg: corrupt data")
        return real(data, **options)

    monkeypatch.setattr(device_decode, "jpeg_decoder", lambda: (whose, device))
    decoded = decode_rows(rows, "cpu")
    assert asked == [3, 1, 1, 1]  # the batch, then each alone
    assert decoded.unreadable == [] and torch.equal(decoded.pixels[[0, 2]], expected[[0, 2]])
    assert (decoded.pixels[1].float() - expected[1].float()).abs().mean() < 1.0  # PIL's decode, not libjpeg's own
    garbage = dict(rows)
    garbage["encoded"] = rows["encoded"].clone()
    garbage["encoded"][1, 2 : int(rows["length"][1]) - 2] = 7  # no JPEG at all past its first marker
    decoded = decode_rows(garbage, "cpu")
    assert decoded.unreadable == [1] and not decoded.pixels[1].any()
    assert torch.equal(decoded.pixels[[0, 2]], expected[[0, 2]])


def test_torchcodecs_decoder_is_used_where_it_works_and_decodes_as_torchvisions(monkeypatch, caplog):
    """torchvision deprecated its decode_jpeg (0.29) for TorchCodec's: TorchCodec's decodes where installed, to the
    same pixels; without it torchvision's; one that will not load (built for another torch) is a warning, then
    torchvision's; neither is one line before the ranks start."""
    import importlib.util
    import sys

    files = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in IMAGES[:3]]
    choose = device_decode.jpeg_decoder.__wrapped__  # the choice made anew, not the process's cached one
    whose, decode = choose()
    # the test extra installs it (requirements/ci.txt: the release built for CI's torch); another torch's warns
    works = importlib.util.find_spec("torchcodec") is not None and not caplog.records
    assert whose == ("torchcodec" if works else "torchvision")
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)  # not installed: importing it raises ImportError
    whose, torchvisions = choose()
    assert whose == "torchvision"
    theirs = torchvisions(files, device="cpu")
    assert all(torch.equal(mine, other) for mine, other in zip(decode(files, device="cpu"), theirs, strict=True))
    broken = SimpleNamespace(decode_jpeg=lambda *args, **kwargs: (_ for _ in ()).throw(OSError("undefined symbol")))
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", broken)
    assert choose()[0] == "torchvision"
    assert "TorchCodec's decode_jpeg does not work here (undefined symbol)" in caplog.text
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
    monkeypatch.setitem(sys.modules, "torchvision.io", SimpleNamespace())  # a torchvision that dropped it
    with pytest.raises(ConfigError, match="needs a JPEG decoder on the device: TorchCodec's"):
        choose()


@pytest.mark.parametrize(
    "train, augmentation, named",
    [
        (False, None, "Resize"),
        (True, {"color_jitter": (0.4, 0.4, 0.4, 0.1), "color_jitter_prob": 0.8}, "color_jitter"),
    ],
)
def test_a_transform_that_does_more_than_crop_is_refused_naming_its_steps(train, augmentation, named):
    transform = open_clip.image_transform((SIZE, SIZE), is_train=train, aug_cfg=augmentation)
    with pytest.raises(ConfigError, match=f"data.decode_on=device .* This run's is .*{named}"):
        ImageBatcher(transform, encoded=True)


def _cfg(**data):
    return SimpleNamespace(data=DataConfig(**data), model=SimpleNamespace(name="clipdist-tiny"))


@pytest.mark.parametrize(
    "model, data, message",
    [
        ("clipdist-naflex-tiny", {}, "NaFlex tower's patches are cut by the loader"),
        ("clipdist-tiny", {"resolution_schedule": {"10": 48}}, "data.resolution_schedule changes it"),
        ("clipdist-tiny", {"normalize_on": "loader"}, "data.normalize_on=loader cannot apply"),
        ("clipdist-tiny", {"augment": False}, "This run's is Resize"),
        ("clipdist-tiny", {"augmentation": AugmentationConfig(gray_scale_prob=0.2)}, "gray_scale"),
    ],
)
def test_a_run_the_device_cannot_decode_for_is_refused_before_the_ranks(model, data, message):
    """preflight builds the run's own training transform and refuses what the device cannot run after decoding."""
    tower = create_model(model, device="meta")
    with pytest.raises((ValueError, ConfigError), match=message):
        check_decode_on(_cfg(decode_on="device", **data), tower)
    check_decode_on(_cfg(decode_on="host", **data), tower)  # the host path takes all of them
    if model == "clipdist-tiny" and not data:
        check_decode_on(_cfg(decode_on="device"), tower)


def test_the_default_run_transform_is_one_the_device_takes():
    check_decode_on(_cfg(decode_on="device"), create_model("clipdist-tiny", device="meta"))
    assert isinstance(open_clip.image_transform((SIZE, SIZE), is_train=True).transforms[0], T.RandomResizedCrop)
