"""This rank's training stream: endless batches, the counts a run logs, and the position that lets a
resumed run continue sample for sample.

    TrainStream        what the trainer holds: next / consumed / state_dict / load_state_dict / close
    TrainingBatches    the IterableDataset behind it: each DataLoader worker slot plays one reader
    start_worker       DataLoader worker_init_fn (stop signals ignored, idle priority on request)
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import random

import torch
import webdataset as wds

from clipdist.data.batch import Batch, rows_consumed
from clipdist.data.epochs import RowDeal, epoch_sizes
from clipdist.data.faults import DataError, DataFailure, ShardHealth, SkipCounter
from clipdist.data.images import CaptionTokens, ImageBatcher
from clipdist.data.loader import READ_AHEAD_BATCHES, Loader, assemble
from clipdist.data.naflex import TokenBudget, resolve_budget
from clipdist.data.order import BudgetOrder, SampleOrder
from clipdist.data.reader import Reader, ShardList, ShardSequence, shard_samples
from clipdist.data.samples import SampleKeys, training_pair, undecodable
from clipdist.files import is_remote

RESHUFFLE_SEED_STRIDE = 7919  # a prime: a stream restarted at sample n is seeded seed + stride · n
# what the sample order is made of
ORDER = ("resampled", "seed", "shuffle_buffer", "weights", "shards", "budget", "epochs")


READER_KEY = "reader_{:08d}"  # a reader's position among a checkpoint's tensors (the DCP folder's data.<key>.*)


def pack_position(position: dict) -> dict[str, torch.Tensor]:
    """A reader's position ({"reader": Reader.state_dict(), "taken": its samples in the order}) as int64 tensors:
    counts = [entry, taken, received, taken in the order, the RNG's version], rng = the Mersenne Twister's 625
    words, buffer = the shuffle buffer's (entry, sample) references, in buffer order. ~13 kB at a buffer of 1,000
    (as pickled lists, which weights_only reads ~50× slower: 8,192 readers took minutes)."""
    reader = position["reader"]
    version, internal, gauss = reader["rng"]
    if gauss is not None:  # Reader draws with randrange alone, which never leaves a spare gauss
        raise ValueError("a reader's RNG holds a spare gauss value: not a state Reader makes")
    return {
        "counts": torch.tensor(
            [reader["entry"], reader["taken"], reader["received"], position["taken"], version], dtype=torch.int64
        ),
        "rng": torch.tensor(internal, dtype=torch.int64),
        "buffer": torch.tensor(reader["buffer"], dtype=torch.int64).reshape(-1, 2),
    }


def unpack_position(packed: dict[str, torch.Tensor]) -> dict:
    """pack_position undone."""
    entry, taken, received, order_taken, version = packed["counts"].tolist()
    return {
        "reader": {
            "entry": entry,
            "taken": taken,
            "received": received,
            "rng": (version, tuple(packed["rng"].tolist()), None),
            "buffer": [tuple(pair) for pair in packed["buffer"].tolist()],
        },
        "taken": order_taken,
    }


def check_shard_count(shards: int, readers: int, *, resampled: bool, sized: bool = False) -> None:
    """Epoch mode deals each pass's shards over the run's readers: where the shards' sizes are unknown (whole
    shards dealt), each reader needs at least one (a ValueError otherwise)."""
    if not resampled and not sized and shards < readers:
        raise ValueError(
            f"{shards} shard(s) for {readers} reader(s) (the run's layout, or data.readers): every reader needs at "
            "least one shard where the shards' sizes are unknown (remote shards without a _stats.json beside them). "
            "Use more shards, fewer data.workers or data.readers, or data.resampled=true"
        )


def check_caption_keys(urls: list[str], keys: SampleKeys, samples: int = 8) -> None:
    """Before any rank starts: the first `samples` samples of the leading local shards (files or parts, read on
    into the next shard where one ends sooner) hold one caption at data.caption_keys at least — else a ValueError
    naming the keys and what the samples have (a key that matches nothing would fail only once the run had
    started). Remote shards (`pipe:`, URLs) are not read here, nor any shard after the first remote one."""
    local = list(itertools.takewhile(lambda url: not is_remote(url), urls))
    first, found, read = None, 0, []
    try:
        for url in local:
            read.append(url)
            for sample in itertools.islice(shard_samples(url, wds.reraise_exception), samples - found):
                found += 1
                try:
                    keys.caption(sample)
                    return
                except ValueError as error:
                    first = first or error
            if found >= samples:
                break
    except Exception:  # noqa: BLE001 -- an unreadable shard is the shard checks' to report, not this one's
        return
    if first is not None:
        reason = str(first).split(": ", 1)[-1] if ": " in str(first) else str(first)
        where = read[0] if len(read) == 1 else f"{len(read)} shards from {read[0]}"
        raise ValueError(
            f"data.caption_keys={list(keys.caption_keys)}: none of the first {found} samples of {where} has a "
            f"caption there ({reason}); name a key they have, e.g. data.caption_keys=[txt] or [json:caption]"
        )


def run_readers(
    readers_per_rank: int, world_size: int, split: str, setting: int | None = None, batch_size: int | None = None
) -> int:
    """V, the readers of a run that starts now: `setting` (data.readers), else world size × the rank's readers,
    at most one per row of its batch (split=replicated: the rank's readers, as one process reads them)."""
    if setting is not None:
        if split != "replicated" and setting % world_size:
            raise ValueError(
                f"data.readers={setting} is not a multiple of the world size {world_size}: every rank "
                "reads its own readers only where they divide evenly; use a multiple"
            )
        return setting
    per_rank = max(min(readers_per_rank, batch_size or readers_per_rank), 1)
    return per_rank * (1 if split == "replicated" else world_size)


def kept_readers(saved_layout: dict | None, setting: int | None) -> int | None:
    """The readers a resume keeps from a checkpoint's stream layout: its own, unless the checkpoint predates the
    global order or data.readers (`setting`) asks for others; None: the run's order starts anew."""
    if saved_layout and "cycle" in saved_layout and setting in (None, saved_layout["readers"]):
        return saved_layout["readers"]
    return None


class TrainStream:
    """This rank's rows of the run's endless global batches of `data` (a DataConfig: split, resampled,
    weights, shuffle_buffer, workers, pieces, readers, max_skips_in_a_row) and everything a checkpoint needs
    to continue them on any number of ranks.

    The global sample order (order.py) is the run's V readers taking turns in cycles of Λ samples: fixed
    when the run starts (`layout`: a run's from its global batch alone, order.run_layout, or data.readers with
    Λ = G; without one, V = world size × `readers`, the rank's readers, and Λ = (V/N) × the global batch) and kept
    by every resume, so it depends on the data and seed alone. split=node: rank r reads the
    readers its rows need (its own V/N where N divides V). split=replicated: every rank reads every reader
    and keeps its rows (N× the decoding; for checks, not for scale).

    `next(stream)` gives a Batch; `consumed(counts)` says the step used it (trained on it or skipped it
    as non-finite), with the counts summed over ranks: only then does its position count as read.
    `state_dict` / `load_state_dict` follow the StatefulDataLoader protocol, each rank's for the readers it reads
    (a checkpoint keeps their positions as tensors: `reader_tensors`); `load_state_dict` comes before the first
    `next`, which starts the DataLoader. A source that gives nothing usable raises DataError instead of
    spinning. `pixels`: images come as uint8 (B, H, W, C), for the rank to normalize on its device
    (images.PixelNormalize); `pin_memory`: batches are put in pinned memory for an asynchronous copy.

    `budget` (a NaFlex tower: data/naflex.TokenBudget): global batch k holds G_k samples at sequence length L_k
    (`image_transform` is then a naflex.PatchImages), every batch one cycle of the order (order.BudgetOrder); rank
    r holds rows ⌊rG_k/N⌋ … ⌊(r+1)G_k/N⌋. The batches consumed so far (`batches`) say which k comes next.
    `sizes`: the shards' sizes as preflight found them (data.epochs.epoch_sizes), so no rank counts them again.

    The loader's workers (data.workers, any count) each run some of the rank's readers. Where the layout lets them (a
    fresh run's cycle is (V/N)·G for this, and data.pieces is 1), each worker makes whole batches in turn, which the
    rank uses as they come; otherwise each gives its readers' rows of every batch as `data.pieces` items, copied
    into the batch's host buffer (pinned where `pin_memory`) as they arrive (data.loader, which owns the DataLoader
    and its processes): host memory is the batch plus the items read ahead, which with data.pieces lets a batch
    larger than the device (gradient caching) be held at all. None of this changes a sample of the stream.
    """

    def __init__(
        self,
        sources: list[list[str]],
        data,
        *,
        batch_size: int,
        image_transform,
        tokenizer,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        low_priority_workers: bool = False,
        pixels: bool = False,
        pin_memory: bool = False,
        start_method: str | None = None,
        readers: int | None = None,
        workers: int | None = None,
        budget: TokenBudget | None = None,
        sizes: tuple[list[int] | None, str] | None = None,
        layout: tuple[int, int] | None = None,
    ):
        split = str(data.split)
        if split not in ("node", "replicated"):
            raise ValueError(f"data.split={split!r}; choose node or replicated")
        self.replicated = split == "replicated"
        self.pieces = int(getattr(data, "pieces", 1) or 1)
        self.budget = budget
        check_pieces(self.pieces, batch_size, budget is not None)
        configured = batch_size * world_size  # the global batch the run's layout was made for (order.run_layout)
        if budget is not None:  # the rows every rank has at the longest sequence length
            batch_size = min(budget.sizes()) // world_size
        self.readers_setting = getattr(data, "readers", None)
        self.workers = data.workers if workers is None else workers  # the loader plan's (data.workers: automatic)
        self.sources, self.data, self.rank, self.world_size, self.seed = sources, data, rank, world_size, seed
        self.batch_size, self.image_transform, self.tokenizer = batch_size, image_transform, tokenizer
        self.low_priority_workers, self.start_method = low_priority_workers, start_method
        self.pixels, self.pin_memory = pixels, pin_memory
        self.layout = self._first_layout(layout, readers, configured)
        total = self.layout["readers"]
        # epoch mode with every shard's size known: each epoch is a permutation of the rows (data/epochs.py); found
        # here where the caller did not find them once already (preflight: Shards.sizes)
        self.sizes, self.sizes_how = sizes or epoch_sizes([url for urls in sources for url in urls], data.resampled)
        self.layout["epochs"] = "rows" if self.sizes is not None else "shards"
        self.order = self._order(total, self.layout["cycle"])
        self.skipped_samples, self.skipped_shards, self.source_samples = 0, 0, [0] * len(sources)
        self.readers: dict[int, dict] = {}  # reader -> its position after the samples consumed (those this rank read)
        self.position = 0  # samples of the global order consumed: where global batch 0 of this start begins
        self.batches = 0  # global batches consumed since the run began (a token budget's next batch index)
        self.restart_reason: str | None = None  # set by load_state_dict when the stream cannot continue exactly
        self.continued = False  # set by load_state_dict when it continues sample for sample
        self._loader = None
        self._worker_readers: list[list[int]] | None = None  # whole batches per worker: each one's readers
        self._pending: dict[int, dict] = {}  # the readers' positions after the batch handed out

    def _first_layout(self, layout: tuple[int, int] | None, readers: int | None, configured: int) -> dict:
        """The layout a fresh stream starts with: the run's own `layout` (preflight: order.run_layout of the
        `configured` global batch, or data.readers), the m readers of a slot sharing data.shuffle_buffer (a token
        budget's too: its V readers are no more than the fixed-size layout's, each a share of every batch); without
        one, `readers` a rank — a cycle of (V/N)·G, each worker whole batches, or the global batch with data.readers."""
        batch = self.batch_size * self.world_size
        if layout is not None:
            total, cycle = layout
            if self.budget is not None:
                total = max(1, min(total, min(self.budget.sizes())))
            per_cycle = max(1, cycle // configured)
            return {**self._layout(total, cycle), "buffer": -(-int(self.data.shuffle_buffer) // per_cycle)}
        per_rank = readers or max(self.workers or 0, 1)
        split = "replicated" if self.replicated else "node"
        total = run_readers(per_rank, self.world_size, split, self.readers_setting, self.batch_size)
        whole = self.budget is None and not self.replicated and self.readers_setting is None
        return self._layout(total, batch * (total // self.world_size if whole else 1))

    def _layout(self, readers: int, cycle: int) -> dict:
        """What fixes the sample order: saved with the position, compared on resume."""
        return {
            "resampled": self.data.resampled,
            "seed": self.seed,
            "shuffle_buffer": self.data.shuffle_buffer,
            "weights": list(self.data.weights) if self.data.weights else None,
            "shards": hashlib.sha1("\n::\n".join("\n".join(urls) for urls in self.sources).encode()).hexdigest(),
            "readers": readers,
            "cycle": cycle,
            "budget": self.budget.layout() if self.budget is not None else None,
        }

    def _order(self, readers: int, cycle: int):
        return SampleOrder(readers, cycle) if self.budget is None else BudgetOrder(readers, self.budget)

    @property
    def global_batch(self) -> int:
        """The next global batch's samples."""
        return self.batch_size * self.world_size if self.budget is None else self.budget.size(self.batches)

    @functools.cached_property
    def rank_readers(self) -> list[int]:
        """The readers this rank reads (order.SampleOrder.rank_readers: the same from every batch's start)."""
        if self.replicated:
            return list(range(self.order.readers))
        if self.budget is not None:
            return self.order.rank_readers(self.rank, self.world_size)
        return self.order.rank_readers(self.position, self.global_batch, self.rank, self.world_size)

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self._loader is None:
            self._loader = self._start()
        batch, self._pending = assemble(self._loader, self._items, self.pin_memory, self.rank)
        return batch

    @property
    def _items(self) -> int:
        """Items per batch: `pieces` from each worker (or from the rank itself); one where a worker makes it whole."""
        return 1 if self._worker_readers is not None else self._workers_now * self.pieces

    @property
    def _workers_now(self) -> int:
        """The worker processes the loader runs: data.workers, at most one per reader of this rank."""
        return max(min(self.workers or 0, len(self.rank_readers)), 1)

    @property
    def _processes(self) -> int:
        """The DataLoader's num_workers: `_workers_now`, or 0 where the rank reads in its own process."""
        return self._workers_now if self.workers else 0

    def consumed(self, counts: list[int] | None = None) -> None:
        """The batch last handed out was used by the step: its readers' positions are now the saved ones, and
        `counts` (Batch.counts summed over ranks; this rank's own where None) are added to the totals."""
        self.readers.update(self._pending)
        self._pending = {}
        self.position += self.global_batch if counts is None else rows_consumed(counts)
        self.batches += 1
        if counts is not None:
            self.skipped_samples += counts[0]
            self.skipped_shards += counts[1]
            self.source_samples = [total + count for total, count in zip(self.source_samples, counts[2:])]

    def state_dict(self) -> dict:
        """The layout, the position in the global order, the totals, and the positions of the readers this rank
        reads (a rank sharing a reader holds the same position as the other). In a checkpoint the readers go
        apart (`reader_tensors`, into the DCP folder: each rank writes its own, one copy of each is kept) and the
        rest into progress.pt, so neither grows with the world: see `load_reader_tensors`."""
        return {
            "layout": self.layout,
            "seed": self.seed,
            "position": self.position,
            "batches": self.batches,
            "readers": dict(sorted(self.readers.items())),
            "skipped_samples": self.skipped_samples,
            "skipped_shards": self.skipped_shards,
            "source_samples": list(self.source_samples),
        }

    def reader_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """This rank's readers' positions as tensors (pack_position), keyed reader_XXXXXXXX."""
        return {READER_KEY.format(index): pack_position(state) for index, state in sorted(self.readers.items())}

    def reader_keys(self) -> list[str]:
        """The reader_tensors keys this rank needs from a checkpoint after `load_state_dict` (those of its readers
        that it did not get there; none where the stream restarted)."""
        if not self.continued:
            return []
        return [READER_KEY.format(index) for index in self.rank_readers if index not in self.readers]

    def load_reader_tensors(self, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        """The positions of this rank's readers, as `reader_tensors` gave them on the ranks that saved them."""
        mine = set(self.rank_readers)
        for key, packed in tensors.items():
            index = int(key.removeprefix("reader_"))
            if index in mine:
                self.readers[index] = unpack_position(packed)

    def load_state_dict(self, saved: dict | None) -> None:
        """Continue from `saved`: sample for sample wherever the data and the seed are unchanged — on any world
        size, global batch, worker count or data.pieces (the saved readers and cycle are kept); otherwise
        (another shard list, seed, shuffle buffer, an explicit data.readers that differs, ...) reshuffled from a
        seed of its own, with `restart_reason` saying why. The totals carry on either way."""
        if self._loader is not None:
            raise RuntimeError("TrainStream.load_state_dict must come before the first batch")
        saved = saved or {}
        self._keep_budget((saved.get("layout") or {}).get("budget"))
        self.skipped_samples, self.skipped_shards = saved.get("skipped_samples", 0), saved.get("skipped_shards", 0)
        totals = saved.get("source_samples") or []
        self.source_samples = list(totals) if len(totals) == len(self.sources) else [0] * len(self.sources)
        reason = self._why_not_exact(saved.get("layout"))
        if reason is None:
            kept = {key: saved["layout"][key] for key in ("readers", "cycle")}
            self.layout = {**self.layout, **kept, "buffer": saved["layout"].get("buffer", self.data.shuffle_buffer)}
            self.position, self.batches = saved["position"], saved.get("batches", 0)
            self._from_batch(saved["layout"].get("origin", 0))
            self.__dict__.pop("rank_readers", None)
            mine = set(self.rank_readers)  # only these: another rank's copy of a reader would go stale here
            self.readers = {index: state for index, state in saved.get("readers", {}).items() if index in mine}
            self.seed = saved["seed"]  # the layout's, or the one a restart drew
            self.continued = True
            return
        done = saved.get("position", max((rank["batches"] for rank in saved.get("ranks", [])), default=0))
        if self.budget is not None:  # the new order starts at the next batch; its lengths go on being that batch's
            self.batches = saved.get("batches", 0)
            self._from_batch(self.batches)
        same_seed = (saved.get("layout") or {}).get("seed") == self.layout["seed"]
        self.seed = (saved.get("seed", self.seed) if same_seed else self.seed) + RESHUFFLE_SEED_STRIDE * done
        self.restart_reason = reason

    def switch_at(self, k: int) -> str | None:
        """A line for the log where batch k begins a stage of data.resolution_schedule (None elsewhere)."""
        if self.budget is not None:
            return self.budget.switch_at(k)
        switch_at = getattr(self.image_transform, "switch_at", None)
        return switch_at(k) if switch_at is not None else None

    def _from_batch(self, origin: int) -> None:
        """The order (a token budget's: positions counted from batch `origin`) at the layout's readers and cycle."""
        if self.budget is not None:
            self.budget = self.budget.from_batch(origin)
            self.layout = {**self.layout, "origin": origin}
        self.order = self._order(self.layout["readers"], self.layout["cycle"])

    def _keep_budget(self, saved: dict | None) -> None:
        """A resume keeps the checkpoint's token budget where data.max_tokens_per_batch does not name one (its
        default, the global batch at the longest length, changes with the world size: the batches would not)."""
        if self.budget is None or saved is None or self.data.max_tokens_per_batch is not None:
            return
        self.budget = resolve_budget(self.data, self.budget.stages[0][1], 0, self.budget.seed, saved["max_tokens"])
        self.batch_size = min(self.budget.sizes()) // self.world_size
        self.layout = {**self.layout, "budget": self.budget.layout()}  # the order follows in _from_batch

    def _why_not_exact(self, saved: dict | None) -> str | None:
        """Why a stream at the saved layout cannot go on sample for sample here (None: it can)."""
        if saved is None:
            return "the checkpoint holds no data position"
        if "cycle" not in saved:
            return "its data position is an earlier clipdist's, per rank"
        changed = [key for key in ORDER if saved.get(key) != self.layout[key]]
        if changed:
            return "changed since the checkpoint: " + ", ".join(self._change(key, saved.get(key)) for key in changed)
        if kept_readers(saved, self.readers_setting) is None:
            return f"changed since the checkpoint: data.readers {saved['readers']} -> {self.readers_setting}"
        return None

    def _change(self, key: str, saved) -> str:
        """One changed part of the order, said for the log."""
        if key == "shards":
            return "the shard list"
        if key == "epochs":
            dealt = {"rows": "every row once", "shards": "whole shards", None: "whole shards"}
            why = f" ({self.sizes_how})" if self.sizes is None else " (the shards' sizes are known now)"
            return f"epochs {dealt.get(saved, saved)} -> {dealt[self.layout['epochs']]}{why}"
        return f"{key} {saved} -> {self.layout[key]}"

    def _start(self):
        """The DataLoader, its readers placed where the consumed batches left them (nothing is consumed yet:
        that is the restored position, or the start)."""
        check_shard_count(
            sum(map(len, self.sources)), self.order.readers, resampled=self.data.resampled, sized=self.sizes is not None
        )
        workers = self._processes
        self._worker_readers = self.worker_readers(workers)
        dataset = TrainingBatches(
            self.sources,
            self.image_transform,
            self.tokenizer,
            data=self.data,
            order=self.order,
            start=self.position,
            batch=self.global_batch,
            rank=self.rank,
            world_size=self.world_size,
            seed=self.seed,
            resume=dict(self.readers),
            readers=self.rank_readers,
            pieces=self.pieces,
            pixels=self.pixels,
            first_batch=self.batches,
            worker_readers=self._worker_readers,
            sizes=self.sizes,
            buffer=self.layout.get("buffer", self.data.shuffle_buffer),
        )
        whole = self._items == 1
        # in flight per worker: two whole batches, or 2·W items of a W·pieces-th of a batch (2/pieces batches)
        return Loader(
            dataset,
            workers,
            pin_memory=self.pin_memory and whole,
            items_ahead=READ_AHEAD_BATCHES if whole else READ_AHEAD_BATCHES * workers,
            low_priority=self.low_priority_workers,
            start_method=self.start_method,
            seed=self.seed,
        )

    def worker_readers(self, workers: int) -> list[list[int]] | None:
        """Each of `workers` loader workers' readers where each can make whole batches (order.worker_readers);
        None where every batch is assembled from every worker's rows."""
        if workers < 2 or self._shared_by_setting() is not None:
            return None
        return self.order.worker_readers(self.position, self.global_batch, self.rank, self.world_size, workers)

    def _shared_by_setting(self) -> str | None:
        """The setting that has every worker give its rows of every batch, whatever the order (None: the order says)."""
        return (
            "data.pieces"
            if self.pieces != 1
            else "a token budget"
            if self.budget is not None
            else "data.split=replicated"
            if self.replicated
            else None
        )

    def epochs(self) -> str | None:
        """What an epoch is here, for the log (None: resampled, no epochs)."""
        if self.data.resampled:
            return None
        if self.sizes is not None:
            return f"an epoch is every one of the {sum(self.sizes)} rows once ({self.sizes_how})"
        return (
            f"an epoch is every shard once, not exactly every row: {self.sizes_how}, so whole shards are dealt and a "
            "reader holding fewer rows starts its next pass early (write <shard>_stats.json files, as img2dataset "
            "and `clipdist make-shards` do, for exact epochs)"
        )

    def assembly(self) -> str | None:
        """How the loader's workers make this rank's batches, for the log (None with one worker or none)."""
        workers = self._processes
        if workers < 2:
            return None
        if self.worker_readers(workers) is not None:
            return (
                f"the {workers} loader workers make whole batches in turn (batch k: worker k mod {workers}), each "
                "from readers of its own"
            )
        why = self._shared_by_setting() or (
            f"the order's cycle of {self.order.cycle} samples at a global batch of "
            f"{self.global_batch} gives no worker readers of its own"
        )
        return f"each batch is assembled from the rows of all {workers} loader workers ({why})"

    def close(self) -> None:
        """Stop the loader's workers now (data.loader.Loader.close)."""
        loader, self._loader = self._loader, None
        if loader is not None:
            loader.close()

    def worker_pids(self) -> list[int]:
        return [] if self._loader is None else self._loader.worker_pids()


def check_pieces(pieces: int, batch_size: int, budget: bool = False) -> None:
    if budget and pieces != 1:
        raise ValueError(
            f"data.pieces={pieces} with a token budget (data.max_tokens_per_batch): a batch's rows change "
            "with its sequence length; leave data.pieces=1"
        )
    if pieces < 1 or batch_size % pieces:
        raise ValueError(
            f"data.pieces={pieces} does not divide world.batch_per_device={batch_size}: "
            "use a divisor of the rank's batch (1: the loader reads whole batches)"
        )


class Position:
    """A reader's state, opaque to the DataLoader (its default_convert would walk every list in it)."""

    __slots__ = ("state",)

    def __init__(self, state: dict):
        self.state = state


class TrainingBatches(torch.utils.data.IterableDataset):
    """This rank's rows of every global batch from stream position `start` on (order.py), read by the
    rank's `readers`. In a DataLoader with W workers, loader item t is worker t mod W's (the rank itself runs
    every reader where there are no workers). With `worker_readers` (order.worker_readers) worker w makes the
    whole of every batch k ≡ w (mod W) from its own readers: one item a batch. Otherwise worker w runs
    readers[w::W] and gives, for every batch, `pieces` items of the rows its readers hold. Either way the
    batch is the same rows.

    Every reader is advanced to the end of each global batch. Its samples that are not this rank's rows
    (a reader shared with another rank) are read and decoded too — a bad one is skipped by every rank that
    reads it, so all agree on which samples the order holds — and dropped. A skip is counted by the rank
    whose row takes the skipped sample's place. Augmentation is seeded per sample (seed, reader, shard
    entry, sample number).

    `first_batch`: the run's index of batch 0 here. With a token budget (`order` a BudgetOrder) batch k is the
    order's cycle first_batch + k, and its images go through `image_transform.batcher(L_k)`; under a fixed-size
    tower's resolution schedule (`image_transform` a transforms.ScheduledSizes), through its batcher_at(k).

    item: (images, tokens, info), info = {"rows": the rows of the rank's batch it fills, "batch_rows": the rows of
    the rank's batch, "readers": {reader:
    Position after the batch} (on a worker's last piece of a batch), "skipped": (samples, shards) skipped,
    "sources": samples per source in it}.
    """

    def __init__(
        self,
        sources: list[list[str]],
        image_transform,
        tokenizer,
        *,
        data,
        order: SampleOrder,
        start: int,
        batch: int,
        rank: int,
        world_size: int,
        seed: int,
        resume: dict,
        readers: list[int],
        pieces: int = 1,
        pixels: bool = False,
        first_batch: int = 0,
        worker_readers: list[list[int]] | None = None,
        sizes: list[int] | None = None,
        buffer: int | None = None,
    ):
        super().__init__()
        self.sizes = sizes
        self.buffer = data.shuffle_buffer if buffer is None else buffer  # a reader's shuffle buffer
        self.sources, self.image_transform, self.tokenizer, self.data = sources, image_transform, tokenizer, data
        self.order, self.start, self.batch, self.first_batch = order, start, batch, first_batch
        self.rank, self.world_size, self.seed, self.resume, self.readers = rank, world_size, seed, resume, readers
        self.pieces, self.pixels, self.worker_readers = pieces, pixels, worker_readers
        self.encoded = str(getattr(data, "decode_on", "host")) == "device"  # device_decode: bytes and boxes
        probs = None if data.caption_probs is None else tuple(data.caption_probs)
        self.keys = SampleKeys(tuple(data.caption_keys), probs, tuple(data.image_keys), seed)

    @functools.cached_property
    def shard_list(self) -> ShardList:
        """The shards and each pass's shuffled order, once per process (each loader worker makes its own)."""
        return ShardList(self.sources)

    @functools.cached_property
    def deal(self) -> RowDeal | None:
        """Each reader's rows of each epoch, where the shards' sizes are known (once per process)."""
        if self.sizes is None or self.data.resampled:
            return None
        return RowDeal(self.sizes, self.seed, self.order, self.shard_list.permutation)

    def reader(self, index: int) -> _ReaderRun:
        """Reader `index` of the run where the consumed batches left it."""
        skips, health = SkipCounter(self.data.max_skips_in_a_row), ShardHealth()
        sequence = ShardSequence(
            self.shard_list, self.data.weights, self.seed, index, self.order.readers, self.data.resampled, self.deal
        )
        reader = Reader(sequence, self.buffer, f"{self.seed}-shuffle-{index}", skips, health, name=f"reader {index}")
        taken, saved = self.order.taken_before(index, self.start), self.resume.get(index)
        if saved is not None:
            reader.load_state_dict(saved["reader"])
            if saved["taken"] != taken:
                raise DataError(
                    f"reader {index}'s saved position ({saved['taken']} samples) is not where the order "
                    f"puts it at sample {self.start} ({taken}): the checkpoint's data position is damaged"
                )
        elif taken:
            raise DataError(f"the checkpoint's data position has no reader {index}, which sample {self.start} needs")
        return _ReaderRun(reader, iter(reader), skips, taken)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        whole = self.worker_readers is not None and info is not None
        mine = self.worker_readers[worker] if whole else self.readers[worker::workers]
        runs = {index: self.reader(index) for index in mine}
        fixed = None if self._per_batch else ImageBatcher(self.image_transform, encoded=self.encoded)
        tokenize = CaptionTokens(self.tokenizer)
        try:
            for k in itertools.count(worker if whole else 0, workers if whole else 1):
                yield from self._batch(k, runs, fixed or self._batcher(k), tokenize)
        except DataError as error:
            yield DataFailure(str(error))
        finally:
            for run in runs.values():
                run.samples.close()

    def span(self, k: int) -> tuple[int, int]:
        """(stream position, samples) of global batch k."""
        if not isinstance(self.order, BudgetOrder):
            return self.start + k * self.batch, self.batch
        return self.order.span(self.first_batch + k)

    @property
    def _per_batch(self) -> bool:
        """Whether batches differ in their image transform (a token budget's lengths, a schedule's sizes)."""
        return isinstance(self.order, BudgetOrder) or hasattr(self.image_transform, "batcher_at")

    def _batcher(self, k: int):
        """Batch k's image transform: its sequence length's (naflex.PatchBatcher), or its scheduled size's."""
        if isinstance(self.order, BudgetOrder):
            return self.image_transform.batcher(self.order.budget.seq_len(self.first_batch + k))
        return self.image_transform.batcher_at(self.first_batch + k)

    def _batch(self, k: int, runs: dict[int, _ReaderRun], batcher, tokenize: CaptionTokens):
        """This worker's `pieces` items of global batch k: its readers advanced to the batch's end."""
        start, size = self.span(k)
        end = start + size
        low = start + self.rank * size // self.world_size
        high = start + (self.rank + 1) * size // self.world_size
        share = sum(self.order.taken_before(index, high) - self.order.taken_before(index, low) for index in runs)
        cuts = [share * piece // self.pieces for piece in range(self.pieces + 1)]
        kept: list[tuple[int, object, str, int, str]] = []
        skipped, piece = [0, 0], 0

        def item(last: bool):
            nonlocal kept, skipped
            rows = [row for row, *_ in kept]  # a list, not a tensor: one shared-memory handle fewer per item
            counts = torch.bincount(
                torch.tensor([source for *_, source, _ in kept], dtype=torch.long), minlength=len(self.sources)
            ).tolist()
            images = batcher.stack([image for _, image, *_ in kept], pixels=self.pixels) if kept else batcher.empty()
            tokens = tokenize([caption for _, _, caption, *_ in kept]) if kept else torch.empty(0, dtype=torch.long)
            positions = (
                {
                    index: Position({"reader": run.reader.state_dict(), "taken": run.taken})
                    for index, run in runs.items()
                }
                if last
                else {}
            )
            info = {
                "rows": rows,
                "batch_rows": high - low,
                "keys": [key for *_, key in kept],
                "readers": positions,
                "skipped": tuple(skipped),
                "sources": counts,
            }
            kept, skipped = [], [0, 0]
            return images, tokens, info

        for index, run in runs.items():
            while (position := self.order.position(index, run.taken)) < end:
                image, caption, source, key, fresh = self._next(run, index, batcher)
                run.taken += 1
                if not low <= position < high:
                    continue
                skipped = [total + count for total, count in zip(skipped, fresh)]
                kept.append((position - low, image, caption, source, key))
                while piece < self.pieces - 1 and len(kept) == cuts[piece + 1] - cuts[piece]:
                    yield item(last=False)
                    piece += 1
        while piece < self.pieces - 1:  # pieces left empty (a worker with fewer rows than pieces)
            yield item(last=False)
            piece += 1
        yield item(last=True)

    def _next(self, run: _ReaderRun, index: int, batcher: ImageBatcher):
        """Reader `index`'s next usable sample: (image, caption, source, "shard#key", (samples, shards) skipped
        before it)."""
        for sample in run.samples:
            try:
                image, caption = training_pair(sample, self.keys)
            except DataError:
                raise
            except Exception as exn:  # noqa: BLE001 -- a bad sample: counted and skipped by the handler
                run.skips(exn)
                continue
            try:  # decoded here, at the size its crop needs
                image = self._augment(batcher, image, (self.seed, index, sample["__entry__"], sample["__index__"]))
            except Exception as exn:  # noqa: BLE001 -- as above, named by shard and key
                run.skips(undecodable(sample, exn))
                continue
            run.skips.ok()
            return image, caption, sample["__source__"], f"{sample['__url__']}#{sample['__key__']}", run.skips.take()
        raise DataError(f"reader {index} ended")  # readers are endless: a shard sequence never ends

    @staticmethod
    def _augment(images: ImageBatcher, image, key: tuple[int, ...]):
        """The image's per-image transform steps with torch's CPU generator and Python's `random` (timm's
        augmentations draw from it) seeded from `key`, then put back as they were. Not torch.manual_seed: it
        also queues a CUDA seeding with a stack trace, ~0.6 ms a call."""
        generator, seed = torch.default_generator, hash(key) & 0xFFFF_FFFF_FFFF_FFFF
        saved, saved_random = generator.get_state(), random.getstate()
        generator.manual_seed(seed)
        random.seed(seed)
        try:
            return images(image)
        finally:
            generator.set_state(saved)
            random.setstate(saved_random)


class _ReaderRun:
    """A reader being read: its samples, its skip counter, and how many usable samples it has given."""

    __slots__ = ("reader", "samples", "skips", "taken")

    def __init__(self, reader: Reader, samples, skips: SkipCounter, taken: int):
        self.reader, self.samples, self.skips, self.taken = reader, samples, skips, taken
