"""A rank's loader processes: a torch DataLoader over the stream's dataset (data.stream.TrainingBatches), its workers
started (at idle priority where asked) and stopped with what they started, and the items they give assembled into
batches.

This is the one place that knows the DataLoader's private parts (its worker list, its SIGCHLD registration): the
stream (data.stream.TrainStream) keeps the order, the position and the state, and asks for the next batch.
"""

from __future__ import annotations

import functools
import signal
import sys
import traceback
from collections.abc import Mapping
from typing import Any

import torch

from clipdist.data.batch import Batch, apply, apply_pair
from clipdist.data.faults import DataError, DataFailure
from clipdist.data.workers import set_low_priority
from clipdist.distributed.launch import STOP_SIGNALS, kill_tree, share_temp_dir
from clipdist.model.factory import image_size
from clipdist.model.timm_towers import naflex_patch_size

READ_AHEAD_BATCHES = 2  # batches each worker has in flight: 2 whole ones, or 2·W items of a W·pieces-th of one


def held_samples(local_batch: int, workers: int, pieces: int) -> float:
    """Samples a rank's loader holds in host memory at once: the batch it hands over, and what its workers read ahead
    (READ_AHEAD_BATCHES each, in `pieces` of a batch: data.pieces)."""
    return local_batch * (1 + READ_AHEAD_BATCHES * workers / pieces)


def sample_bytes(model: torch.nn.Module, context: int, seq_len: int | None = None) -> int:
    """A sample's bytes as the loader hands it over: uint8 pixels (3·H·W) and int64 tokens (8·context); a NaFlex
    tower's `seq_len` patches as float32 (normalized by the loader), with int64 coordinates and a bool mask."""
    if seq_len is not None:
        return seq_len * (4 * 3 * naflex_patch_size(model) ** 2 + 2 * 8 + 1) + 8 * context
    height, width = image_size(model)
    return 3 * height * width + 8 * context


