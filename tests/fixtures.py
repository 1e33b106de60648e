"""Data the tests make: images, tar shards in the layouts people have (webdataset captions, clip_benchmark's
zero-shot folders). One builder per layout, shared by unit and integration tests."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from pathlib import Path


def image_bytes(value: int = 128, fmt: str = "PNG", mode: str = "RGB", size: int = 8) -> bytes:
    """A small flat image encoded as `fmt`."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new(mode, (size, size), value if mode in ("L", "I", "I;16") else (value,) * len(mode)).save(
        buffer, format=fmt
    )
    return buffer.getvalue()


def write_tar(path: Path, members) -> Path:
    """A tar file of (name, bytes) members, in order."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def write_samples(path: Path, samples: list[dict]) -> Path:
    """A shard of samples given as {"__key__": ..., ext: bytes, ...}."""
    return write_tar(
        path,
        [
            (f"{sample['__key__']}.{ext}", data)
            for sample in samples
            for ext, data in sample.items()
            if ext != "__key__"
        ],
    )


def caption_shards(
    folder: Path,
    shards: int = 2,
    per_shard: int = 16,
    *,
    pixel: Callable[[int, int], int] = lambda shard, i: i * 7 % 256,
    caption: Callable[[int], bytes] = lambda i: f"a grey square number {i}".encode(),
    label: Callable[[int], int] | None = None,
    bad_first: bool = False,
) -> Path:
    """`folder`/{0..shards-1}.tar in the img2dataset layout: keys '<shard>-<i>', a flat PNG of `pixel(shard, i)`,
    a .txt caption, a .json label where `label` is given; `bad_first`: each shard starts with an undecodable image."""
    folder.mkdir(parents=True, exist_ok=True)
    for shard in range(shards):
        samples = [{"__key__": f"{shard}-bad", "png": b"not a png", "txt": b"a caption"}] if bad_first else []
        samples += [
            {
                "__key__": f"{shard}-{i:03d}",
                "png": image_bytes(pixel(shard, i)),
                "txt": caption(i),
                **({"json": f'{{"label": {label(i)}}}'.encode()} if label else {}),
            }
            for i in range(per_shard)
        ]
        write_samples(folder / f"{shard}.tar", samples)
    return folder


def clip_benchmark_set(root: Path, shards: list[list[dict]], classnames: list[str], templates: list[str]) -> Path:
    """clip_benchmark's webdataset layout: test/{0..n}.tar of the given samples (an image + .cls each),
    nshards.txt, classnames.txt and zeroshot_classification_templates.txt beside."""
    (root / "test").mkdir(parents=True)
    for number, samples in enumerate(shards):
        write_samples(root / "test" / f"{number}.tar", samples)
    (root / "test" / "nshards.txt").write_text(f"{len(shards)}\n")
    (root / "classnames.txt").write_text("\n".join(classnames) + "\n")
    (root / "zeroshot_classification_templates.txt").write_text("\n".join(templates) + "\n")
    return root


def pets(root: Path, samples_per_shard: int = 3, shards: int = 2) -> Path:
    """A small clip_benchmark set: .webp images labelled cat/dog alternately, two templates ({c} style)."""
    return clip_benchmark_set(
        root,
        [
            [
                {"__key__": f"s{shard}{i}", "webp": image_bytes(40 * i, "WEBP"), "cls": str(i % 2).encode()}
                for i in range(samples_per_shard)
            ]
            for shard in range(shards)
        ],
        ["cat", "dog"],
        ["a photo of a {c}.", "a drawing of a {c}."],
    )


def tiny_open_clip(vision: dict | None = None, text: dict | None = None, **options):
    """open_clip's CLIP at clipdist-tiny's size with `vision` / `text` settings changed (ls_init_value, pool_type,
    ...), every tensor moved off open_clip's init (zero biases, ones in the norms) so that each one tells."""
    import open_clip
    import torch

    torch.manual_seed(0)
    vision = {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8, **(vision or {})}
    text = {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2, **(text or {})}
    model = open_clip.CLIP(32, vision, text, **options)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    return model.eval()


# --- features and references for the loss tests --------------------------------------------------------------------

FEATURE_DIM = 8


