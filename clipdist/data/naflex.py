"""NaFlex batches: every global batch one sequence length, as many samples as a token budget allows at it, each
image at its own aspect ratio cut into patches.

Global batch k draws its sequence length L_k from data.seq_lens with data.seq_len_probs — a function of (seed, k)
alone (splitmix64 of both: nothing to carry in a checkpoint, the same on every rank and after any resume) — and holds

    G_k = ⌊T / L_k⌋ samples,   T = data.max_tokens_per_batch, image patches per *global* batch.

T is per global batch, not per rank, so that the batches (which samples, at which length) depend on the data and
the seed alone: a run resumed on another number of ranks goes on sample for sample, and the loss is the global
batch's whatever the world. Rank r of N holds rows ⌊rG/N⌋ … ⌊(r+1)G/N⌋ of it — unequal by at most one, which every
loss handles exactly — so a rank's share is about T/N patches.

Each image is resized, keeping its aspect ratio, to the largest grid of P-px patches with h·w ≤ L_k (timm's
get_image_size_for_seq), cut into h·w patches (P·P·3 values, channels last: timm's layout), and padded to L_k
with invalid patches (NaFlexVit masks them out of attention and pooling).
"""

from __future__ import annotations

import copy
import functools
import math

import numpy as np
import torch
from PIL import Image
from timm.data.naflex_transforms import get_image_size_for_seq

from clipdist.data.samples import EncodedImage, load_rgb
from clipdist.data.schedule import resolution_stages

_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def splitmix64(values: np.ndarray) -> np.ndarray:
    """Vigna's splitmix64 finaliser of uint64 `values`: a counter-based generator, each output a function of its
    input alone (what lets batch k's draw be made without the draws before it)."""
    with np.errstate(over="ignore"):
        z = values.astype(np.uint64) + _MIX[0]
        z = (z ^ (z >> np.uint64(30))) * _MIX[1]
        z = (z ^ (z >> np.uint64(27))) * _MIX[2]
        return z ^ (z >> np.uint64(31))


def _lengths(lengths, where: str) -> list[int]:
    if not lengths or min(lengths) < 1:
        raise ValueError(f"{where}={list(lengths or [])}: give one or more sequence lengths of at least 1 patch")
    return [int(length) for length in lengths]


def _cumulative(given: list[float], count: int) -> np.ndarray:
    weights = np.asarray(given, dtype=np.float64)
    if len(weights) != count or weights.min() < 0 or weights.sum() <= 0:
        raise ValueError(
            f"data.seq_len_probs={weights.tolist()}: one weight of 0 or more per data.seq_lens entry "
            f"({count}), not all 0"
        )
    cumulative = np.cumsum(weights / weights.sum())
    cumulative[-1] = 1.0
    return cumulative


