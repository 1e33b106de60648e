"""The checkpointer: when to save (interval, signals), one format for every parallelism, atomic writes,
retention, and what to resume from.

A checkpoint is a folder, `<run_dir>/checkpoints/step_XXXXXXXX.dcp/`, whatever the parallelism:
  - torch.distributed.checkpoint shards of the model and the optimizer (`get_state_dict`: keyed by parameter
    name; DDP's replicas written once, FSDP's shards by the ranks that hold them), so a checkpoint resumes at
    any world size, under DDP or FSDP alike; beside them each rank's generators and the data readers' positions
    as tensors (clipdist.checkpoint.state.TrainState.sharded_state_dict), each written by the ranks that hold them;
  - `progress.pt`: step, samples seen, schedule, the stream's layout and position, the world size and the config
    — plain Python types only, nothing that grows with the world, read back with weights_only
    (clipdist.checkpoint.weights).
Every rank writes into a hidden `.step_XXXXXXXX.dcp.partial/`, then rank 0 adds progress.pt and renames it:
a crash mid-save leaves only the hidden folder, never a checkpoint under a real name. The newest
`keep_checkpoints` are kept; resume takes the newest that can be read. `step_*.pt` files (DDP runs before the
one format) still resume, read as safely.
"""

from __future__ import annotations

import inspect
import io
import logging
import os
import shutil
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map_only

from clipdist import console
from clipdist.checkpoint import weights
from clipdist.checkpoint.compile_cache import CompileCache
from clipdist.checkpoint.remote import RemoteCopies
from clipdist.checkpoint.state import TrainState
from clipdist.config import REFUSE, WARN, OnCheckpointError, TrainConfig, as_dict, resume_rule
from clipdist.distributed.launch import DistEnv, StopSignal
from clipdist.distributed.parallel import all_ranks
from clipdist.errors import CheckpointError, ConfigError, printable
from clipdist.files import save_torch, write_durable

log = logging.getLogger(__name__)


