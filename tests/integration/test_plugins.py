"""A research group's own components in its own installed package, no clipdist file edited: a loss backend that
computes a new loss (label-smoothed CLIP) with an option, a loss term with weight, start and an option, a data kind
with an option and an lr schedule with an option — each named in the package's entry points (clipdist.registry).
The package is the one docs/architecture.md walks through, read from the page's code blocks, so the page stays true.
It is pip-installed into a fresh virtual environment beside clipdist; there `clipdist train` composes their
keys, checks them, reads the kind's files, trains with the backend, the term and the schedule, and `clipdist
gradcheck` proves the backend and the term exact with non-default options."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
from helpers import REPO, own_environment, read_jsonl

WALK_THROUGH = REPO / "docs" / "architecture.md"


def lab_files(page: Path = WALK_THROUGH) -> dict[str, str]:
    """The lab package as docs/architecture.md's "Four afternoon changes" writes it: every fenced block whose first
    line is `# <file name>`, the blocks of one file joined in page order (specs.py grows by one spec a change)."""
    files: dict[str, str] = {}
    for block in re.findall(r"(?ms)^```\w*\n(.*?)^```", page.read_text()):
        named = re.match(r"# ((?:clipdist_lab/)?[\w.]+\.(?:py|toml))\n", block)
        if named:
            files[named.group(1)] = files.get(named.group(1), "") + block[named.end() :] + "\n"
    return files


def test_the_walk_through_writes_the_whole_package():
    files = lab_files()
    expected = {"pyproject.toml"} | {f"clipdist_lab/{name}.py" for name in ("specs", "losses", "align", "lines")}
    assert set(files) == expected | {"clipdist_lab/schedules.py"}, sorted(files)
    assert all(f"\n{spec} = " in files["clipdist_lab/specs.py"] for spec in ("SMOOTHED", "ALIGN", "LINES", "LINEAR"))


@pytest.fixture(scope="module")
def lab_python(tmp_path_factory) -> Path:
    """A fresh virtual environment that sees this one's packages (clipdist, torch) through a .pth file, with the
    lab's package, as docs/architecture.md writes it, pip-installed into it."""
    root = tmp_path_factory.mktemp("lab")
    package = root / "clipdist-lab"
    (package / "clipdist_lab").mkdir(parents=True)
    (package / "clipdist_lab" / "__init__.py").write_text("")
    for name, source in lab_files().items():
        (package / name).write_text(source)
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
