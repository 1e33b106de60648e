"""The checkpointer: when to save (interval, signals), atomic writes, retention, and what to resume from."""
from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path

import torch

from clipdist.config import OnCheckpointError, TrainConfig, as_dict
from clipdist.errors import CheckpointError, ConfigError
from clipdist.launch import DistEnv, StopSignal
from clipdist.parallel import all_ranks
from clipdist.state import TrainState

log = logging.getLogger(__name__)
PATTERN = re.compile(r"step_(\d{8})\.(pt|dcp)$")  # .pt: one file (DDP); .dcp: a folder of shards (FSDP)
UNSHARDED = "progress.pt"  # in a .dcp folder: TrainState.unsharded_state_dict() and the config


class CheckpointFiles:
    """<run_dir>/checkpoints/step_XXXXXXXX.pt (or .dcp/), written atomically, the newest `keep` kept.

    A checkpoint is written to a temporary name, flushed to disk, then renamed: a crash
    mid-write leaves only a hidden `.partial`, never a truncated checkpoint under a real name.
    Loading falls back to older checkpoints if the newest cannot be read. Sharded (FSDP)
    checkpoints are folders written by every rank with torch.distributed.checkpoint.
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
        """Write atomically; on any failure remove the temporary file and raise CheckpointError (one line)."""
        final = self.directory / f"step_{step:08d}.pt"
        partial = self.directory / f".{final.name}.partial"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _write(partial, state)
            os.replace(partial, final)
        except Exception as error:  # noqa: BLE001 -- OSError, or torch's RuntimeError around one
            reason = _reason(error, self.directory)  # before the partial file frees its space
            partial.unlink(missing_ok=True)
            raise self._failed(final, reason) from None
        self._retain()
        return final

    def save_sharded(self, shards: dict, unsharded: dict, step: int, is_main: bool) -> Path:
        """Collective: every rank writes its shards (torch.distributed.checkpoint) into a hidden folder,
        then rank 0 adds `unsharded` and renames the folder. A failure on any rank raises CheckpointError
        on every rank, the hidden folder removed; the previous checkpoint stays the newest."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        final = self.directory / f"step_{step:08d}.dcp"
        partial = self.directory / f".{final.name}.partial"

        def stage(action, ranks_all: bool) -> None:
            error = None
            if ranks_all or is_main:
                try:
                    action()
                except CheckpointException as failure:  # DCP's: one (exception, traceback) per failed rank
                    rank, (cause, _) = next(iter(failure.failures.items()))
                    error = f"rank {rank}: {_reason(cause, self.directory)}"
                except Exception as failure:  # noqa: BLE001 -- reported on every rank below
                    error = _reason(failure, self.directory)
            error = next((e for e in all_ranks(error) if e), None)  # every rank learns of any failure
            if error is not None:
                if is_main:
                    shutil.rmtree(partial, ignore_errors=True)
                raise self._failed(final, error)

        def prepare():
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash mid-save
            partial.mkdir(parents=True)

        def publish():
            _write(partial / UNSHARDED, unsharded)
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)

        stage(prepare, ranks_all=False)
        stage(lambda: dcp.save(shards, checkpoint_id=str(partial)), ranks_all=True)
        stage(publish, ranks_all=False)
        if is_main:
            self._retain()
        return final

    def _failed(self, final: Path, reason: str) -> CheckpointError:
        previous = self.checkpoints()
        kept = f"the previous checkpoint {previous[0].name} is intact" if previous else "no earlier checkpoint"
        return CheckpointError(f"could not write checkpoint {final}: {reason}; {kept}. "
                               "Free space (or fix the folder) and resume with resume=auto")

    def _retain(self) -> None:
        for old in self.checkpoints()[self.keep:]:
            shutil.rmtree(old) if old.is_dir() else old.unlink()

    def load_latest(self, map_location="cpu") -> tuple[dict, Path] | None:
        """The newest checkpoint that loads, with its path; None if there is none."""
        for path in self.checkpoints():
            try:
                return load(path, map_location), path
            except Exception as error:  # a damaged file: say so and try the one before it
                log.warning("checkpoint %s is unreadable (%s); trying an older one", path, error)
        return None