class CheckpointFiles:
    """<run_dir>/checkpoints/step_XXXXXXXX.dcp/: written by every rank into a hidden folder, published by rank 0's
    rename, the newest `keep` kept. `start` (collective) begins a save, asynchronously where asked; `finish`
    (collective) waits for it and publishes it."""

    def __init__(self, run_dir: str | Path, keep: int = 3):
        self.directory = Path(run_dir) / "checkpoints"
        self.keep = keep

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, newest first."""
        return weights.checkpoints_in(self.directory)

    def save(self, shards: dict, progress: dict, step: int, is_main: bool) -> Path:
        """Collective: `start` and `finish` in one."""
        return self.finish(self.start(shards, progress, step, is_main), is_main)

    def start(
        self,
        shards: dict,
        progress: dict,
        step: int,
        is_main: bool,
        group=None,
        background: bool = False,
        stage_in_background: bool = False,
    ) -> PendingSave:
        """Collective: every rank writes its part of `shards` (torch.distributed.checkpoint) into a hidden folder —
        in a background thread where `background` (DCP's async_save: the state copied to host memory first, then
        written while training goes on; its collectives on `group`, apart from the step's). With
        `stage_in_background` the copy too is made in a thread (a plain state's: `PendingSave.staged` says when it is
        done; nothing may change the state before)."""
        final = self.directory / f"step_{step:08d}.dcp"
        # Serialized now, by rank 0 which writes it: the progress holds live objects (the stream's reader positions)
        # that training goes on changing before a save in the background is published.
        buffer = io.BytesIO()
        if is_main:
            save_torch(progress, buffer)
        began = time.perf_counter()
        pending = PendingSave(final, self.directory / f".{final.name}.partial", buffer.getvalue(), is_main, began=began)

        def prepare():
            shutil.rmtree(pending.partial, ignore_errors=True)  # left by a crash mid-save
            pending.partial.mkdir(parents=True)

        self._agree(pending, prepare, run=is_main)
        with weights.single_process_quietly():
            if background:
                stager: dict[str, Any] = (
                    {"async_stager": _HostCopy(in_background=stage_in_background)}
                    if _HostCopy.fits(shards) and _TAKES_STAGER
                    else {}
                )
                if not _TAKES_STAGER and _HostCopy.fits(shards):  # torch 2.6-2.7: the copy made here, before it returns
                    shards = _HostCopy._copy(shards)
                write = lambda: dcp.async_save(  # noqa: E731
                    shards, checkpoint_id=str(pending.partial), process_group=group, **stager
                )
                response = self._agree(pending, write, run=True)
                pending.future = getattr(response, "upload_completion", response)
                pending.staged = getattr(response, "staging_completion", None)
                pending.future.add_done_callback(lambda _: setattr(pending, "written_s", time.perf_counter() - began))
                if is_main:  # a failed write gives its space back at once (a full disk fails the logs beside it too)
                    pending.future.add_done_callback(partial(_remove_if_failed, pending.partial))
            else:
                self._agree(pending, lambda: dcp.save(shards, checkpoint_id=str(pending.partial)), run=True)
        return pending

    def finish(self, pending: PendingSave, is_main: bool) -> Path:
        """Collective: wait for this rank's part, then rank 0 adds the progress and renames the folder. A failure on
        any rank raises CheckpointError on every rank, the hidden folder removed; the previous checkpoint stays
        the newest."""
        if pending.future is not None:
            future, pending.future = pending.future, None
            self._agree(pending, future.result, run=True)

        def publish():
            write_durable(pending.partial / weights.PROGRESS, pending.progress)
            if pending.final.exists():
                shutil.rmtree(pending.final)
            os.replace(pending.partial, pending.final)

        self._agree(pending, publish, run=is_main)
        if is_main:
            self._retain()
        return pending.final

    def _agree(self, pending: PendingSave, action, run: bool):
        """Run `action` where `run`; every rank learns of a failure on any (CheckpointError everywhere)."""
        error = result = None
        if run:
            try:
                result = action()
            except CheckpointException as failure:  # DCP's: one (exception, traceback) per failed rank
                rank, (cause, _) = next(iter(failure.failures.items()))
                error = f"rank {rank}: {_reason(cause, self.directory)}"
            except Exception as failure:  # noqa: BLE001 -- reported on every rank below
                error = _reason(failure, self.directory)
        error = next((e for e in all_ranks(error) if e), None)
        if error is not None:
            if pending.is_main:
                shutil.rmtree(pending.partial, ignore_errors=True)
            raise self._failed(pending.final, error)
        return result

    def _failed(self, final: Path, reason: str) -> CheckpointError:
        previous = self.checkpoints()
        kept = f"the previous checkpoint {previous[0].name} is intact" if previous else "no earlier checkpoint"
        return CheckpointError(
            f"could not write checkpoint {final}: {reason}; {kept}. "
            "Free space (or fix the folder) and resume with resume=auto"
        )

    def _retain(self) -> None:
        for old in self.checkpoints()[self.keep :]:
            shutil.rmtree(old) if old.is_dir() else old.unlink()


# torch 2.6 and 2.7's async_save takes no stager (and on 2.6 its writer may read the live tensors: copied first);
# a stager's Future (the copy made in a thread) is awaited by async_save from the release with AsyncSaveResponse on
_TAKES_STAGER = "async_stager" in inspect.signature(dcp.async_save).parameters
_STAGES_BESIDE = _TAKES_STAGER and hasattr(state_dict_saver, "AsyncSaveResponse")


class _HostCopy:
    """DCP's AsyncStager for a state of plain tensors (DDP's): each copied to host memory in one pass — a CUDA
    tensor to the CPU, a CPU tensor cloned — so training may change the originals while the copy is written.
    DCP's default stager copies storage by storage (1.8x the time of these clones for ViT-B/32's state on this
    machine: scripts/bench_checkpoint.py); sharded states (DTensors) keep it. `in_background`: the copy is made in a
    thread of its own and `stage` returns its Future (DCP then writes once it is done), so the loop goes on with the
    next step's forward and backward while it runs."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def __init__(self, in_background: bool = False):
        self.in_background = in_background

    @staticmethod
    def fits(state_dict: dict) -> bool:
        return not any(isinstance(leaf, DTensor) for leaf in tree_leaves(state_dict))

    def stage(self, state_dict: dict) -> dict | Future:
        if not self.in_background:
            return self._copy(state_dict)
        staged: Future = Future()

        def copy() -> None:
            try:
                staged.set_result(self._copy(state_dict))
            except BaseException as error:  # noqa: BLE001 -- the save's failure, raised where it is awaited
                staged.set_exception(error)

        threading.Thread(target=copy, name="clipdist-checkpoint-copy", daemon=True).start()
        return staged

    @staticmethod
    def _copy(state_dict: dict) -> dict:
        return tree_map_only(torch.Tensor, lambda tensor: tensor.detach().to("cpu", copy=True), state_dict)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class PendingSave:
    """A save begun and not yet published: where it goes, its progress, DCP's future while it writes."""

    final: Path
    partial: Path
    progress: bytes  # progress.pt's contents, serialized when the save began (rank 0's; empty elsewhere)
    is_main: bool
    future: Future | None = None
    staged: Future | None = None  # the state's copy made in the background: done before anything may change the state
    began: float = 0.0  # time.perf_counter() when the save began
    held_s: float = 0.0  # how long the save held the loop (the state copied to host memory, or the whole write)
    written_s: float | None = None  # from its start until this rank's part was on disk

    @property
    def written(self) -> bool:
        """This rank's part is on disk (or failed: `finish` says which)."""
        return self.future is None or self.future.done()


