"""A new component is its module and its registry entry: a loss backend with an option and a data kind with an
option, each written here as a user would write it (outside the package), entered in its torch-free registry
(clipdist.registry.losses.BACKENDS, clipdist.registry.kinds.KIND_SPECS) and nowhere else — then `train.py` composes their
keys, checks them, reads the kind's files and trains with the backend. A new model is one file of data: an open_clip
model config, named by its path (docs/architecture.md#registries)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from helpers import REPO, own_environment, read_jsonl

LOSS_MODULE = '''
from clipdist.losses.naive import NaiveLoss


class ChunkedLoss(NaiveLoss):
    """The naive backend with an option of its own (what it does with it is the backend's business)."""

    def __init__(self, chunk: int = 512, group=None):
        super().__init__(group)
        self.chunk = chunk
'''

KIND_MODULE = '''
import io
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from PIL import Image

SCHEME = "lines:"


def names_it(item):
    return item.endswith(".lines")


def expand(item, options, what):
    """One part per `options.lines_per_part` lines of the file: lines:PATH?first=F&count=C."""
    lines = Path(item).read_text().splitlines()
    step = options.lines_per_part
    firsts = range(0, len(lines), step)
    return [f"{SCHEME}{item}?first={first}&count={min(step, len(lines) - first)}" for first in firsts]


def _part(url):
    parsed = urlsplit(url[len(SCHEME):])
    query = parse_qs(parsed.query)
    return parsed.path, int(query["first"][0]), int(query["count"][0])


def size(url):
    return _part(url)[2]


def members(url):
    """Each line a caption, its image a flat colour drawn from the line."""
    path, first, count = _part(url)
    for number, line in enumerate(Path(path).read_text().splitlines()[first : first + count], first):
        image = io.BytesIO()
        Image.new("RGB", (32, 32), tuple(ord(char) * 7 % 256 for char in (line * 3)[:3])).save(image, "PNG")
        yield f"{number:06d}.png", image.getvalue()
        yield f"{number:06d}.txt", line.encode()
'''

SPECS_MODULE = """
from dataclasses import dataclass
from typing import ClassVar

from clipdist.registry.kinds import KindSpec
from clipdist.defaults import FREE, positive
from clipdist.registry.losses import LossSpec


@dataclass
class ChunkOptions:
    RESUME: ClassVar[dict] = {"chunk": FREE}
    chunk: int = positive(512)  # rows per chunk


@dataclass
class LinesOptions:
    lines_per_part: int = positive(2)  # lines of a .lines file per part


CHUNKED = LossSpec("chunked", "chunked_loss:ChunkedLoss", "naive with an option", ChunkOptions)
LINES = KindSpec("lines", "lines_kind", "a caption per line, its image a flat colour", LinesOptions)
"""

RUN = """
import sys

import clipdist.registry.kinds as data_specs
import clipdist.registry.losses as loss_specs
from plugin_specs import CHUNKED, LINES

loss_specs.BACKENDS[CHUNKED.name] = CHUNKED  # the one line each registry gets
data_specs.KIND_SPECS = (*data_specs.KIND_SPECS, LINES)

from clipdist.cli import train_main  # noqa: E402 -- the schema is built from the registries on import

train_main(sys.argv[1:])
"""


def test_a_backend_and_a_data_kind_with_options_are_their_modules_and_their_entries(tmp_path, cache_dir):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    for name, source in [
        ("chunked_loss", LOSS_MODULE),
        ("lines_kind", KIND_MODULE),
        ("plugin_specs", SPECS_MODULE),
        ("run_with_plugins", RUN),
    ]:
        (plugins / f"{name}.py").write_text(textwrap.dedent(source))
    captions = tmp_path / "captions.lines"
    captions.write_text("\n".join(f"caption {index}" for index in range(12)) + "\n")
    environment = {**own_environment(), "PYTHONPATH": f"{plugins}{os.pathsep}{REPO}", "HYDRA_FULL_ERROR": "0"}

    def run(*overrides, run_dir="run"):
        command = [sys.executable, str(plugins / "run_with_plugins.py"), f"run_dir={tmp_path / run_dir}"]
        command += [f"data.cache_dir={cache_dir}", "logging.wandb=disabled", "logging.progress=false"]
        return subprocess.run(
            [*command, *overrides], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=environment
        )

    model = tmp_path / "tiny-deeper.json"  # open_clip's format: towers of another shape, no code
    tower = {"image_size": 32, "layers": 3, "width": 48, "head_width": 24, "patch_size": 8}
    text = {"context_length": 16, "vocab_size": 49408, "width": 48, "heads": 2, "layers": 3}
    model.write_text(json.dumps({"embed_dim": 32, "vision_cfg": tower, "text_cfg": text}))
    common = ["data=webdataset", f"data.train_shards={captions}", "data.val_shards=null", "data.workers=0"]
    common += [f"model.name={model}"]
    common += ["world.batch_per_device=4", "optim.max_steps=3", "eval_every=1000", "logging.report=false"]
    result = run("loss=chunked", "loss.chunk=3", "data.lines_per_part=5", *common)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [row["step"] for row in read_jsonl(tmp_path / "run" / "train_log.jsonl")][-1] == 3
    said = (tmp_path / "run" / "train.log").read_text()
    assert "loss chunked" in said and "3 train shard(s)" in said, said  # 12 lines in parts of 5: 5 + 5 + 2
    assert f"model {model}: 2.6M parameters" in said, said  # clipdist-tiny has 3.4M
    refused = run("loss=chunked", "data.lines_per_part=0", *common, run_dir="bad")  # its bound, before any rank
    assert refused.returncode != 0 and "data.lines_per_part=0: must be at least 1" in refused.stderr
