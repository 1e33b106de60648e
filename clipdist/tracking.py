"""Weights & Biases (offline by default), TensorBoard (logging.tensorboard=true), <run_dir>/train_log.jsonl
and <run_dir>/metrics.jsonl."""

from __future__ import annotations

import json
import netrc
import os
import uuid
from pathlib import Path
from typing import Literal, cast
from urllib.parse import urlparse

from clipdist.checkpoint.run_dir import jsonl_rows
from clipdist.distributed.network import unreachable
from clipdist.errors import RunDirError
from clipdist.files import UnboundedFileError, append_own, read_own, write_atomic

DEFAULT_WANDB_URL = "https://api.wandb.ai"
REACH_TIMEOUT_S = 10


def check_wandb_online(environ=None) -> None:
    """Before any rank starts, for logging.wandb=online: an API key (WANDB_API_KEY, or `wandb login`'s
    ~/.netrc entry) and a W&B server this machine can reach within REACH_TIMEOUT_S — else a ValueError in one
    line that says how to log offline. wandb itself would prompt for a key on a terminal (forever, under SLURM)
    or retry an unreachable server for minutes."""
    env = os.environ if environ is None else environ
    url = env.get("WANDB_BASE_URL", DEFAULT_WANDB_URL)
    host = urlparse(url).hostname or url
    offline = (
        "log offline with logging.wandb=offline and upload later with `wandb sync runs/<name>/wandb/offline-run-*`, "
        "or turn W&B off with logging.wandb=disabled"
    )
    if not env.get("WANDB_API_KEY") and not _netrc_key(host, env):
        raise ValueError(f"logging.wandb=online but no W&B API key is set (WANDB_API_KEY, or `wandb login`): {offline}")
    reason = unreachable(url, REACH_TIMEOUT_S)
    if reason:
        raise ValueError(f"logging.wandb=online but {url} cannot be reached from here ({reason}): {offline}")


def _netrc_key(host: str, env) -> bool:
    try:
        return netrc.netrc(env.get("NETRC") or None).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check_tensorboard() -> None:
    """Before any rank starts, for logging.tensorboard=true: torch writes event files through the
    tensorboard package, which clipdist does not require."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ValueError(
            "logging.tensorboard=true needs the tensorboard package: pip install tensorboard "
            "(or clipdist[tensorboard]), or leave logging.tensorboard=false"
        ) from None


WANDB_FILE_BYTES = 2 << 30  # a W&B run file read back for the steps it recorded (a long run: ~100s of MB)


def wandb_records(path: Path):
    """The records of a local W&B run file (`run-<id>.wandb`, offline or online), as wandb's protobuf Records:
    LevelDB's log format (32 KiB blocks of [crc32 u32, length u16, kind u8] + data; kinds full, first, middle,
    last) after a 7-byte ':W&B' header. Read up to the first torn record: a killed run's file ends anywhere."""
    from wandb.proto import wandb_internal_pb2

    try:
        data = read_own(path, WANDB_FILE_BYTES)
    except UnboundedFileError:  # a link, or larger than any run's: not W&B's own file; its steps are not known
        return
    if data[:4] != b":W&B":
        return
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        room = block - position % block
        if room < 7:  # too little of the block left for a header: the writer padded it
            position += room
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        chunk = data[position + 7 : position + 7 + length]
        if kind == 0 or len(chunk) < length:
            return
        position += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated protobuf
            record.ParseFromString(pending)
            yield record


def wandb_steps(run_dir: Path, run_id: str) -> set[int]:
    """The history steps W&B recorded locally for run `run_id`, over every segment (one per start of the run)."""
    steps: set[int] = set()
    for path in (Path(run_dir) / "wandb").glob(f"*run-*-{run_id}/run-{run_id}.wandb"):
        steps.update(record.history.step.num for record in wandb_records(path) if record.HasField("history"))
    return steps


def logs_step(step: int, every: int, last: int, epoch_steps: int | None = None) -> bool:
    """Whether step `step` (1-based) is logged: the first, every `every`-th after it, and the last (steps 1, 4, 7, 8
    for every 3 of 8). With `epoch_steps`, counted within each epoch of that many steps, its last step logged too —
    open_clip_train's --log-every-n-steps (1, 4, 5, 8 for every 3 of two 4-step epochs)."""
    if epoch_steps is not None:
        within = (step - 1) % epoch_steps
        return within % every == 0 or within == epoch_steps - 1 or step == last
    return (step - 1) % every == 0 or step == last