def _remove_if_failed(folder: Path, future: Future) -> None:
    """A failed write gives its space back at once (a full disk fails the logs beside it too)."""
    if future.exception() is not None:
        shutil.rmtree(folder, ignore_errors=True)


def _reason(error: BaseException, directory: Path) -> str:
    """The OS-level cause of a failed save in a few words (torch wraps it in a long RuntimeError)."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    # torch's writer reports a short write as "unexpected pos" (a full disk, a quota; in the background the failed
    # write has given its space back by the time it is reported); the disk's free space tells why otherwise.
    if "No space left on device" in str(error) or (directory.exists() and shutil.disk_usage(directory).free < 2**20):
        return "No space left on device"
    if "unexpected pos" in str(error):
        return "No space left on device, or over a quota (the write came up short)"
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _resume_settings(config: dict, rule: str) -> dict:
    """`config`'s values of the keys whose resume rule (config.resume_rule) is `rule`, a key its run's schema did
    not have yet taking today's default."""
    flat = {**_flat(as_dict(TrainConfig(name=""))), **_flat(config)}
    return {key: value for key, value in flat.items() if resume_rule(key) == rule}


class Requests(NamedTuple):
    """What a rank asks of a step's agreement (train.step.StepAgreement): all ranks stop, save or publish together."""

    stop: bool = False  # a stop signal was received
    timer_elapsed: bool = False  # checkpoint_every_minutes passed since the last save
    written: bool = False  # its part of the save in the background is written


def saved_line(path: Path, pending: PendingSave, background: bool) -> str:
    """train.log's line for a published checkpoint: how long it held the loop, and how long its write took."""
    written = pending.written_s if pending.written_s is not None else time.perf_counter() - pending.began
    if not background:
        return f"saved {path.name}: the loop waited {written:.2f} s for the write"
    copied = "beside the next step" if pending.staged is not None else "first"
    return (
        f"saved {path.name}: the loop held {pending.held_s:.2f} s (the state copied to host memory {copied}), "
        f"written in {written:.2f} s in the background"
    )


def updates_in_forward(model: torch.nn.Module) -> bool:
    """The model changes its state in a forward (BatchNorm's running statistics): its copy for a save cannot be
    made beside the next step."""
    return any(
        isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.track_running_stats
        for module in model.modules()
    )


