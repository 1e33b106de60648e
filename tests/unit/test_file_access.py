"""Every file clipdist touches goes through clipdist/files.py: an AST walk over the package finds every call that
opens, reads or writes a file by path (open, os.open, Path.open / read_* / write_*, gzip/bz2/lzma/tarfile open,
webdataset's gopen, torch.load / torch.save, safetensors' load_file / save_file) outside it. Decoding bytes
already in memory (`Image.open(io.BytesIO(data))`, `torch.load(io.BytesIO(data))`) is not a file access."""

from __future__ import annotations

import ast
from pathlib import Path

import clipdist

PACKAGE = Path(clipdist.__file__).parent
THE_MODULE = PACKAGE / "files.py"
ANY_OWNER = {"open", "read_text", "read_bytes", "write_text", "write_bytes", "fdopen", "gopen"}
ANY_OWNER |= {"load_file", "save_file"}
OWNED = {("torch", "load"), ("torch", "save"), ("np", "load"), ("np", "save"), ("numpy", "load"), ("json", "load")}


def in_memory(call: ast.Call) -> bool:
    """The first argument is bytes in memory: io.BytesIO(...) / BytesIO(...)."""
    first = call.args[0] if call.args else None
    if not isinstance(first, ast.Call):
        return False
    name = first.func.attr if isinstance(first.func, ast.Attribute) else getattr(first.func, "id", "")
    return name == "BytesIO"


def accesses(source: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or in_memory(node):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("open", "load_file", "save_file"):
            found.append((node.lineno, func.id))
        elif isinstance(func, ast.Attribute):
            owner = func.value.id if isinstance(func.value, ast.Name) else None
            if func.attr in ANY_OWNER or (owner, func.attr) in OWNED:
                found.append((node.lineno, f"{owner or '…'}.{func.attr}"))
    return found


def test_the_check_finds_each_kind_of_access():
    source = "\n".join(
        [
            "open('x')",
            "Path('x').read_text()",
            "path.write_bytes(b'')",
            "gzip.open(p)",
            "torch.load(p)",
            "torch.save(v, p)",
            "wds.gopen(u)",
            "os.open(p, 0)",
            "load_file(p)",
            "Image.open(io.BytesIO(data))",
            "torch.load(io.BytesIO(data))",
            "read_bounded(p, 10)",
        ]
    )
    assert [line for line, _ in accesses(source)] == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_no_module_but_files_opens_reads_or_writes_a_file():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line} {what}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != THE_MODULE
        for line, what in accesses(path.read_text())
    ]
    assert found == [], "\n".join(found)
