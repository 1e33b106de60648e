"""The image tests/integration/test_container.py runs: the Dockerfile built with podman on this machine.

No registry is reachable here, so the PyTorch CUDA base cannot be pulled: the image is built on a Debian + Python
base made by `mmdebstrap` from Debian's packages and `podman import`ed, with `--build-arg TORCH=` naming the torch and
torchvision this suite runs on, installed by pip from whatever this machine's pip reaches (its configuration and the
local folders it names are mounted into the build read-only). Both images stay in podman's storage so the next run
reuses their layers; remove them with `podman rmi localhost/clipdist-test localhost/clipdist-test-base`.

Built from nothing (a fresh CI machine) the image takes minutes: 8 min 52 s here on 2026-11-27, 378 s of it on
the CPU, the rest waiting on the disk and the network. So the session's first process starts the build in the
background (`start_early`, from tests/conftest.py, when the container tests are selected and can run), niced, while
the other tests run; the tests' fixture waits for it (`ready`). Without that start (a worker run alone, another
selection) `ready` builds in place.

`python tests/container_image.py FOLDER`: the build, its output in FOLDER/log and its exit code in FOLDER/exit.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE, IMAGE = "localhost/clipdist-test-base:bookworm", "localhost/clipdist-test:latest"
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
# Within this machine's hard limits (podman's defaults ask for more than a sandbox may grant).
LIMITS = ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]
EARLY = "CLIPDIST_TEST_IMAGE_BUILD"  # the folder of the build start_early began, for the workers to wait on
BUILD_SECONDS = 1500


def podman(*arguments: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([*PODMAN, *arguments], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"podman {' '.join(arguments[:3])} ... exited {result.returncode}:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def unavailable() -> str | None:
    """Why the container tests cannot run here, or None."""
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


def build(folder: Path) -> str:
    """The Dockerfile built on the base with this suite's torch and torchvision; the image's name. The image it
    replaces (6 GB of layers once untagged) is removed."""
    _base_image(folder)
    conf, mounts = pip_mounts()
    (folder / "pip.conf").write_text(conf)
    pins = " ".join(f"{name}=={version(name).split('+')[0]}" for name in ("torch", "torchvision"))
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
        timeout=BUILD_SECONDS,
    )
    print(f"image built in {time.time() - started:.0f} s")
    built = podman("image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.strip()
    if replaced and replaced != built:
        podman("rmi", replaced, check=False)
    return IMAGE


def ready(folder: Path) -> str:
    """The image: the early build's once it has ended (its failure with its log), else built here into `folder`."""
    early = os.environ.get(EARLY)
    if not early or not Path(early).is_dir():
        return build(folder)
    exit_file, deadline = Path(early) / "exit", time.time() + BUILD_SECONDS + 900
    while not exit_file.exists():
        assert time.time() < deadline, f"the early image build did not end: {_tail(Path(early) / 'log')}"
        time.sleep(1)
    assert exit_file.read_text().strip() == "0", f"the early image build failed:\n{_tail(Path(early) / 'log')}"
    return IMAGE


def selected(config) -> bool:
    """Whether this pytest session would run the container tests: their file under the paths it was given (the
    configured testpaths without any), -m not deselecting them, and not only collecting. Unsure: False (the
    fixture then builds in place)."""
    if config.option.collectonly:
        return False
    marks = config.option.markexpr
    if marks:
        try:
            from _pytest.mark.expression import Expression

            if not Expression.compile(marks).evaluate(lambda name, **_: name == "container"):
                return False
        except Exception:  # noqa: BLE001 -- pytest's private API moved: build in place instead
            return False
    target = REPO / "tests" / "integration" / "test_container.py"
    for argument in config.args:
        path = Path(str(argument).split("::")[0])
        path = (path if path.is_absolute() else Path(config.invocation_params.dir) / path).resolve()
        if path == target or path in target.parents:
            return True
    return False


def start_early(config) -> None:
    """From the session's first process: the build begun in the background, its folder named in EARLY for the
    workers (which inherit this environment); stopped by stop_early if still running at the end."""
    if os.environ.get(EARLY) or unavailable() or not selected(config):
        return
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="clipdist-image-"))
    with open(folder / "log", "w") as log:
        process = subprocess.Popen(  # niced: the tests come first, the build takes the cores they leave idle
            ["nice", "-n", "10", sys.executable, __file__, str(folder)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    os.environ[EARLY] = str(folder)
    config.stash[_process] = (process, folder)


def stop_early(config) -> None:
    """The early build ended with the session: stopped if still running, its folder removed."""
    started = config.stash.get(_process, None)
    if started is None:
        return
    process, folder = started
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)  # podman build removes its container on SIGTERM
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    shutil.rmtree(folder, ignore_errors=True)
    os.environ.pop(EARLY, None)


def _tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.exists() else f"(no {path})"


try:
    import pytest

    _process = pytest.StashKey[tuple]()
except ImportError:  # run as a script by start_early: pytest is there, but nothing here needs it then
    pass


if __name__ == "__main__":
    where = Path(sys.argv[1])
    code = 0
    try:
        build(where)
    except BaseException as error:  # noqa: BLE001 -- said in the log for the waiting fixture
        print(f"{type(error).__name__}: {error}", flush=True)
        code = 1
    (where / "exit.part").write_text(str(code))
    (where / "exit.part").rename(where / "exit")
    sys.exit(code)
