"""The checkpointer: when to save (interval, signals), atomic writes, retention, and what to resume from."""
from __future__ import annotations

import logging
import os
import re
import signal
import threading
from pathlib import Path

import torch

from clipdist import distributed
from clipdist.config import ConfigError, TrainConfig, as_dict
from clipdist.state import TrainState, rng_state

log = logging.getLogger(__name__)
PATTERN = re.compile(r"step_(\d{8})\.pt$")


class CheckpointFiles:
    """<run_dir>/checkpoints/step_XXXXXXXX.pt, written atomically, the newest `keep` kept.

    A checkpoint is written to a temporary file, flushed to disk, then renamed: a crash
    mid-write leaves only a temporary file, never a truncated checkpoint under a real name.
    Loading falls back to older checkpoints if the newest cannot be read.
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


class StopSignal:
    """SIGTERM / SIGUSR1 (preemption, SLURM's --signal) ask for a checkpoint and a clean exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: int | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.received = signum

    def flag(self) -> torch.Tensor:
        return torch.tensor(0.0 if self.received is None else 1.0)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


class Checkpointer:
    """Owns checkpointing for a run: the step interval, the stop signal, saving on every rank's
    behalf (rank 0 writes, all ranks' RNG states included), retention and resuming."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, env: distributed.DistEnv):
        self.files = CheckpointFiles(run_dir, cfg.keep_checkpoints)
        self.every = cfg.checkpoint_every
        self.last_step = cfg.optim.max_steps
        self.resume = cfg.resume
        self.config = as_dict(cfg)
        self.env = env
        self.stop = StopSignal()

    @property
    def directory(self) -> Path:
        return self.files.directory

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.last_step

    def save(self, state: TrainState) -> None:
        """Collective: every rank calls it; rank 0 writes."""
        rngs = distributed.all_ranks(rng_state())
        if self.env.is_main:
            self.files.save({**state.state_dict(rngs), "config": self.config}, state.step)
        distributed.barrier()

    def restore(self, state: TrainState) -> Path | None:
        """Load what `resume` names into `state` (auto: the newest readable checkpoint); its path, or None."""
        found = self._find()
        if found is None:
            return None
        saved, path = found
        state.load_state_dict(saved, self.env.rank, self.env.world_size)
        return path

    @staticmethod
    def check_resume(cfg: TrainConfig) -> None:
        """Before any rank starts: resume=never over a run that has checkpoints, or a resume file that is not there."""
        if cfg.resume == "never":
            existing = CheckpointFiles(cfg.run_dir).checkpoints()
            if existing:
                raise ConfigError(
                    f"{existing[0].parent} already holds {existing[0].name}; resume=never would overwrite that run. "
                    "Use resume=auto to continue it, or name=<new name> for a new run"
                )
        elif cfg.resume != "auto" and not Path(cfg.resume).is_file():
            raise ConfigError(f"resume={cfg.resume!r}: no such checkpoint file (use auto, never, or a path)")

    def _find(self) -> tuple[dict, Path] | None:
        if self.resume == "auto":
            return self.files.load_latest()
        if self.resume == "never":
            return None
        return load(self.resume), Path(self.resume)

    def close(self) -> None:
        self.stop.restore()
