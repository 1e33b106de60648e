"""The suite's own machinery: which sessions start the container image's build early (tests/container_image.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from container_image import REPO, selected


def session(*args: str, marks: str = "", collect_only: bool = False, where=REPO):
    return SimpleNamespace(
        args=list(args),
        option=SimpleNamespace(collectonly=collect_only, markexpr=marks),
        invocation_params=SimpleNamespace(dir=where),
    )


@pytest.mark.parametrize(
    "config, builds",
    [
        (session("tests"), True),  # the README's command: the configured testpaths
        (session(str(REPO / "tests")), True),
        (session("tests/integration/test_container.py::test_image_runs_the_planner"), True),
        (session("integration", where=REPO / "tests"), True),
        (session("tests", marks="container or slurm"), True),
        (session("tests", marks="not slurm"), True),
        (session("tests/unit"), False),
        (session("tests/integration/test_slurm.py"), False),
        (session("tests", marks="not container"), False),
        (session("tests", marks="slurm"), False),
        (session("tests", collect_only=True), False),
    ],
)
def test_the_image_is_built_early_only_for_a_session_that_runs_its_tests(config, builds):
    assert selected(config) is builds
