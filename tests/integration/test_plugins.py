"""A research group's own components in its own installed package, no clipdist file edited: a loss backend that
computes a new loss (label-smoothed CLIP) with an option, a loss term with weight, start and an option, a data kind
with an option and an lr schedule with an option — each named in the package's entry points (clipdist.registry).
The package is pip-installed into a fresh virtual environment beside clipdist; there `clipdist train` composes their
keys, checks them, reads the kind's files, trains with the backend, the term and the schedule, and `clipdist
gradcheck` proves the backend and the term exact with non-default options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path

import pytest
from helpers import REPO, own_environment, read_jsonl

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "clipdist-lab"
version = "0.1"

[tool.setuptools]
packages = ["clipdist_lab"]

[project.entry-points."clipdist.losses"]
smoothed = "clipdist_lab.specs:SMOOTHED"

[project.entry-points."clipdist.terms"]
align = "clipdist_lab.specs:ALIGN"

[project.entry-points."clipdist.kinds"]
lines = "clipdist_lab.specs:LINES"

[project.entry-points."clipdist.schedules"]
linear = "clipdist_lab.specs:LINEAR"
"""

SPECS = '''
"""The lab's registry entries: torch-free, as clipdist's own."""
from dataclasses import dataclass
from typing import ClassVar

from clipdist.defaults import REFUSE, WARN, positive
from clipdist.registry.kinds import KindSpec
from clipdist.registry.losses import LossSpec
from clipdist.registry.schedules import ScheduleSpec
from clipdist.registry.terms import TermOptions, TermSpec


@dataclass
class SmoothingOptions:
    RESUME: ClassVar[dict] = {"smoothing": REFUSE}
    smoothing: float = 0.1  # label smoothing of both cross-entropies


@dataclass
class AlignOptions(TermOptions):
    RESUME: ClassVar[dict] = {**TermOptions.RESUME, "power": REFUSE}
    power: float = 2.0  # the exponent of each pair's distance


@dataclass
class LinesOptions:
    per_part: int = positive(2)  # lines of a .lines file per part


@dataclass
class LinearOptions:
    RESUME: ClassVar[dict] = {"floor": WARN}
    floor: float = 0.0  # the lr at the last step, as a fraction of optim.lr


SMOOTHED = LossSpec(
    "smoothed",
    "clipdist_lab.losses:SmoothedLoss",
    "CLIP with label smoothing",
    SmoothingOptions,
    reference="clipdist_lab.losses:smoothed_clip_loss",
)
ALIGN = TermSpec("align", "clipdist_lab.align:build", "each image pulled to its caption", AlignOptions)
LINES = KindSpec("lines", "clipdist_lab.lines", "a caption per line, its image a flat colour", LinesOptions)
LINEAR = ScheduleSpec("linear", "clipdist_lab.schedules:linear", "linear decay to floor · lr", LinearOptions)
'''

LOSSES = '''
import torch.nn.functional as F

from clipdist.losses.naive import NaiveLoss


def smoothed_clip_loss(image, text, scale, smoothing=0.0):
    """CLIP's loss with both cross-entropies label-smoothed, on one process over the whole batch."""
    logits = scale * image @ text.T
    labels = logits.new_tensor(range(len(logits))).long()
    return (F.cross_entropy(logits, labels, label_smoothing=smoothing)
            + F.cross_entropy(logits.T, labels, label_smoothing=smoothing)) / 2


class SmoothedLoss(NaiveLoss):
    """The naive backend's gather, a new loss on the global logits."""

    def __init__(self, smoothing: float = 0.1, group=None):
        super().__init__(group)
        self.smoothing = smoothing

    def compute(self, image_features, text_features, logit_scale, layout):
        from clipdist.losses.collectives import all_gather_rows, scale_gradient
        import torch

        def global_rows(local):
            parts = list(all_gather_rows(local, layout).split(list(layout.local_sizes)))
            parts[layout.rank] = scale_gradient(local, layout.world_size)
            return torch.cat(parts)

        return smoothed_clip_loss(global_rows(image_features), global_rows(text_features), logit_scale,
                                  self.smoothing)
'''

