"""`clipdist bench loss`: memory and time of every loss backend, open_clip's local loss beside them.

For each world size one launch of N ranks (gloo on CPU, NCCL on CUDA) runs, for every global
batch and backend, the loss forward + backward on random unit features (d = 128 by default):
  kept     bytes kept for backward on rank 0 (SavedTensorMeter; the input features not counted)
  peak     CUDA: max_memory_allocated above the inputs; CPU: growth of the process's resident
           memory, sampled every millisecond (short spikes can be missed)
  time     median over repeats of the slowest rank's forward + backward
Configurations whose predicted memory (the fits `clipdist plan` uses; open_clip's peer is
taken as `disco`'s, which keeps the same b×B blocks) exceeds --budget for all ranks of this
machine together are recorded as skipped, with the prediction.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from open_clip.loss import ClipLoss

from clipdist.defaults import COLLECTIVE_TIMEOUT_S
from clipdist.distributed.launch import launch_local
from clipdist.files import is_json, read_bounded, write_atomic
from clipdist.losses import BACKENDS, build
from clipdist.tools.memory import fit_loss_memory, human_bytes, loss_inputs, loss_kept_bytes

PEER = "open_clip"  # open_clip's ClipLoss(local_loss=True, gather_with_grad=True)


class _OpenClipLocalLoss:
    uses_logit_bias = False

    def __init__(self):
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.loss = ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world_size)

    def __call__(self, image_features, text_features, logit_scale):
        return self.loss(image_features, text_features, logit_scale)


def _loss(name: str):
    return _OpenClipLocalLoss() if name == PEER else build(name)


class _ResidentPeak:
    """Peak growth of this process's resident memory while the block runs (1 ms sampling)."""

    def __enter__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.peak = self._resident()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _resident(self) -> int:
        return int(read_bounded("/proc/self/statm", 4096).split()[1]) * self.page

    def _sample(self):
        while self._running:
            self.peak = max(self.peak, self._resident())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, self._resident())
        self.growth = self.peak - self.start


def _one_step(loss_fn, local_batch: int, dim: int, device: torch.device) -> None:
    loss_fn(*loss_inputs(loss_fn, local_batch, dim, device=device)).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(loss_fn, local_batch, dim, device) -> float:
    dist.barrier()
    start = time.perf_counter()
    _one_step(loss_fn, local_batch, dim, device)
    return time.perf_counter() - start


def _peak(loss_fn, local_batch, dim, device) -> int:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _one_step(loss_fn, local_batch, dim, device)
        inputs = 2 * local_batch * dim * 4
        return torch.cuda.max_memory_allocated(device) - base - inputs
    with _ResidentPeak() as resident:
        _one_step(loss_fn, local_batch, dim, device)
    return resident.growth


