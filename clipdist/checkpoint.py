"""Atomic checkpoints in the run directory, and finding the newest complete one."""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

log = logging.getLogger(__name__)
PATTERN = re.compile(r"step_(\d{8})\.pt$")


class CheckpointManager:
    """Writes <run_dir>/checkpoints/step_XXXXXXXX.pt atomically and keeps the newest `keep`.

    A checkpoint is written to a temporary file, flushed to disk, then renamed: a crash
    mid-write leaves only a temporary file, never a truncated checkpoint under a real name.
    Loading still falls back to older checkpoints if the newest cannot be read.
    """

    def __init__(self, run_dir: str | Path, keep: int = 3):
        self.directory = Path(run_dir) / "checkpoints"
        self.keep = keep

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, newest first."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if PATTERN.search(p.name)]
        return sorted(found, key=lambda p: int(PATTERN.search(p.name).group(1)), reverse=True)

    def save(self, state: dict, step: int) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"step_{step:08d}.pt"
        partial = self.directory / f".{final.name}.partial"
        with open(partial, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, final)
        for old in self.checkpoints()[self.keep:]:
            old.unlink()
        return final

    def load_latest(self, map_location="cpu") -> tuple[dict, Path] | None:
        """The newest checkpoint that loads, with its path; None if there is none."""
        for path in self.checkpoints():
            try:
                return load(path, map_location), path
            except Exception as error:  # a damaged file: say so and try the one before it
                log.warning("checkpoint %s is unreadable (%s); trying an older one", path, error)
        return None


def load(path: str | Path, map_location="cpu") -> dict:
    # Our checkpoints hold optimizer/RNG state and the config: not weights-only.
    return torch.load(path, map_location=map_location, weights_only=False)