ALIGN = '''
import torch
import torch.distributed as dist

from clipdist.objective.base import Term, features_of


def build(options, context):
    return AlignTerm(options.power)


class AlignTerm(Term):
    """A = (1/B) Σ_i ‖I_i − T_i‖^p over the global batch; rank r's share (N/B) Σ_{i∈r} ‖I_i − T_i‖^p."""

    name = "align_loss"

    def __init__(self, power):
        self.power = power

    def value(self, features, part):
        image, text = features[0], features[1]
        rows, world = torch.tensor(float(len(image))), 1
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(rows)
            world = dist.get_world_size()
        return ((image - text).norm(dim=-1) ** self.power).sum() * world / rows

    def reference(self, raw, inputs):
        image, text = features_of(raw)[:2]
        return ((image - text).norm(dim=-1) ** self.power).mean()
'''

LINES = """
import io
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from PIL import Image

SCHEME = "lines:"


def names_it(item):
    return item.endswith(".lines")


def expand(item, options, what):
    lines = Path(item).read_text().splitlines()
    step = options.per_part
    firsts = range(0, len(lines), step)
    return [f"{SCHEME}{item}?first={first}&count={min(step, len(lines) - first)}" for first in firsts]


def _part(url):
    parsed = urlsplit(url[len(SCHEME):])
    query = parse_qs(parsed.query)
    return parsed.path, int(query["first"][0]), int(query["count"][0])


def size(url):
    return _part(url)[2]


def members(url):
    path, first, count = _part(url)
    for number, line in enumerate(Path(path).read_text().splitlines()[first : first + count], first):
        image = io.BytesIO()
        Image.new("RGB", (32, 32), tuple(ord(char) * 7 % 256 for char in (line * 3)[:3])).save(image, "PNG")
        yield f"{number:06d}.png", image.getvalue()
        yield f"{number:06d}.txt", line.encode()
"""

SCHEDULES = """
def linear(step, optim, options):
    progress = (step - optim.warmup_steps) / max(1, optim.max_steps - optim.warmup_steps)
    return 1 - (1 - options.floor) * progress
"""


@pytest.fixture(scope="module")
def lab_python(tmp_path_factory) -> Path:
    """A fresh virtual environment that sees this one's packages (clipdist, torch) through a .pth file, with the
    lab's package pip-installed into it."""
    root = tmp_path_factory.mktemp("lab")
    package = root / "clipdist-lab"
    (package / "clipdist_lab").mkdir(parents=True)
    (package / "pyproject.toml").write_text(PYPROJECT)
    for name, source in [("__init__", ""), ("specs", SPECS), ("losses", LOSSES), ("align", ALIGN)]:
        (package / "clipdist_lab" / f"{name}.py").write_text(textwrap.dedent(source))
    (package / "clipdist_lab" / "lines.py").write_text(textwrap.dedent(LINES))
    (package / "clipdist_lab" / "schedules.py").write_text(textwrap.dedent(SCHEDULES))
    environment = root / "venv"
    venv.EnvBuilder(with_pip=False).create(environment)
    python = environment / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    outer = [sysconfig.get_paths()["purelib"], str(REPO)]
    Path(site, "outer.pth").write_text("\n".join(outer) + "\n")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index"]
    install += ["--no-build-isolation", "--quiet", str(package)]
    result = subprocess.run(install, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return python


def _clipdist(python: Path, *arguments: str, cwd: Path) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in own_environment().items() if key != "PYTHONPATH"}
    return subprocess.run(
        [str(python), "-m", "clipdist", *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**environment, "HYDRA_FULL_ERROR": "0"},
    )