class Checkpointer:
    """Owns checkpointing for a run: when to save (every `checkpoint_every` steps, the last step, every
    `checkpoint_every_minutes`, a stop signal), saving (every rank writes its part), retention and resuming.

    The timer and the signal are per process; `requests()` gives this rank's, the step's one all-reduce
    agrees them over ranks (step.StepAgreement), and `due` decides with the agreed timer."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, env: DistEnv, compile_cache: CompileCache | None = None):
        self.files = CheckpointFiles(run_dir, cfg.keep_checkpoints)
        self.compile_cache = compile_cache if env.is_main else None  # signed after each published save
        self.every = cfg.checkpoint_every
        self.every_s = None if cfg.checkpoint_every_minutes is None else 60 * cfg.checkpoint_every_minutes
        self.last_saved = time.monotonic()
        self.last_step = cfg.optim.max_steps
        self.resume = cfg.resume
        self.on_error = cfg.on_checkpoint_error
        self.config = as_dict(cfg)
        self.env = env
        self.stop = StopSignal()
        self.background = cfg.checkpoint.async_save
        if self.background:  # DCP's background writer warns from its own thread, where no catch_warnings reaches
            warnings.filterwarnings("ignore", message=weights.SINGLE_PROCESS_WARNING)
        self.pending: PendingSave | None = None
        # DCP's collectives of a save in the background run on a group of their own, apart from the step's.
        self.group = torch.distributed.new_group(backend="gloo") if self.background and env.world_size > 1 else None
        remote = cfg.checkpoint.remote
        self.remote = (
            RemoteCopies(remote, cfg.keep_checkpoints, cfg.checkpoint.remote_retries, run_dir=cfg.run_dir)
            if remote and env.is_main
            else None
        )

    @property
    def directory(self) -> Path:
        return self.files.directory

    def requests(self) -> Requests:
        """What this rank asks of the next step's agreement."""
        timer_elapsed = self.every_s is not None and time.monotonic() - self.last_saved >= self.every_s
        return Requests(
            self.stop.received is not None, timer_elapsed, self.pending is not None and self.pending.written
        )

    def due(self, step: int, timer_elapsed: bool) -> bool:
        """Whether the state after `step` is saved: the step interval, the last step, or the (agreed) timer."""
        return step % self.every == 0 or step == self.last_step or timer_elapsed

    def save(self, state: TrainState, wait: bool = False) -> bool:
        """Collective: every rank calls it and writes its part. With checkpoint.async_save the state is copied to
        host memory and written in the background (published by `finish`, once every rank has written), unless
        `wait`. A save still in flight is finished first. Returns whether nothing failed so far.

        A failed write raises CheckpointError on every rank (on_checkpoint_error=stop), or is logged as a warning
        and returns False (warn)."""
        if self.pending is not None and not self.finish():
            return False
        began = time.perf_counter()
        progress = {**state.progress(), "config": self.config}
        beside = self.background and not wait and _STAGES_BESIDE and not updates_in_forward(state.model)
        started = self._guarded(
            lambda: self.files.start(
                state.sharded_state_dict(), progress, state.step, self.env.is_main, self.group, self.background, beside
            )
        )
        self.last_saved = time.monotonic()
        if started is None:
            return False
        started.held_s = time.perf_counter() - began  # the state gathered by name, the progress, the plan, a copy
        self.pending = started
        if started.staged is not None:
            self._hold_until_staged(started, state.optimizer)
        return self.finish() if wait or not self.background else True

    def _hold_until_staged(self, pending: PendingSave, optimizer: torch.optim.Optimizer) -> None:
        """The state is copied beside the next step's forward and backward: its optimizer step, the first thing that
        changes the state (the weight average and a term's centre move after it), waits for the copy, and that wait
        counts as the save's hold on the loop."""

        staged = cast(Future, pending.staged)

        def hold(*_) -> None:
            handle.remove()
            waited = time.perf_counter()
            staged.exception()  # waits for the copy; a failed one is raised by `finish`, as a failed write
            pending.held_s += time.perf_counter() - waited

        handle = optimizer.register_step_pre_hook(hold)

    def finish(self) -> bool:
        """Collective: wait for the save in flight, publish it, copy it off the node; whether it worked."""
        pending, self.pending = self.pending, None
        if pending is None:
            return True
        path = self._guarded(lambda: self.files.finish(pending, self.env.is_main))
        if path is not None and self.env.is_main:
            log.info(saved_line(path, pending, self.background), extra=console.DETAIL)
        if path is not None and self.compile_cache is not None and (unsigned := self.compile_cache.sign()):
            log.warning("%s", unsigned)
        if path is not None and self.remote is not None:
            self.remote.upload(path)
        return path is not None

    def _guarded(self, action):
        """`action`'s result; a CheckpointError (raised on every rank alike) stops the run, or is a warning and
        None (on_checkpoint_error=warn)."""
        try:
            return action()
        except CheckpointError as failure:
            if self.on_error == OnCheckpointError.stop:
                raise
            if self.env.is_main:
                log.warning("%s (on_checkpoint_error=warn: training goes on)", failure)
            return None

    def restore(self, state: TrainState) -> Path | None:
        """Load what `resume` names into `state` (auto: the newest checkpoint); its path, or None (a new run). A
        published checkpoint that cannot be read is refused (unreadable()), never passed over for an older one or
        a fresh start: only never-published `.partial` folders are, and `checkpoints()` does not list them."""
        if self.resume == "never":
            return None
        candidates = self.files.checkpoints() if self.resume == "auto" else [Path(self.resume)]
        for path in candidates[:1]:
            try:
                progress = weights.verify(path)  # every pickled part, and every file its items lie in
            except weights.UnsafeFileError:
                raise  # hostile: refused, never skipped for an older checkpoint
            except (Exception, CheckpointException) as error:  # damaged (DCP's failure is a BaseException)
                if self.resume != "auto":
                    raise
                raise CheckpointError(unreadable(path, candidates[1:], error)) from None
            state.load_progress(progress)  # first: the stream's layout says which readers this rank needs
            if path.is_dir():  # every rank reads its part of each tensor, whatever world size and parallelism wrote
                shards = state.sharded_state_dict_to_load(weights.dcp_sizes(path))
                weights.load_dcp(shards, path)
                _refuse_non_finite(shards, path)
                state.load_sharded_state_dict(shards)
            else:
                _refuse_non_finite({key: progress.get(key) for key in ("model", "optimizer", "ema")}, path)
                state.load_legacy_state_dict(progress)
            return path
        return None

    @staticmethod
    def check_resume(cfg: TrainConfig, world_size: int, found: tuple[Path, dict] | None = None) -> list[str]:
        """Before any rank starts: refuse resume=never over a run with checkpoints, a missing resume file, a
        checkpoint of another model or loss, or one whose files would run code; keys a resume may change with a
        word (config.resume_rule: warn) and a changed global batch are allowed, one returned warning each.
        `found`: resume_point(cfg), where the caller has it already."""
        files = CheckpointFiles(cfg.run_dir)
        if cfg.resume == "never":
            existing = files.checkpoints()
            if existing:
                raise ConfigError(
                    f"{files.directory} already holds {existing[0].name}; resume=never would overwrite "
                    "that run. Use resume=auto to continue it, or name=<new name> for a new run"
                )
            return []
        found = found or Checkpointer.resume_point(cfg)
        return [] if found is None else _compare(found[1], as_dict(cfg), world_size, found[0])

    @staticmethod
    def resume_point(cfg: TrainConfig) -> tuple[Path, dict] | None:
        """The checkpoint a resume would start from and its progress (read safely), or None (a new run)."""
        if cfg.resume == "never":
            return None
        if cfg.resume != "auto" and not weights.is_checkpoint(Path(cfg.resume)):
            raise ConfigError(
                f"resume={cfg.resume!r}: no such checkpoint file or .dcp folder (use auto, never, or a path)"
            )
        candidates = CheckpointFiles(cfg.run_dir).checkpoints() if cfg.resume == "auto" else [Path(cfg.resume)]
        for path in candidates[:1]:
            try:
                return path, weights.verify(path)
            except weights.UnsafeFileError as error:
                raise ConfigError(str(error)) from None
            except (Exception, CheckpointException) as error:  # noqa: BLE001 -- damaged
                if cfg.resume != "auto":
                    raise ConfigError(
                        f"resume={cfg.resume}: cannot be read ({weights.read_failure(error)}); name another "
                        "checkpoint, or resume=auto for the newest one"
                    ) from None
                raise ConfigError(unreadable(path, candidates[1:], error)) from None
        return None

    @staticmethod
    def fetch_remote(cfg: TrainConfig) -> tuple[int, str] | None:
        """resume=auto with checkpoint.remote: a remote checkpoint newer than any local one is downloaded into the
        run directory first (a job requeued onto a fresh node). (logging level, the line to log), or None."""
        if cfg.resume != "auto" or not cfg.checkpoint.remote:
            return None
        files = CheckpointFiles(cfg.run_dir)
        local = files.checkpoints()
        named = weights.CHECKPOINT.search(local[0].name) if local else None
        newest_local = int(named.group(1)) if named else -1
        remote = RemoteCopies(cfg.checkpoint.remote)
        try:
            found = remote.checkpoints()
            if not found or found[0][0] <= newest_local:
                return None
            path = remote.fetch(found[0][1], files.directory)
            logs = remote.fetch_logs(Path(cfg.run_dir))
        except Exception as error:  # noqa: BLE001 -- an unreachable remote: resume from what is here, and say so
            return logging.WARNING, (
                f"checkpoint.remote={cfg.checkpoint.remote} could not be read "
                f"({' '.join(str(error).split())[:200]}); resuming from the local checkpoints"
            )
        with_logs = f" and the run's logs ({', '.join(logs)})" if logs else ""
        return logging.INFO, (
            f"fetched {path.name}{with_logs} from {cfg.checkpoint.remote} (newer than any "
            f"checkpoint in {files.directory})"
        )

    def divergence_advice(self, bad_steps: int, step: int, max_nonfinite_steps: int, lr: float) -> str:
        """What to do after `bad_steps` non-finite losses in a row. Nothing is saved: the weights that gave them
        may be the cause, and no finite loss vouches for the newest state (its weights can already be huge)."""
        newest = self.files.checkpoints()
        stopped = (
            f"{bad_steps} non-finite losses in a row after step {step} (max_nonfinite_steps="
            f"{max_nonfinite_steps}); stopped without saving, since these weights may be the cause"
        )
        lower = f"optim.lr={lr / 10:g}"
        if not newest:
            return f"{stopped}. Start again with a lower learning rate ({lower}), or check the data"
        return (
            f"{stopped}. Go on from the newest checkpoint in a new run with a lower learning rate: python train.py "
            f"name=<new name> resume={newest[0]} {lower} (and your other overrides); if it fails the same way, "
            f"resume from an older one in {self.directory} or start again"
        )

    def close(self) -> None:
        """After the loop, however it ended: a save still in flight is left unpublished (the run did not reach
        `finish`; the newest published checkpoint stands), its writer waited for."""
        self.stop.restore()
        if self.pending is not None:
            if self.pending.future is not None:
                try:
                    self.pending.future.result()
                except Exception:  # noqa: BLE001 -- unpublished either way
                    pass
            if self.env.is_main:
                shutil.rmtree(self.pending.partial, ignore_errors=True)
            self.pending = None
        if self.remote is not None:
            self.remote.close()