def global_batch(sizes, seed, dim: int = FEATURE_DIM):
    """L2-normalised float64 (image, text) features of the global batch: ranks' slices of `sizes`, rank-major."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(sum(sizes), dim, generator=generator, dtype=torch.float64), dim=-1)
    text = F.normalize(torch.randn(sum(sizes), dim, generator=generator, dtype=torch.float64), dim=-1)
    return image, text


def scalar_parameters(scale, with_bias):
    """Logit scale (and the SigLIP bias, at its usual init of −10) as leaves that want gradients."""
    import torch

    values = [scale, -10.0] if with_bias else [scale]
    return [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in values]


def single_process(loss_fn, sizes, seed, scale, with_bias=False):
    """(loss, ∂L/∂I, ∂L/∂T, ∂L/∂s[, ∂L/∂t]) of one process on the global batch."""
    image, text = (t.requires_grad_(True) for t in global_batch(sizes, seed))
    scalars = scalar_parameters(scale, with_bias)
    loss = loss_fn(image, text, *scalars)
    loss.backward()
    return loss.detach(), image.grad, text.grad, *(s.grad for s in scalars)


def max_error(got, want, floor: float = 1e-30):
    """The largest relative error over pairs of tensors (max |g − w| / max |w|), absolute where max |w| < `floor`."""
    return max(((g - w).abs().max() / w.abs().max().clamp_min(floor)).item() for g, w in zip(got, want))


# --- two weighted sources for the stream's resume and mixing tests ------------------------------------------------


def flat(image):
    """A flat grey image's value: which sample it is (two_sources)."""
    import numpy as np
    import torch

    return torch.from_numpy(np.asarray(image, dtype=np.float32)).mean()


def two_sources(tmp_path, shards=4, per_shard=2):
    """Source a's images are flat grey base + 10·shard + i with base 0, source b's with base 100."""
    return [
        sorted(
            str(path)
            for path in caption_shards(
                tmp_path / name,
                shards,
                per_shard,
                caption=lambda i: b"x",
                pixel=lambda shard, i, base=base: base + shard * 10 + i,
            ).glob("*.tar")
        )
        for name, base in [("a", 0), ("b", 100)]
    ]


def weighted_stream(sources, workers):
    """The two sources mixed 3:1, resampled, 4 a batch, read as flat values."""
    from helpers import train_stream

    return train_stream(sources, 4, flat, resampled=True, shuffle_buffer=6, workers=workers, seed=3, weights=[3, 1])


# --- files that would run code if unpickled ----------------------------------------------------------------------


class RunsCode:
    """Unpickled, it runs `touch <marker>`: the marker file appearing is the proof that a reader ran it."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def inst_pickle(marker: Path) -> bytes:
    """The same call by pickle protocol 0's INST opcode (no GLOBAL + REDUCE): `os.system('touch marker')`."""
    return f"(S'touch {marker}'\nios\nsystem\n.".encode()


def untrusted_checkpoints(real: Path, folder: Path, marker: Path) -> dict[str, Path]:
    """Copies of the real .dcp checkpoint `real` with code in one part each, and .pt files that carry it:
    name -> path. Each would `touch marker` if unpickled."""
    import pickle
    import shutil

    import torch

    from clipdist.checkpoint.weights import PROGRESS, read_progress, read_run_checkpoint

    folder.mkdir(parents=True, exist_ok=True)
    made = {}
    progress, (model, _) = read_progress(real), read_run_checkpoint(real)

    def copy(name: str) -> Path:
        path = folder / name / "checkpoints" / "step_00000099.dcp"
        shutil.copytree(real, path)
        return path

    made["dcp_progress"] = copy("dcp_progress")
    torch.save({**progress, "extra": RunsCode(marker)}, made["dcp_progress"] / PROGRESS)
    made["dcp_metadata"] = copy("dcp_metadata")
    with open(made["dcp_metadata"] / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)  # ours, just written: trusted
    metadata.extra = RunsCode(marker)
    with open(made["dcp_metadata"] / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    made["dcp_item"] = copy("dcp_item")
    shutil.rmtree(made["dcp_item"])
    import torch.distributed.checkpoint as dcp

    from clipdist.checkpoint.weights import single_process_quietly

    with single_process_quietly():
        dcp.save({"model": model, "extra": RunsCode(marker)}, checkpoint_id=str(made["dcp_item"]))
    torch.save(progress, made["dcp_item"] / PROGRESS)
    made["pt_checkpoint"] = folder / "pt_checkpoint" / "checkpoints" / "step_00000099.pt"
    made["pt_checkpoint"].parent.mkdir(parents=True)
    torch.save({**progress, "model": model, "optimizer": {}, "extra": RunsCode(marker)}, made["pt_checkpoint"])
    made["pt_weights"] = folder / "weights.pt"
    torch.save({"state_dict": model, "epoch": RunsCode(marker)}, made["pt_weights"])
    made["inst_weights"] = folder / "inst.bin"
    made["inst_weights"].write_bytes(inst_pickle(marker))
    return made
