"""How long a checkpoint stalls the training loop: a save written in the step (checkpoint.async_save=false)
against one written in the background (true), beside the copy of the state to host memory alone. One process, CPU,
interleaved rounds.

    python scripts/bench_checkpoint.py --model clipdist-tiny ViT-B-32 --rounds 3 --step-ms 0 71

A background save copies the state in a thread of its own while the loop goes on with the next step's forward and
backward; that step's optimizer update waits for the copy. Its stall is how long `save` held the loop plus that
wait, for a next step of each `--step-ms` during which the host is free (a GPU step: 71 ms is ViT-B/32 × 256 on an
H200, docs/bench/gpu_battery.md; 0: an update at once, the worst case).

Prints, per model: the state's bytes (weights + AdamW), the median stall of a synchronous save, of a background
save for each next step, and of the copy to host alone; and how long the background write took until published.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def state_for(model_name: str):
    import torch

    from clipdist.checkpoint.state import TrainState
    from clipdist.config import OptimConfig
    from clipdist.losses import build
    from clipdist.model.factory import create_model_for_loss
    from clipdist.optim.optimizer import build_optimizer

    torch.manual_seed(0)
    model = create_model_for_loss(model_name, build("disco"))
    optimizer, scheduler = build_optimizer(model, OptimConfig())
    for param in model.parameters():  # AdamW's moments exist after a step
        param.grad = torch.zeros_like(param)
    optimizer.step()
    return TrainState(model, optimizer, scheduler)


def state_bytes(state) -> int:
    tensors = list(state.model.state_dict().values())
    tensors += [value for moments in state.optimizer.state.values() for value in moments.values()]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def one_save(state, folder: Path, background: bool, step: int, next_step_s: float = 0.0) -> tuple[float, float]:
    """(the stall: how long `save` held the loop, with the wait of the next step's update after `next_step_s` of
    forward and backward; the write's total time until published)."""
    from clipdist.checkpoint.manager import Checkpointer
    from clipdist.config import TrainConfig
    from clipdist.distributed.launch import detect_env

    cfg = TrainConfig(name="bench", run_dir=str(folder))
    cfg.checkpoint.async_save = background
    checkpointer = Checkpointer(cfg, folder, detect_env())
    state.step = step
    os.sync()  # the last save's dirty pages flushed first: each save starts from a quiet disk, as between real saves
    started = time.perf_counter()
    assert checkpointer.save(state)
    pending = checkpointer.pending
    if pending is None:  # written in the step
        return time.perf_counter() - started, time.perf_counter() - started
    time.sleep(next_step_s)  # the next step's forward and backward, on the device
    state.optimizer.step()  # its update: waits for the copy where the copy is made beside the step
    stall = pending.held_s
    assert checkpointer.finish()
    return stall, time.perf_counter() - started


def copy_to_host(state) -> float:
    """The staging copy alone: every tensor of the sharded state dict cloned (DCP's stager does this)."""
    import torch

    os.sync()
    started = time.perf_counter()
    copies = [value.clone() for value in _tensors(state.sharded_state_dict())]
    elapsed = time.perf_counter() - started
    del copies
    assert torch  # the import is for the clone above
    return elapsed


def _tensors(tree):
    import torch

    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=["clipdist-tiny", "ViT-B-32"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-ms", type=float, nargs="+", default=[0.0, 71.0], help="the next step's device time")
    args = parser.parse_args(argv)
    columns = [f"stall, background save, next step {ms:g} ms" for ms in args.step_ms]
    print(
        f"| model | state (weights + AdamW) | stall, sync save | {' | '.join(columns)} | copy to host | "
        "background write, until published | stall / write |"
    )
    print("|---|---:|---:|" + "---:|" * len(columns) + "---:|---:|---:|")
    median = statistics.median
    for model_name in args.model:
        state = state_for(model_name)
        rows = []  # per round: (sync stall, copy, background total, the background stalls)
        with tempfile.TemporaryDirectory() as scratch:
            for round_number in range(args.rounds):
                copy = copy_to_host(state)
                sync, _ = one_save(state, Path(scratch) / f"sync{round_number}", False, round_number)
                stalls, totals = [], []
                for ms in args.step_ms:
                    folder = Path(scratch) / f"bg{round_number}_{ms:g}"
                    stall, total = one_save(state, folder, True, round_number, ms / 1e3)
                    stalls.append(stall)
                    totals.append(total)
                rows.append((sync, copy, median(totals), *stalls))
        sync, copy, total, *stalls = (median(column) for column in zip(*rows))
        shown = " | ".join(f"{stall * 1e3:.0f} ms" for stall in stalls)
        print(
            f"| {model_name} | {state_bytes(state) / 1e6:.0f} MB | {sync * 1e3:.0f} ms | {shown} | "
            f"{copy * 1e3:.0f} ms | {total * 1e3:.0f} ms | {', '.join(f'{s / total:.1%}' for s in stalls)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