def _write(path: Path, obj) -> None:
    """torch.save, flushed to disk before it returns."""
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _reason(error: Exception, directory: Path) -> str:
    """The OS-level cause of a failed save in a few words (torch wraps it in a long RuntimeError)."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    # torch's writer reports a short write as "unexpected pos"; the disk's free space tells why.
    if "No space left on device" in str(error) or (directory.exists() and shutil.disk_usage(directory).free < 2**20):
        return "No space left on device"
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def peek(path: str | Path) -> dict:
    """A checkpoint's step, world size and config without reading its tensors (memory-mapped)."""
    path = Path(path)
    saved = torch.load(path / UNSHARDED if path.is_dir() else path, map_location="cpu", weights_only=False, mmap=True)
    return {"step": saved["step"], "world_size": saved["world_size"], "config": saved["config"],
            "sharded": path.is_dir()}


def load(path: str | Path, map_location="cpu") -> dict:
    """A .pt checkpoint whole, or a .dcp folder's progress (its shards are loaded into the model in place)."""
    path = Path(path)
    # Our checkpoints hold optimizer/RNG state and the config: not weights-only.
    return torch.load(path / UNSHARDED if path.is_dir() else path, map_location=map_location, weights_only=False)


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _identity(config: dict) -> dict:
    """The keys whose change makes another run (refused on resume): the model and the loss, but not the
    loss's initial scalars. World size and batch may change."""
    flat = _flat(config)
    return {key: value for key, value in flat.items()
            if key == "model.name" or (key.startswith("loss.") and not key.startswith("loss.init_"))}