class TokenBudget:
    """Which sequence length and how many samples each global batch k has (the module docstring). `schedule`
    (data.resolution_schedule): {global batches before it: sequence lengths} — once that many batches are trained
    its lengths are drawn (equal weights) instead of data.seq_lens' (with data.seq_len_probs); 0 replaces them."""

    def __init__(
        self,
        seq_lens: list[int],
        probs: list[float] | None,
        max_tokens: int,
        seed: int,
        schedule: dict[int, list[int]] | None = None,
    ):
        first = _lengths(seq_lens, "data.seq_lens")
        self.stages = [(0, first, _cumulative(probs if probs is not None else [1.0] * len(first), len(first)))]
        for step, lengths in resolution_stages(schedule):
            lengths = _lengths(lengths, f"data.resolution_schedule.{step}")
            self.stages = [stage for stage in self.stages if stage[0] != step]
            self.stages.append((step, lengths, _cumulative([1.0] * len(lengths), len(lengths))))
        self.seq_lens = sorted({length for _, lengths, _ in self.stages for length in lengths})  # every length drawn
        self.final = self.stages[-1][1]  # the last stage's lengths (evaluation is at their longest)
        if max_tokens < max(self.seq_lens):
            raise ValueError(
                f"data.max_tokens_per_batch={max_tokens} holds no image of {max(self.seq_lens)} patches: "
                "raise it (it counts a global batch's patches)"
            )
        self.max_tokens, self.seed = int(max_tokens), int(seed)
        self.origin = 0  # the batch whose first sample is stream position 0 (from_batch)
        self._sizes = np.zeros(0, dtype=np.int64)  # G_k of the batches drawn so far
        self._starts = np.zeros(1, dtype=np.int64)  # P_k = Σ_{i<k} G_i

    def layout(self) -> dict:
        """What the sample order is made of (a checkpoint's data layout): changing any of it restarts the order."""
        stages = [
            {
                "from": first,
                "seq_lens": lengths,
                "seq_len_probs": [round(float(p), 12) for p in np.diff(cumulative, prepend=0.0)],
            }
            for first, lengths, cumulative in self.stages
        ]
        return {"stages": stages, "max_tokens": self.max_tokens}

    def seq_lens_of(self, batches: np.ndarray) -> np.ndarray:
        """L_k for each batch index k: a draw from (seed, k) alone, among the lengths of k's stage."""
        key = np.uint64(self.seed & 0xFFFF_FFFF) << np.uint64(32)
        draws = (splitmix64(key ^ batches.astype(np.uint64)) >> np.uint64(11)).astype(np.float64) / 2.0**53
        stage_of = np.searchsorted([first for first, _, _ in self.stages], batches, side="right") - 1
        lengths = np.zeros(len(batches), dtype=np.int64)
        for index, (_, choices, cumulative) in enumerate(self.stages):
            mine = stage_of == index
            choice = np.minimum(np.searchsorted(cumulative, draws[mine], side="right"), len(choices) - 1)
            lengths[mine] = np.asarray(choices, dtype=np.int64)[choice]
        return lengths

    def switch_at(self, k: int) -> str | None:
        """A line for the log where batch k begins a stage of the schedule (None elsewhere)."""
        for first, lengths, _ in self.stages[1:]:
            if first == k:
                return f"sequence lengths now {lengths} (data.resolution_schedule.{first})"
        return None

    def seq_len(self, k: int) -> int:
        return int(self.seq_lens_of(np.array([k]))[0])

    def size(self, k: int) -> int:
        """G_k, the samples of global batch k."""
        return self.max_tokens // self.seq_len(k)

    def sizes(self) -> list[int]:
        """Every size a batch can have (one per sequence length)."""
        return sorted({self.max_tokens // length for length in self.seq_lens})

    def from_batch(self, origin: int) -> TokenBudget:
        """The same budget with its stream positions counted from batch `origin` (a data order restarted there,
        reshuffled: its sample 0 is batch `origin`'s first, while the lengths go on being batch k's)."""
        budget = copy.copy(self)
        budget.origin = int(origin)
        budget._sizes, budget._starts = np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
        return budget

    def start(self, k: int) -> int:
        """P_k, the stream position global batch k starts at (Σ G_i over origin ≤ i < k)."""
        self._extend(k)
        return int(self._starts[k - self.origin])

    def batch_at(self, position: int) -> int:
        """The batch k with P_k ≤ position < P_{k+1}."""
        while self._starts[-1] <= position:
            self._extend(self.origin + 2 * len(self._sizes) + 1024)
        return self.origin + int(np.searchsorted(self._starts, position, side="right")) - 1

    def sizes_before(self, k: int) -> np.ndarray:
        """G_origin … G_{k-1}."""
        self._extend(k)
        return self._sizes[: k - self.origin]

    def _extend(self, k: int) -> None:
        """Draw the sizes of batches up to k (in blocks: a million batches take ~0.1 s)."""
        if k - self.origin < len(self._sizes):
            return
        first = self.origin + len(self._sizes)
        indices = np.arange(first, max(k + 1, self.origin + 2 * len(self._sizes)), dtype=np.int64)
        more = self.max_tokens // self.seq_lens_of(indices)
        self._sizes = np.concatenate([self._sizes, more])
        self._starts = np.concatenate([self._starts, self._starts[-1] + np.cumsum(more)])


def default_seq_lens(image_size: tuple[int, int], patch_size: int) -> list[int]:
    """A NaFlex run's sequence length where data.seq_lens is not given: the patches of the tower's image size."""
    return [math.ceil(image_size[0] / patch_size) * math.ceil(image_size[1] / patch_size)]


class PatchImages:
    """A NaFlex tower's image transform: decode, resize keeping the aspect ratio to at most `seq_len` patches of
    `patch_size` px, cut into patches. `batcher(seq_len)` gives the per-length transform the loader runs
    (cached: one per length a run draws). Training does not augment: the image is resized, whole. `square`
    (data.naflex_square_crop): every image center-cropped square at ⌊√L⌋ × ⌊√L⌋ patches instead — a fixed-size
    pipeline through the same tower (at L = 196 and 16 px: 224 × 224)."""

    def __init__(
        self,
        patch_size: int,
        mean,
        std,
        interpolation: str = "bicubic",
        seq_lens: list[int] | None = None,
        square: bool = False,
    ):
        self.patch_size, self.mean, self.std, self.square = int(patch_size), tuple(mean), tuple(std), bool(square)
        self.seq_lens = list(seq_lens or [])  # the run's sequence lengths (data.seq_lens, resolved)
        resampling = Image.Resampling
        self.resample = {"bicubic": resampling.BICUBIC, "bilinear": resampling.BILINEAR}.get(
            str(interpolation), resampling.BICUBIC
        )

    @functools.cache  # noqa: B019
    def batcher(self, seq_len: int) -> PatchBatcher:
        return PatchBatcher(self, seq_len)


class PatchBatcher:
    """One sequence length's transform (`__call__`: one image → uint8 pixels at its grid) and collate (`stack`: a
    batch of them → the tower's input mapping, normalized and padded to seq_len)."""

    def __init__(self, images: PatchImages, seq_len: int):
        self.images, self.seq_len = images, int(seq_len)
        self.mean = torch.tensor(images.mean, dtype=torch.float32)
        self.std = torch.tensor(images.std, dtype=torch.float32)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(h, w) patches of an image of height × width at this length: the aspect ratio kept, h·w ≤ seq_len."""
        size = self.images.patch_size
        _, (target_h, target_w) = get_image_size_for_seq((height, width), size, self.seq_len)
        return target_h // size, target_w // size

    def __call__(self, image: EncodedImage | Image.Image) -> torch.Tensor:
        """uint8 (h·P, w·P, 3) pixels of the image at its grid (decoded no larger than it needs: load_rgb)."""
        opened = image.opened if isinstance(image, EncodedImage) else image
        size = self.images.patch_size
        if self.images.square:
            side = math.isqrt(self.seq_len) * size
            decoded, _ = load_rgb(image, (side, side))
            width, height = decoded.size
            crop = min(width, height)
            box = ((width - crop) / 2, (height - crop) / 2, (width + crop) / 2, (height + crop) / 2)
            resized = decoded.resize((side, side), self.images.resample, box=box)
            return torch.from_numpy(np.array(resized, dtype=np.uint8, copy=True))
        rows, columns = self.grid(opened.size[1], opened.size[0])
        target = (columns * size, rows * size)
        decoded, _ = load_rgb(image, target)
        resized = decoded.resize(target, self.images.resample)
        return torch.from_numpy(np.array(resized, dtype=np.uint8, copy=True))

    def empty(self) -> dict[str, torch.Tensor]:
        """The images of an item with no rows."""
        return self.stack([])

    def one(self, image: EncodedImage | Image.Image) -> dict[str, torch.Tensor]:
        """One image's input rows (no batch dimension): evaluation's per-image transform."""
        return {name: value[0] for name, value in self.stack([self(image)]).items()}

    def stack(self, images: list[torch.Tensor], pixels: bool = False) -> dict[str, torch.Tensor]:
        """{"patches": (B, seq_len, P·P·3) float32 normalized, "patch_coord": (B, seq_len, 2), "patch_valid":
        (B, seq_len)} of __call__'s pixels; padding rows are zeros, invalid, at coordinate (0, 0)."""
        size, rows = self.images.patch_size, len(images)
        patches = torch.zeros(rows, self.seq_len, size * size * 3, dtype=torch.float32)
        coord = torch.zeros(rows, self.seq_len, 2, dtype=torch.long)
        valid = torch.zeros(rows, self.seq_len, dtype=torch.bool)
        for row, image in enumerate(images):
            height, width = image.shape[0] // size, image.shape[1] // size
            count = height * width
            cut = image.view(height, size, width, size, 3).permute(0, 2, 1, 3, 4).reshape(count, size * size, 3)
            patches[row, :count] = ((cut.float() / 255 - self.mean) / self.std).reshape(count, -1)
            coord[row, :count] = torch.stack(
                torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij"), -1
            ).reshape(count, 2)
            valid[row, :count] = True
        return {"patches": patches, "patch_coord": coord, "patch_valid": valid}


def resolve_seq_lens(data, image_size: tuple[int, int], patch_size: int) -> list[int]:
    """data.seq_lens, or the tower's image_size grid; data.patch_size, where given, must be the tower's."""
    if data.patch_size is not None and data.patch_size != patch_size:
        raise ValueError(
            f"data.patch_size={data.patch_size}: the image tower's patch embedding takes {patch_size}-px "
            f"patches only; leave data.patch_size unset (or {patch_size})"
        )
    return [int(length) for length in data.seq_lens] if data.seq_lens else default_seq_lens(image_size, patch_size)


def resolve_budget(
    data, seq_lens: list[int], global_batch: int, seed: int, max_tokens: int | None = None
) -> TokenBudget:
    """The run's TokenBudget: `max_tokens` (a checkpoint's), else data.max_tokens_per_batch, else the configured
    global batch at the longest length (of any stage of data.resolution_schedule)."""
    schedule = dict(getattr(data, "resolution_schedule", None) or {})
    tokens = max_tokens or data.max_tokens_per_batch or global_batch * longest_seq_len(data, seq_lens)
    return TokenBudget(seq_lens, data.seq_len_probs, tokens, seed, schedule)


def longest_seq_len(data, seq_lens: list[int]) -> int:
    """The most patches an image of the run may become: the longest of `seq_lens` and of every stage of
    data.resolution_schedule."""
    schedule = dict(getattr(data, "resolution_schedule", None) or {})
    return max([*seq_lens, *(length for lengths in schedule.values() for length in lengths)])


def eval_seq_len(data, seq_lens: list[int]) -> int:
    """Evaluation's sequence length: the longest of the last stage (data.resolution_schedule, else data.seq_lens)."""
    stages = resolution_stages(getattr(data, "resolution_schedule", None))
    return max(stages[-1][1] if stages else seq_lens)
