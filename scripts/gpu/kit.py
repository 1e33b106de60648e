"""The GPU kit's package list (kit.txt): `pins` prints name==version for each wheel (from requirements/ci.txt),
`check DIR` says which wheels are missing from DIR and its size."""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIMIT_BYTES = 64 * 2**20  # what a device call carries with the working tree


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sections(path: Path = HERE / "kit.txt") -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("["):
            current = line.strip("[]")
            found[current] = []
        elif line and current:
            found[current].append(normal(line))
    return found


def pins() -> list[str]:
    pinned = {
        normal(name): version
        for name, version in re.findall(
            r"(?m)^([A-Za-z0-9_.-]+)==(\S+)", (HERE.parents[1] / "requirements" / "ci.txt").read_text()
        )
    }
    missing = [name for name in sections()["wheels"] if name not in pinned]
    if missing:
        sys.exit(f"kit.py: no version in requirements/ci.txt for {missing}")
    return [f"{name}=={pinned[name]}" for name in sections()["wheels"]]


def check(folder: Path) -> None:
    have = {normal(path.name.split("-")[0]) for path in folder.glob("*.whl")}
    missing = [name for name in sections()["wheels"] if name not in have]
    size = sum(path.stat().st_size for path in folder.glob("*.whl"))
    if missing:
        sys.exit(f"kit.py: no wheel for {missing} in {folder}")
    if size > LIMIT_BYTES:
        sys.exit(f"kit.py: the wheels take {size / 2**20:.1f} MiB, more than a device call carries (64 MiB)")
    print(f"kit.py: {len(have)} wheels, {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    if sys.argv[1:2] == ["pins"]:
        print("\n".join(pins()))
    elif sys.argv[1:2] == ["check"]:
        check(Path(sys.argv[2]))
    else:
        sys.exit("usage: kit.py pins | check DIR")