class Loader:
    """The DataLoader over `dataset` on `workers` processes (0: in the rank itself), as an iterator of its items."""

    def __init__(
        self,
        dataset,
        workers: int,
        *,
        pin_memory: bool,
        items_ahead: int = 2,
        low_priority: bool = False,
        start_method: str | None = None,
        seed: int = 0,
    ):
        if workers:
            share_temp_dir()
        self.loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=None,
            num_workers=workers,
            persistent_workers=workers > 0,
            prefetch_factor=items_ahead if workers else None,  # items in flight per worker
            pin_memory=pin_memory,  # where a batch is several items, they are copied into a pinned batch instead
            worker_init_fn=functools.partial(start_worker, low_priority=low_priority) if workers else None,
            multiprocessing_context=start_method if workers else None,
            # its own generator for the workers' base seed: the rank's RNG (dropout masks) is not drawn from, so a
            # loader started after a resume leaves the restored RNG as it was (samples are seeded by key instead)
            generator=torch.Generator().manual_seed(seed),
        )
        self.items = iter(self.loader)

    def __next__(self):
        return next(self.items)

    def worker_pids(self) -> list[int]:
        return [worker.pid for worker in getattr(self.items, "_workers", [])]

    def close(self) -> None:
        """Stop the workers now. They ignore SIGTERM (start_worker), so the DataLoader's own shutdown could not end
        one blocked on a full queue at exit: they are killed — nothing they hold is needed once the trainer stops —
        with what they started (`pipe:` commands)."""
        items = self.items
        workers = getattr(items, "_workers", [])
        if workers and getattr(items, "_worker_pids_set", False):
            # Unregister them first, or the DataLoader's SIGCHLD handler reports the kill as a worker crash.
            torch.utils.data._utils.signal_handling._remove_worker_pids(id(items))
            setattr(items, "_worker_pids_set", False)  # noqa: B010 -- a private attribute torch does not type
        for worker in workers:
            if worker.is_alive():
                kill_tree(worker.pid)
        shutdown = getattr(items, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def assemble(items, count: int, pin_memory: bool, rank: int = 0) -> tuple[Batch, dict[int, dict]]:
    """The next batch from `count` items of `items` (each a worker's rows of it: images — a tensor, or a NaFlex
    mapping of them —, tokens, and what was read), and the positions its readers reach once it is consumed. Items
    are copied into the batch's host buffer (pinned where `pin_memory`) as they arrive; a batch that is one item is
    used as it is."""
    images: Any = None
    tokens: Any = None
    counts = keys = None
    pending = {}
    for _ in range(count):
        item = next(items)
        if isinstance(item, DataFailure):
            raise DataError(f"rank {rank}: {item.message}")
        piece_images, piece_tokens, info = item
        pending.update({reader: position.state for reader, position in info["readers"].items()})
        piece_counts = [*info["skipped"], *info["sources"]]
        counts = piece_counts if counts is None else [total + part for total, part in zip(counts, piece_counts)]
        rows = info["rows"]
        keys = keys or [""] * info["batch_rows"]
        for row, key in zip(rows, info["keys"]):
            keys[row] = key
        if count == 1:  # the whole batch in one item
            images, tokens = _in_row_order(piece_images, piece_tokens, rows, pin_memory)
        elif rows:
            if images is None:  # the batch's host buffer, filled item by item as they arrive
                images = apply(
                    piece_images,
                    lambda piece: torch.empty(
                        (info["batch_rows"], *piece.shape[1:]),
                        dtype=piece.dtype,
                        pin_memory=pin_memory,
                    ),
                )
                tokens = torch.empty((info["batch_rows"], *piece_tokens.shape[1:]), dtype=piece_tokens.dtype)
            consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
            at = slice(rows[0], rows[0] + len(rows)) if consecutive else torch.tensor(rows)
            # a reader's rows are consecutive, unless the readers take turns within them
            images = widened(images, piece_images, pin_memory)
            apply_pair(images, piece_images, functools.partial(_put, at=at))
            tokens[at] = piece_tokens
        del piece_images
    return Batch.of(images, tokens, counts, sample_keys=keys), pending


def _put(buffer: torch.Tensor, piece: torch.Tensor, at) -> None:
    """A piece's rows into the batch's buffer at `at`; a ragged piece's (widened) in its first columns."""
    if buffer.shape[1:] == piece.shape[1:]:
        buffer[at] = piece
    else:
        buffer[at, : piece.shape[1]] = piece


def widened(buffer, piece, pin_memory: bool):
    """The batch's host buffer, its ragged rows (an encoded batch's bytes: data/device_decode.py, (rows, bytes)) made
    as wide as `piece`'s where they are narrower, zero-padded; any other input as it is."""
    if isinstance(buffer, Mapping):
        return {name: widened(value, piece[name], pin_memory) for name, value in buffer.items()}
    if buffer.dim() != 2 or buffer.dtype != torch.uint8 or buffer.shape[1] >= piece.shape[1]:
        return buffer
    wider = torch.zeros((buffer.shape[0], piece.shape[1]), dtype=buffer.dtype, pin_memory=pin_memory)
    wider[:, : buffer.shape[1]] = buffer
    return wider


def _in_row_order(images, tokens: torch.Tensor, rows: list[int], pin: bool):
    """An item that is the whole batch, its samples put in row order (they are, unless readers take turns
    within the rank's rows more than once a batch)."""
    if rows == list(range(len(rows))):
        return images, tokens
    order = torch.argsort(torch.tensor(rows))
    return apply(images, lambda tensor: tensor[order].pin_memory() if pin else tensor[order]), tokens[order]


def start_worker(_worker_id: int = 0, low_priority: bool = False) -> None:
    """DataLoader worker_init_fn. SIGTERM/SIGINT/SIGUSR1 sent to the whole process group (SLURM,
    `timeout`, Ctrl-C) are for the trainer, which checkpoints and then shuts the workers down.
    `low_priority`: SCHED_IDLE (see data.workers.loader_priority; nice 19 where there is none).

    A stop signal can also interrupt the trainer while it receives a batch's tensors (their file
    descriptors come through multiprocessing's resource sharer): the worker's sharer thread then
    sees the connection reset and would print a traceback for a batch nobody wants any more."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if low_priority:
        set_low_priority(0)
    sys.excepthook = _quiet_on_abandoned_transfer(sys.excepthook)


def _quiet_on_abandoned_transfer(excepthook):
    def hook(kind, value, trace):
        if issubclass(kind, (ConnectionError, EOFError)) and any(
            "resource_sharer" in frame.filename for frame in traceback.extract_tb(trace)
        ):
            return
        excepthook(kind, value, trace)

    return hook
