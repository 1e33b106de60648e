"""The GPU kit (scripts/gpu/): its wheel list is the project's runtime dependency closure less what the site image
ships and what is left out with a reason — a dependency added to pyproject without a place in the kit fails here —
and its install step takes nothing from a registry and leaves torch alone."""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "gpu"))
import kit  # noqa: E402


def closure(roots: list[str], stop: set[str]) -> set[str]:
    """Every distribution `roots` need at run time (markers for this interpreter, no extras), not expanding `stop`."""
    seen, todo = set(), [kit.normal(name) for name in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in stop:
            continue
        for line in metadata.distribution(name).requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(kit.normal(requirement.name))
    return seen


def test_the_kit_holds_the_dependency_closure_less_the_image():
    listed = kit.sections()
    wheels, image, left_out = set(listed["wheels"]), set(listed["image"]), set(listed["left out"])
    project = [Requirement(line) for line in metadata.distribution("clipdist").requires or []]  # pyproject's, installed
    roots = [r.name for r in project if r.marker is None] + ["scikit-image"]  # + the battery's web_photos run
    needed = closure(roots, stop=image | left_out) - image - left_out
    assert needed - wheels == set(), (
        f"add to scripts/gpu/kit.txt [wheels], or say why it is left out: {needed - wheels}"
    )
    assert wheels - needed == set(), f"no longer needed: {wheels - needed}"
    assert not wheels & image and not wheels & left_out


def test_every_wheel_has_the_version_ci_tests():
    pins = dict(pin.split("==") for pin in kit.pins())
    assert set(pins) == set(kit.sections()["wheels"]) and all(pins.values())


def test_the_install_step_takes_nothing_from_a_registry_and_keeps_torch():
    script = (REPO / "scripts" / "gpu" / "install.sh").read_text()
    installs = [line for line in script.splitlines() if re.search(r"pip install", line)]
    assert installs and all("--no-deps" in line and "--no-index" in line for line in installs), installs
    assert "torch changed" in script
    for device_script in ("run.sh", "profile.sh"):  # every device script installs through install.sh alone
        text = (REPO / "scripts" / "gpu" / device_script).read_text()
        assert ". scripts/gpu/install.sh" in text and "pip install" not in text, device_script
    assert "--budget" in (REPO / "scripts" / "gpu" / "run.sh").read_text()
