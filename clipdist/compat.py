"""The torch releases clipdist runs on: a floor (the oldest torch whose public APIs the code uses), checked before
torch is imported, and the APIs newer than the floor that the code uses, each behind `require`.

The floor is torch 2.6: FSDP2's `fully_shard` / `register_fsdp_forward_method` and `torch.nn.utils.get_total_norm`
/ `clip_grads_with_norm_` are public from there; FSDP2 with the scalars left whole needs 2.7. CI tests torch 2.14.1
(requirements/ci.txt); scripts/check_floor.sh runs the unit tests and the default run on 2.6. Cluster images bring
their own torch (NGC, site containers: 2.6 and newer): README's install keeps it."""

from __future__ import annotations

from importlib import metadata

TORCH_FLOOR = (2, 6)
TORCHVISION_FLOOR = (0, 21)

# torch APIs newer than TORCH_FLOOR, by the release that made them public: a module that uses one calls
# `require(name)` first (tests/unit/test_compat.py fails on a use without it). A keyword an API gained later is named
# as `api(keyword)`. scripts/check_floor.sh runs the unit tests and the default run on the floor.
NEWER_APIS: dict[str, tuple[int, int]] = {
    "torch.distributed.fsdp.fully_shard(ignored_params)": (2, 7),  # FSDP2 with the 0-dim scalars left whole
    "torch.distributed.checkpoint.staging.DefaultStager": (2, 8),
    "torch.distributed.checkpoint.HuggingFaceStorageReader": (2, 8),
    "torch.distributed.checkpoint.HuggingFaceStorageWriter": (2, 8),
    "torch.optim.Muon": (2, 9),
    "torch.distributed.fsdp.share_comm_ctx": (2, 9),
    "torch.nn.attention.varlen": (2, 10),
}


def release(package: str) -> tuple[int, int] | None:
    """(major, minor) of an installed package, read from its metadata without importing it; None if absent."""
    try:
        version = metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return None


def floor_problem() -> str | None:
    """One line saying which installed torch / torchvision is older than the floor and what to do; None if fine."""
    for package, floor in (("torch", TORCH_FLOOR), ("torchvision", TORCHVISION_FLOOR)):
        found = release(package)
        if found is not None and found < floor:
            torch_floor, vision_floor = (".".join(map(str, f)) for f in (TORCH_FLOOR, TORCHVISION_FLOOR))
            wanted = f"'torch>={torch_floor}' 'torchvision>={vision_floor}'"
            return (
                f"{package} {metadata.version(package)} is older than clipdist needs ({package} >= "
                f"{'.'.join(map(str, floor))}): use an image with torch >= 2.6, or pip install "
                f"{wanted}"
            )
    return None


def require(api: str) -> None:
    """Refuse, in one line, a feature that needs a torch API newer than the installed torch."""
    needed, found = NEWER_APIS[api], release("torch")
    if found is not None and found < needed:
        raise RuntimeError(
            f"{api} needs torch >= {needed[0]}.{needed[1]} (installed: {metadata.version('torch')}); "
            "upgrade torch or leave the feature off"
        )