class Checkpointer:
    """Owns checkpointing for a run: when to save (every `checkpoint_every` steps, the last step, every
    `checkpoint_every_minutes`, a stop signal), saving on every rank's behalf (rank 0 writes, all ranks'
    RNG states and stream positions included), retention and resuming.

    The timer and the signal are per process; `requests()` gives this rank's, the step's one all-reduce
    agrees them over ranks (trainer.StepAgreement), and `due` decides with the agreed timer."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, env: DistEnv):
        self.files = CheckpointFiles(run_dir, cfg.keep_checkpoints)
        self.every = cfg.checkpoint_every
        self.every_s = None if cfg.checkpoint_every_minutes is None else 60 * cfg.checkpoint_every_minutes
        self.last_saved = time.monotonic()
        self.last_step = cfg.optim.max_steps
        self.resume = cfg.resume
        self.on_error = cfg.on_checkpoint_error
        self.config = as_dict(cfg)
        self.env = env
        self.sharded = cfg.world.parallel == "fsdp"
        self.stop = StopSignal()

    @property
    def directory(self) -> Path:
        return self.files.directory

    def requests(self) -> tuple[bool, bool]:
        """This rank's (stop signal received, checkpoint_every_minutes passed since the last save)."""
        timer_elapsed = self.every_s is not None and time.monotonic() - self.last_saved >= self.every_s
        return self.stop.received is not None, timer_elapsed

    def due(self, step: int, timer_elapsed: bool) -> bool:
        """Whether the state after `step` is saved: the step interval, the last step, or the (agreed) timer."""
        return step % self.every == 0 or step == self.last_step or timer_elapsed

    def save(self, state: TrainState) -> bool:
        """Collective: every rank calls it, rank 0 writes, every rank learns whether it worked.

        A failed write raises CheckpointError on every rank (on_checkpoint_error=stop), or is
        logged as a warning and returns False (warn).
        """
        error = None
        if self.sharded:
            try:
                self.files.save_sharded(state.sharded_state_dict(), {**state.unsharded_state_dict(), "config": self.config},
                                        state.step, self.env.is_main)
            except CheckpointError as failure:  # raised on every rank alike
                error = str(failure)
        else:
            whole = state.state_dict()  # a collective: every rank's RNG and stream position
            if self.env.is_main:
                try:
                    self.files.save({**whole, "config": self.config}, state.step)
                except CheckpointError as failure:
                    error = str(failure)
            error = all_ranks(error)[0]
        self.last_saved = time.monotonic()
        if error is None:
            return True
        if self.on_error == OnCheckpointError.stop:
            raise CheckpointError(error)
        if self.env.is_main:
            log.warning("%s (on_checkpoint_error=warn: training goes on)", error)
        return False

    def restore(self, state: TrainState) -> Path | None:
        """Load what `resume` names into `state` (auto: the newest readable checkpoint); its path, or None."""
        found = self._find()
        if found is None:
            return None
        saved, path = found
        if path.is_dir():  # sharded: every rank reads its part of each tensor, whatever world size wrote them
            import torch.distributed.checkpoint as dcp

            shards = state.sharded_state_dict()
            dcp.load(shards, checkpoint_id=str(path))
            state.load_sharded_state_dict(shards)
            state.load_unsharded_state_dict(saved)
        else:
            state.load_state_dict(saved)
        return path

    @staticmethod
    def check_resume(cfg: TrainConfig, world_size: int) -> str | None:
        """Before any rank starts: refuse resume=never over a run with checkpoints, a missing resume file,
        or a checkpoint of another model or loss; a changed global batch is allowed (the returned warning)."""
        files = CheckpointFiles(cfg.run_dir)
        if cfg.resume == "never":
            existing = files.checkpoints()
            if existing:
                raise ConfigError(
                    f"{files.directory} already holds {existing[0].name}; resume=never would overwrite "
                    "that run. Use resume=auto to continue it, or name=<new name> for a new run")
            return None
        if cfg.resume != "auto" and not (Path(cfg.resume).is_file() or (Path(cfg.resume) / UNSHARDED).is_file()):
            raise ConfigError(f"resume={cfg.resume!r}: no such checkpoint file or .dcp folder (use auto, never, or a path)")
        for path in files.checkpoints() if cfg.resume == "auto" else [Path(cfg.resume)]:
            try:
                saved = peek(path)
            except Exception:  # noqa: BLE001 -- unreadable: restore falls back to an older one and says so
                continue
            return _compare(saved, as_dict(cfg), world_size, path)
        return None

    def _find(self) -> tuple[dict, Path] | None:
        if self.resume == "auto":
            return self.files.load_latest()
        if self.resume == "never":
            return None
        return load(self.resume), Path(self.resume)

    def close(self) -> None:
        self.stop.restore()


def _compare(saved: dict, config: dict, world_size: int, path: Path) -> str | None:
    parallel = config["world"]["parallel"]
    if saved["sharded"] != (parallel == "fsdp"):
        written = "world.parallel=fsdp (a sharded .dcp folder)" if saved["sharded"] else "world.parallel=ddp (one .pt file)"
        raise ConfigError(f"{path} was written with {written}; resume it with that setting (a DDP run and an FSDP "
                          "run keep different checkpoints), or start a new run with name=<new name>")
    before, now = _identity(saved["config"]), _identity(config)
    changed = sorted(key for key in set(before) | set(now) if before.get(key) != now.get(key))
    if changed:
        was = ", ".join(f"{key}={before.get(key, '(unset)')}" for key in changed)
        asked = ", ".join(f"{key}={now.get(key, '(unset)')}" for key in changed)
        raise ConfigError(f"{path} was trained with {was}, not {asked}: resume it with the same settings, "
                          "or start a new run with name=<new name>")
    old_batch = saved["world_size"] * saved["config"].get("world", {}).get("batch_per_device", 0)
    new_batch = world_size * config["world"]["batch_per_device"]
    if old_batch != new_batch:
        return (f"resuming {path} (step {saved['step']}) with global batch {new_batch} "
                f"({world_size} rank(s) × {config['world']['batch_per_device']}), it was {old_batch}")
    return None
