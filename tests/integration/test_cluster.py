"""The cluster files that no run here exercises: every SLURM script parses, the submitit launcher config composes
(the sbatch scripts themselves run under a real SLURM in test_slurm.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "slurm").iterdir()))
def test_slurm_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(REPO / "slurm" / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_hydra_slurm_launcher_config_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "hydra/launcher=slurm", "world=64gpu", "--cfg", "hydra"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "SlurmLauncher" in result.stdout and "tasks_per_node: ${world.procs_per_node}" in result.stdout
