"""What can be checked here of the cluster set-up: scripts parse, launcher config composes, image installs as the README."""
from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "slurm").iterdir()))
def test_slurm_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(REPO / "slurm" / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_sbatch_scripts_checkpoint_before_the_limit_and_requeue():
    for script in (REPO / "slurm").glob("*.sbatch"):
        text = script.read_text()
        assert "#SBATCH --signal=B:USR1@" in text and "#SBATCH --requeue" in text
    common = (REPO / "slurm" / "common.sh").read_text()
    assert "resume=auto" in common and "scontrol requeue" in common


def test_hydra_slurm_launcher_config_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "hydra/launcher=slurm", "world=64gpu", "--cfg", "hydra"],
                            capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "SlurmLauncher" in result.stdout and "tasks_per_node: ${world.procs_per_node}" in result.stdout


def test_docker_image_installs_with_the_readme_command():
    dockerfile = (REPO / "Dockerfile").read_text()
    readme = (REPO / "README.md").read_text()
    assert "RUN pip install -e ." in dockerfile and "pip install -e . && python train.py" in readme
    assert 'ENTRYPOINT ["python", "train.py"]' in dockerfile
    assert "USER 1000" in dockerfile