def _compare(saved: dict, config: dict, world_size: int, path: Path) -> list[str]:
    before, now = _resume_settings(saved["config"], REFUSE), _resume_settings(config, REFUSE)
    changed = sorted(key for key in set(before) | set(now) if before.get(key) != now.get(key))
    if changed:
        was = ", ".join(f"{key}={before.get(key, '(unset)')}" for key in changed)
        asked = ", ".join(f"{key}={now.get(key, '(unset)')}" for key in changed)
        raise ConfigError(
            f"{path} was trained with {was}, not {asked}: resume it with the same settings, "
            "or start a new run with name=<new name>"
        )
    before, now = _resume_settings(saved["config"], WARN), _resume_settings(config, WARN)
    warned = [
        f"{key} {before.get(key)} -> {now.get(key)}"
        for key in sorted(set(before) | set(now))
        if before.get(key) != now.get(key)
    ]
    if path.suffix == ".pt" and config["world"]["parallel"] == "fsdp":
        raise ConfigError(
            f"{path} is a checkpoint of the .pt days (one file, DDP): resume it with "
            "world.parallel=ddp; its next checkpoint, a .dcp folder, resumes under FSDP too"
        )
    old_batch = saved["world_size"] * saved["config"].get("world", {}).get("batch_per_device", 0)
    new_batch = world_size * config["world"]["batch_per_device"]
    lines = [f"changed since {path.name}: {', '.join(warned)}"] if warned else []
    if old_batch != new_batch:
        lines.append(
            f"resuming {path} (step {saved['step']}) with global batch {new_batch} "
            f"({world_size} rank(s) × {config['world']['batch_per_device']}), it was {old_batch}"
        )
    return lines


def unreadable(path: Path, older: list[Path], error: BaseException) -> str:
    """resume=auto's one line for a published checkpoint it cannot read: nothing is overwritten, and the two ways
    on — an older checkpoint by name, or a new run — are named (a silent fresh start would lose the run)."""
    way = f"resume={older[0]} to go on from the newest older one, or " if older else ""
    return (
        f"resume=auto: the run's newest checkpoint {path} cannot be read ({weights.read_failure(error)}); nothing was "
        f"overwritten. Use {way}name=<new name> (with resume=never) to start a new run"
    )


def _refuse_non_finite(tensors: dict, path: Path) -> None:
    """Collective: a NaN or Inf in what a resume loads (the model, its average, a decoder, the optimizer's moments)
    is damage, said on every rank alike (each checks its own shards)."""
    bad = [found for found in all_ranks(weights.first_non_finite(tensors)) if found]
    if bad:
        raise ConfigError(
            f"{path} is damaged: its {printable(bad[0])[:80]} holds NaN or Inf; resume=<an older checkpoint> goes on "
            "from one before it"
        )
