"""clipdist from a wheel, in a fresh virtual environment: `clipdist train`, `python -m clipdist`, `clipdist plan`.

The config groups ship inside the package, so nothing here may read the checkout: the wheel is
built from it, installed into a new venv (the test environment's packages are reused through a
.pth file instead of reinstalling torch), and run from an empty directory.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, read_jsonl


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(root / "dist"),
            str(REPO),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    wheel = next((root / "dist").glob("clipdist-*.whl"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = next((venv / "lib").glob("python*/site-packages"))
    (purelib / "reuse_test_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "-q",
            str(wheel),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    return venv, wheel


def run_in(venv: Path, cwd: Path, *command: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    return subprocess.run(list(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_wheel_ships_the_config_and_trains_from_any_directory(wheel_venv, tmp_path):
    venv, wheel = wheel_venv
    where = run_in(venv, tmp_path, str(venv / "bin" / "python"), "-c", "import clipdist; print(clipdist.__file__)")
    assert where.returncode == 0 and str(venv) in where.stdout, (where.stdout, where.stderr)
    overrides = [
        f"data.cache_dir={tmp_path / 'cache'}",
        "logging.wandb=disabled",
        "logging.progress=false",
        "optim.max_steps=3",
        "eval_every=3",
        "world.batch_per_device=16",
        "logging.log_every=1",
    ]
    trained = run_in(venv, tmp_path, str(venv / "bin" / "clipdist"), "train", "name=wheel", *overrides)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert [row["step"] for row in read_jsonl(tmp_path / "runs" / "wheel" / "train_log.jsonl")] == [1, 2, 3]
    assert (tmp_path / "runs" / "wheel" / "checkpoints" / "step_00000003.dcp").is_dir()

    module = run_in(
        venv,
        tmp_path,
        str(venv / "bin" / "python"),
        "-m",
        "clipdist",
        "train",
        "name=module",
        "loss=tiled",
        "loss.tile=8",
        *overrides,
    )
    assert module.returncode == 0, module.stderr[-3000:]
    assert read_jsonl(tmp_path / "runs" / "module" / "train_log.jsonl")[-1]["step"] == 3


def test_wheel_plan_reads_the_shipped_presets(wheel_venv, tmp_path):
    venv, _ = wheel_venv
    result = run_in(
        venv,
        tmp_path,
        str(venv / "bin" / "clipdist"),
        "plan",
        "--model",
        "tiny",
        "--world",
        "cpu4",
        "--global-batch",
        "64",
        "--backend",
        "disco",
        "--memory",
        "1GB",
        "--json",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    assert plan["model"] == "clipdist-tiny" and plan["world_size"] == 4  # both read from the shipped conf/ presets
