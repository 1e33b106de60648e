"""Run train.py the way a user does, in a subprocess with a timeout."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train_command(run_dir: Path, cache_dir: Path, *overrides: str) -> list[str]:
    return [
        sys.executable, str(REPO / "train.py"), f"run_dir={run_dir}", f"data.cache_dir={cache_dir}",
        "logging.wandb=disabled", "logging.progress=false", *overrides,
    ]


def train(run_dir: Path, cache_dir: Path, *overrides: str, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})}
    return subprocess.run(train_command(run_dir, cache_dir, *overrides), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=environment)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_tar(path: Path, members) -> Path:
    """A tar file of (name, bytes) members, in order."""
    import io
    import tarfile

    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def image_bytes(value: int = 128, fmt: str = "PNG", mode: str = "RGB", size: int = 8) -> bytes:
    """A small flat image encoded as `fmt`."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new(mode, (size, size), value if mode in ("L", "I", "I;16") else (value,) * len(mode)).save(buffer, format=fmt)
    return buffer.getvalue()


def write_samples(path: Path, samples: list[dict]) -> Path:
    """A shard of samples given as {"__key__": ..., ext: bytes, ...}."""
    return write_tar(path, [(f"{sample['__key__']}.{ext}", data) for sample in samples
                            for ext, data in sample.items() if ext != "__key__"])


def train_stream(sources, batch_size: int, image_transform, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                 start_method: str | None = None, low_priority_workers: bool = False, **data):
    """A TrainStream over `sources` (shard paths, or a list of such lists: one per source), with
    DataConfig(**data) for everything else (shuffle_buffer=0 unless given)."""
    from clipdist.config import DataConfig
    from clipdist.data.stream import TrainStream
    from clipdist.models import get_tokenizer

    if sources and not isinstance(sources[0], (list, tuple)):
        sources = [sources]
    data.setdefault("shuffle_buffer", 0)
    return TrainStream([[str(url) for url in urls] for urls in sources], DataConfig(source=None, **data),
                       batch_size=batch_size, image_transform=image_transform, tokenizer=get_tokenizer(), rank=rank,
                       world_size=world_size, seed=seed, low_priority_workers=low_priority_workers,
                       start_method=start_method)