class RunTracker:
    """Logs on the main rank only; every other rank gets a tracker that does nothing.

    TensorBoard's event files go to <run_dir>/tensorboard/ (`tensorboard --logdir runs/`); a resumed run
    starts a new file that hides the old file's steps after `start_step`, as the JSONL logs are rewound.

    W&B: a resumed run continues the same W&B run (its id in <run_dir>/wandb_id), in a new segment. A run killed
    with -9 loses what W&B had not written yet (often everything: a 7-byte file), while train_log.jsonl and
    metrics.jsonl keep every step; so the new segment first logs, from the JSONL, the steps after the last one
    W&B recorded, and from then on only steps after it. W&B's steps must grow within a run: this keeps every
    step once, in order."""

    def __init__(
        self,
        run_dir: Path,
        mode: str,
        project: str,
        name: str,
        config: dict,
        enabled: bool,
        tensorboard: bool = False,
        start_step: int = 0,
        notes: str | None = None,
    ):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.run = self.board = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(
                str(self.run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None
            )
        if enabled and mode != "disabled":
            import wandb

            id_file = Path(run_dir) / "wandb_id"  # same W&B run when the job resumes
            run_id = read_own(id_file, 4096).decode().strip() if id_file.exists() else uuid.uuid4().hex[:12]
            write_atomic(id_file, run_id)
            recorded = wandb_steps(run_dir, run_id)
            self.run = wandb.init(
                mode=cast(Literal["online", "offline", "disabled"], str(mode)),
                project=project,
                name=name,
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                config=config,
                notes=notes,
                settings=wandb.Settings(silent=True, console="off", init_timeout=120),
            )
            self.wandb_after = max(recorded, default=0)  # W&B has every step up to this one
            self._fill_wandb(start_step)

    def log_train(self, stats: dict, step: int) -> None:
        """Training stats: a line in train_log.jsonl, and train/<key> in W&B."""
        self._write("train_log.jsonl", "train", stats, step)

    def log_eval(self, metrics: dict, step: int) -> None:
        """One JSON object per evaluation in metrics.jsonl, and eval/<key> in W&B."""
        self._write("metrics.jsonl", "eval", metrics, step)

    def _fill_wandb(self, start_step: int) -> None:
        """Log to W&B, from the JSONL logs, the steps up to `start_step` it has not recorded."""
        rows: dict[int, dict] = {}
        for filename, section in (("train_log.jsonl", "train"), ("metrics.jsonl", "eval")):
            for row in jsonl_rows(self.run_dir / filename)[0]:
                step = row.pop("step")
                if self.wandb_after < step <= start_step:
                    rows.setdefault(step, {}).update({f"{section}/{key}": value for key, value in row.items()})
        for step in sorted(rows):
            assert self.run is not None  # called once W&B has started
            self.run.log(rows[step], step=step)
        self.wandb_after = max(self.wandb_after, start_step)

    def _write(self, filename: str, section: str, values: dict, step: int) -> None:
        if not self.enabled:
            return
        try:
            with append_own(self.run_dir / filename) as handle:
                handle.write(json.dumps({"step": step, **values}) + "\n")
        except OSError as error:  # a full disk (a checkpoint written beside it, say): one line, not a traceback
            raise RunDirError(
                f"could not write {self.run_dir / filename}: {error.strerror or error}; free space (or "
                "fix the folder) and resume with resume=auto"
            ) from None
        if self.run is not None and step > self.wandb_after:  # a re-run step W&B recorded before the kill: once
            self.run.log({f"{section}/{key}": value for key, value in values.items()}, step=step)
        if self.board is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.board.add_scalar(f"{section}/{key}", value, step)
            self.board.flush()

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
        if self.board is not None:
            self.board.close()
            self.board = None


class StepProfiler:
    """torch.profiler over `steps` training steps after `wait` (0 steps: off, nothing recorded).

    Writes <run_dir>/profile/rank<r>.trace.json (chrome://tracing, Perfetto) and rank<r>.txt, the
    operators by self CPU (and CUDA) time, for every rank: the slow rank is the one to look at.
    """

    def __init__(self, run_dir: Path, rank: int, steps: int, wait: int):
        self.profiler = None
        if steps > 0:
            import torch
            from torch.profiler import ProfilerActivity, profile, schedule

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.directory, self.rank = Path(run_dir) / "profile", rank
            self.profiler = profile(
                activities=activities,
                record_shapes=True,
                on_trace_ready=self._write,
                schedule=schedule(wait=max(0, wait - 1), warmup=1, active=steps, repeat=1),
            )
            self.profiler.start()

    def _write(self, profiler) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.directory / f"rank{self.rank}.trace.json"))
        sort_by = (
            "self_cuda_time_total" if profiler.activities and len(profiler.activities) > 1 else "self_cpu_time_total"
        )
        write_atomic(
            self.directory / f"rank{self.rank}.txt", profiler.key_averages().table(sort_by=sort_by, row_limit=40)
        )

    def step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