def test_a_backend_a_term_a_kind_and_a_schedule_from_an_installed_package_train(lab_python, tmp_path, cache_dir):
    captions = tmp_path / "captions.lines"
    captions.write_text("\n".join(f"caption {index}" for index in range(12)) + "\n")
    model = tmp_path / "tiny-deeper.json"  # open_clip's format: towers of another shape, no code
    tower = {"image_size": 32, "layers": 3, "width": 48, "head_width": 24, "patch_size": 8}
    text = {"context_length": 16, "vocab_size": 49408, "width": 48, "heads": 2, "layers": 3}
    model.write_text(json.dumps({"embed_dim": 32, "vision_cfg": tower, "text_cfg": text}))
    common = ["data=webdataset", f"data.train_shards={captions}", "data.val_shards=null", "data.workers=0"]
    common += [f"model.name={model}", f"data.cache_dir={cache_dir}", "logging.wandb=disabled"]
    common += ["logging.progress=false", "world.batch_per_device=4", "optim.max_steps=4", "optim.warmup_steps=1"]
    common += ["eval_every=1000", "logging.report=false", "logging.log_every=1"]
    ours = ["loss=smoothed", "loss.smoothing=0.2", "loss.align.weight=0.5", "loss.align.start_at=0.5"]
    ours += ["loss.align.power=1.5", "data.lines.per_part=5", "optim.schedule=linear", "optim.linear.floor=0.1"]
    result = _clipdist(lab_python, "train", f"run_dir={tmp_path / 'run'}", *ours, *common, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(tmp_path / "run" / "train_log.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert [row.get("align_loss", 0) > 0 for row in rows] == [False, False, True, True], rows  # from ⌈0.5 · 4⌉ + 1
    said = (tmp_path / "run" / "train.log").read_text()
    assert "loss smoothed" in said and "3 train shard(s)" in said, said  # 12 lines in parts of 5: 5 + 5 + 2
    lrs = [row["lr"] for row in rows]
    assert lrs[-1] == pytest.approx(2e-3 * (1 - 0.9 * 2 / 3)), lrs  # optim.lr, linear to 0.1 · lr over 3 steps

    refused = _clipdist(lab_python, "train", "data.lines.per_part=0", *common, cwd=tmp_path)  # its bound
    assert refused.returncode != 0 and "data.lines.per_part=0: must be at least 1" in refused.stderr
    elsewhere = _clipdist(lab_python, "train", "optim.linear.floor=0.5", *common, cwd=tmp_path)
    assert elsewhere.returncode != 0 and "optim.linear.floor is for optim.schedule=linear" in elsewhere.stderr


def test_the_plugged_backend_and_term_are_proven_exact_with_their_options(lab_python, tmp_path):
    check = ["gradcheck", "--backend", "smoothed", "--option", "smoothing=0.3", "--term", "align"]
    check += ["--option", "align.power=3", "--world", "3", "--batch", "2,4,3", "--chunks", "2", "--json"]
    result = _clipdist(lab_python, *check, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["exact"] and report["terms"] == ["align"] and report["options"]["smoothing"] == 0.3
    # exact only because the reference is given the backend's smoothing (clipdist.losses.build): at its default 0
    # the reference would be CLIP's loss and the check would fail


def test_a_plugin_that_does_not_load_is_left_out_in_one_line(tmp_path, cache_dir):
    """An installed package whose entry point names a module that is not there: every command still runs, one
    warning names it, and naming it says why it is missing."""
    found = tmp_path / "site"
    info = found / "clipdist_broken-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: clipdist-broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[clipdist.losses]\nbroken = clipdist_nowhere.specs:BROKEN\n")
    environment = {**own_environment(), "PYTHONPATH": f"{found}{os.pathsep}{REPO}", "HYDRA_FULL_ERROR": "0"}
    command = [sys.executable, "-m", "clipdist", "train", "loss=broken", f"run_dir={tmp_path / 'run'}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=environment)
    assert result.returncode == 2, result.stderr[-2000:]
    warning = "clipdist: warning: plug-in broken = clipdist_nowhere.specs:BROKEN (clipdist.losses): it did not load"
    assert warning in result.stderr and "ModuleNotFoundError" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