def _bench_rank(names, global_batches, dim, repeats, skip_over):
    """Worker: rows on rank 0. `skip_over[(name, B)]` says why a configuration is skipped."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    for global_batch in global_batches:
        local_batch = global_batch // world_size
        for name in names:
            row = {
                "backend": name,
                "world_size": world_size,
                "global_batch": global_batch,
                "dim": dim,
                "device": device.type,
            }
            if (name, global_batch) in skip_over:
                rows.append({**row, "skipped": skip_over[(name, global_batch)]})
                continue
            loss_fn = _loss(name)
            _one_step(loss_fn, local_batch, dim, device)  # warm-up
            kept = loss_kept_bytes(loss_fn, local_batch, dim, device=device)
            peak = _peak(loss_fn, local_batch, dim, device)
            times = [_timed(loss_fn, local_batch, dim, device) for _ in range(repeats)]
            per_rank = [None] * world_size
            dist.all_gather_object(per_rank, (times, peak))
            slowest = [max(rank_times[i] for rank_times, _ in per_rank) for i in range(repeats)]
            rows.append(
                {
                    **row,
                    "kept_bytes": kept,
                    "peak_bytes": max(p for _, p in per_rank),
                    "seconds": statistics.median(slowest),
                }
            )
            if rank == 0:
                print(
                    f"  {name:>12}  N={world_size}  B={global_batch:>6}  kept {human_bytes(kept, 1):>9}  "
                    f"{statistics.median(slowest) * 1e3:8.1f} ms",
                    flush=True,
                )
    return rows if rank == 0 else None


def backends(names=None) -> list[str]:
    """The benchmarked names (default: every backend and open_clip's), checked before any rank starts."""
    names = list(names or [*BACKENDS, PEER])
    for name in names:
        if name != PEER:
            try:
                build(name)  # an unknown name fails here, not in N workers
            except ValueError as error:
                raise ValueError(f"{error}, or {PEER} (open_clip's local loss)") from None
    return names


def loss_fits(names) -> dict:
    """The exact memory fits (clipdist.tools.memory) of these backends and `disco` (open_clip's stand-in)."""
    return fit_loss_memory(sorted(n for n in {*names, "disco"} if n != PEER))


def run(
    names=None,
    world_sizes=(1, 2, 4),
    global_batches=(1024, 4096, 16384, 65536),
    dim=128,
    repeats=3,
    budget_bytes=16e9,
    timeout_s=COLLECTIVE_TIMEOUT_S,
    fits=None,
):
    """Every (world size, global batch, backend) row; see the module docstring."""
    names = backends(names)
    # Large CPU buffers through mmap, so that freed memory leaves the resident set at once and
    # one configuration's peak is not hidden by the last one's heap (glibc's threshold is dynamic).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    fits = fits or loss_fits(names)
    rows = []
    for world_size in world_sizes:
        ranks_here = 1 if torch.cuda.is_available() else world_size
        skip_over = {}
        for global_batch in global_batches:
            for name in names:
                fit = fits["disco" if name == PEER else name]
                predicted = fit.bytes(global_batch // world_size, global_batch, dim) * 3  # kept + transient + grads
                if predicted * ranks_here > budget_bytes:
                    skip_over[(name, global_batch)] = (
                        f"predicted {predicted / 1e9:.1f} GB per rank × {ranks_here} "
                        f"rank(s) here, over the {budget_bytes / 1e9:g} GB budget"
                    )
        print(f"world size {world_size}:", flush=True)
        rows += launch_local(
            _bench_rank, world_size, names, list(global_batches), dim, repeats, skip_over, timeout_s=timeout_s
        )[0]
    return rows


def markdown(rows, world_size: int, global_batch: int) -> str:
    """One markdown table: every backend at one (world size, global batch), ratios to `disco`."""
    chosen = {r["backend"]: r for r in rows if r["world_size"] == world_size and r["global_batch"] == global_batch}
    disco = chosen.get("disco")
    lines = [
        f"| backend (N={world_size}, B={global_batch}) | kept for backward / rank | × disco | peak / rank | "
        "time fwd+bwd | × disco |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in chosen.items():
        if "skipped" in row:
            lines.append(f"| {name} | skipped: {row['skipped']} | | | | |")
            continue
        kept_ratio = f"{row['kept_bytes'] / disco['kept_bytes']:.3f}" if disco and "kept_bytes" in disco else ""
        time_ratio = f"{row['seconds'] / disco['seconds']:.2f}" if disco and "seconds" in disco else ""
        lines.append(
            f"| {name} | {human_bytes(row['kept_bytes'], 1)} | {kept_ratio} | {human_bytes(row['peak_bytes'], 1)} "
            f"| {row['seconds'] * 1e3:.0f} ms | {time_ratio} |"
        )
    return "\n".join(lines)


SCALING_BATCHES = (32768, 65536, 131072, 262144, 524288, 1048576)  # Inf-CL's Table 1 columns: 32k … 1M


def scaling(fits, names, world_size: int = 8, global_batches=SCALING_BATCHES, dim: int = 768) -> list[dict]:
    """Loss memory per rank at Inf-CL's Table 1 sizes, from the exact fits (predicted, not run): kept for
    backward, and with what the backward holds on top (the backend's transient_bytes), float32 features."""
    rows = []
    for name in names:
        fit, loss_fn = fits["disco" if name == PEER else name], build("disco" if name == PEER else name)
        for global_batch in global_batches:
            local_batch = global_batch // world_size
            kept = fit.bytes(local_batch, global_batch, dim)
            rows.append(
                {
                    "backend": name,
                    "world_size": world_size,
                    "global_batch": global_batch,
                    "dim": dim,
                    "predicted_kept_bytes": kept,
                    "predicted_peak_bytes": kept + loss_fn.transient_bytes(local_batch, global_batch, dim, 4),
                }
            )
    return rows


def scaling_markdown(rows) -> str:
    """The scaling rows as Inf-CL's Table 1: backends × global batch, kept (kept + in flight) per rank."""
    batches = sorted({r["global_batch"] for r in rows})
    first = rows[0]
    lines = [
        f"| loss memory per rank, N={first['world_size']}, d={first['dim']}, fp32 (predicted) | "
        + " | ".join(f"{b // 1024}k" if b % 1024 == 0 else f"{b:,}" for b in batches)
        + " |",
        "|---|" + "---:|" * len(batches),
    ]
    for name in dict.fromkeys(r["backend"] for r in rows):
        cells = {r["global_batch"]: r for r in rows if r["backend"] == name}
        lines.append(
            f"| {name} | "
            + " | ".join(
                f"{human_bytes(cells[b]['predicted_kept_bytes'], 1)} "
                f"({human_bytes(cells[b]['predicted_peak_bytes'], 1)})"
                for b in batches
            )
            + " |"
        )
    return "\n".join(lines)


def plot(rows, path: Path, scaling_rows=()) -> None:
    """Kept bytes per rank against global batch, log-log, one panel per world size; the scaling rows
    (predicted) in a last panel, kept and kept + in flight."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    world_sizes = sorted({r["world_size"] for r in rows})
    panels = len(world_sizes) + (1 if scaling_rows else 0)
    figure, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    names = list(dict.fromkeys(r["backend"] for r in [*rows, *scaling_rows]))
    markers = "os^vDx*P"
    for axis, world_size in zip(axes[0], world_sizes):
        for index, name in enumerate(names):  # same-memory backends overlap: markers and dashes tell them apart
            points = sorted(
                (r["global_batch"], r["kept_bytes"])
                for r in rows
                if r["world_size"] == world_size and r["backend"] == name and "kept_bytes" in r
            )
            if points:
                axis.loglog(
                    *zip(*points),
                    marker=markers[index % len(markers)],
                    linestyle="--" if index % 2 else "-",
                    label=name,
                    alpha=0.85,
                )
        axis.set_title(f"{world_size} rank(s), d={rows[0]['dim']}, measured")
        axis.set_ylabel("bytes kept for backward per rank")
    if scaling_rows:
        axis, first = axes[0][-1], scaling_rows[0]
        for index, name in enumerate(names):
            predicted: list[tuple[int, int, int]] = sorted(
                (r["global_batch"], r["predicted_kept_bytes"], r["predicted_peak_bytes"])
                for r in scaling_rows
                if r["backend"] == name
            )
            if predicted:
                batches, kept, peak = zip(*predicted)
                (line,) = axis.loglog(
                    batches, peak, marker=markers[index % len(markers)], label=f"{name} (+ in flight)"
                )
                axis.loglog(batches, kept, linestyle=":", color=line.get_color())
        axis.set_title(f"{first['world_size']} ranks, d={first['dim']}, predicted (dotted: kept)")
        axis.set_ylabel("loss bytes per rank")
        axis.legend(fontsize=7)
    for axis in axes[0]:
        axis.set_xlabel("global batch")
        axis.grid(True, which="both", alpha=0.3)
    axes[0][0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def outputs(tag: str) -> list[tuple[str, Callable[[bytes], bool]]]:
    """The files `write` replaces in its folder, each with what an earlier one of them holds (files.check_output)."""
    return [(f"loss_{tag}.json", is_json), (f"loss_scaling_{tag}.json", is_json), (f"loss_memory_{tag}.png", is_png)]


def is_png(data: bytes) -> bool:
    return data.startswith(b"\x89PNG\r\n\x1a\n")


def write(rows, out_dir: Path, tag: str, scaling_rows=()) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (json_name, _), (scaling_name, _), (picture_name, _) = outputs(tag)
    json_path = out_dir / json_name
    write_atomic(json_path, json.dumps(rows, indent=1))
    written = [json_path]
    if scaling_rows:
        written.append(out_dir / scaling_name)
        write_atomic(written[-1], json.dumps(list(scaling_rows), indent=1))
    try:
        plot(rows, out_dir / picture_name, scaling_rows)
        written.append(out_dir / picture_name)
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
    return written
