"""The torch floor (clipdist/compat.py): declared once, said in pyproject and README, refused in one line below it,
and no torch API newer than the floor used without `require`."""

from __future__ import annotations

import ast
import re
from importlib import metadata
from pathlib import Path

import pytest

from clipdist import compat

REPO = Path(__file__).resolve().parents[2]


def test_pyproject_and_readme_declare_the_floor():
    text = (REPO / "pyproject.toml").read_text()
    floor = ".".join(map(str, compat.TORCH_FLOOR))
    assert f'"torch>={floor}"' in text and f'"torchvision>={".".join(map(str, compat.TORCHVISION_FLOOR))}"' in text
    assert f"torch ≥ {floor}" in (REPO / "README.md").read_text()


def test_an_older_torch_is_refused_in_one_line(monkeypatch):
    real = metadata.version
    monkeypatch.setattr(compat.metadata, "version", lambda name: "2.5.1+cu124" if name == "torch" else real(name))
    problem = compat.floor_problem()
    assert problem and "torch 2.5.1+cu124 is older" in problem and "\n" not in problem
    monkeypatch.setattr(compat.metadata, "version", lambda name: "2.11.0+cu130" if name == "torch" else real(name))
    assert compat.floor_problem() is None
    with pytest.raises(RuntimeError, match="needs torch >= 2.8"):
        monkeypatch.setattr(compat.metadata, "version", lambda name: "2.7.0")
        compat.require("torch.distributed.checkpoint.HuggingFaceStorageReader")


def _uses(tree: ast.AST) -> set[str]:
    """Dotted torch names a module uses: `from torch.a import b` → torch.a.b, and attribute chains torch.a.b.c."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "torch")
        elif isinstance(node, ast.Attribute):
            parts, inner = [], node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "torch":
                found.add(".".join(["torch", *reversed(parts)]))
    return found


def test_every_newer_torch_api_is_guarded():
    unguarded = []
    for path in sorted((REPO / "clipdist").rglob("*.py")):
        text = path.read_text()
        for name in _uses(ast.parse(text)):
            for api in compat.NEWER_APIS:
                if (name == api or name.startswith(api + ".")) and not re.search(
                    rf"require\(\"{re.escape(api)}\"\)", text
                ):
                    unguarded.append(f"{path.relative_to(REPO)}: {name} (torch {compat.NEWER_APIS[api]})")
    assert not unguarded, unguarded


def test_the_guard_sees_a_use():
    tree = ast.parse(
        "import torch\nfrom torch.distributed.checkpoint import HuggingFaceStorageReader\nx = torch.optim.Muon"
    )
    assert {"torch.distributed.checkpoint.HuggingFaceStorageReader", "torch.optim.Muon"} <= _uses(tree)
