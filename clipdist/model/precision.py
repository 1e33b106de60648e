"""What `precision=` means for the towers, the step and the optimizer (open_clip's names in brackets):

| precision   | weights | forward            | gradient scaling                         |
|-------------|---------|--------------------|------------------------------------------|
| fp32        | fp32    | fp32               | none                                     |
| bf16        | fp32    | bf16 autocast      | none (amp_bf16)                          |
| fp16        | fp32    | fp16 autocast      | GradScaler, overflow agreed on all ranks (amp) |
| pure_bf16   | bf16    | bf16               | none (pure_bf16)                         |
| pure_fp16   | fp16    | fp16               | none (pure_fp16)                         |
| auto        | bf16 on CUDA, fp32 on CPU                                                     |

With a scaler the loss is multiplied by the scale S before backward and every gradient divided by S once,
after the last backward of the step (gradient caching included) and before clipping; an inf/NaN in any
rank's gradients skips the optimizer update on every rank and halves S on every rank, so the ranks'
weights and scales never drift apart: under DDP every rank holds the same averaged gradients, so the same
found_inf; under FSDP2 each rank holds a shard, and found_inf is all-reduced (max) over ranks (GradScaler below).
Multiplying by a power of two is exact, so a step that does not
overflow gives the same update as without the scaler.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
WEIGHTS = {"pure_bf16": torch.bfloat16, "pure_fp16": torch.float16}


def resolved(precision, device: torch.device) -> str:
    """`precision` with auto decided for `device`."""
    precision = str(precision)
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def autocast(precision, device: torch.device):
    """The forward's autocast context (a no-op where the weights' own dtype is the compute dtype)."""
    dtype = AUTOCAST.get(resolved(precision, device))
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()


def compute_dtype(precision, device: torch.device) -> torch.dtype:
    """The dtype the towers compute in."""
    name = resolved(precision, device)
    return AUTOCAST.get(name) or WEIGHTS.get(name) or torch.float32


def weights_dtype(precision) -> torch.dtype | None:
    """The dtype the weights are cast to (pure_*), or None to keep fp32."""
    return WEIGHTS.get(str(precision))


class GradScaler(torch.amp.GradScaler):
    """torch's GradScaler, which also unscales FSDP2's sharded gradients (DTensors, beside the whole 0-dim scalars
    FSDP leaves out) and agrees found_inf over ranks: each rank unscales its shards' local tensors, then found_inf
    is all-reduced (max), so a rank whose shard holds no inf still skips the update another rank's shard needs
    skipped. (torch's own DTensor rule for the unscale op takes no such mix and, on CPU, left found_inf at 0.)"""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        grads = [param.grad for group in optimizer.param_groups for param in group["params"] if param.grad is not None]
        if not any(isinstance(grad, DTensor) for grad in grads):
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:  # one rank, one device: the scale's
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            by_dtype.setdefault(local.dtype, []).append(local)
        with torch.no_grad():
            for locals_ in by_dtype.values():  # what the base class runs, on the shards' own tensors
                torch._amp_foreach_non_finite_check_and_unscale_(locals_, found_inf, inv_scale)
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return {found_inf.device: found_inf}


def gradient_scaler(precision, device: torch.device, init_scale: float = 2.0**16):
    """A gradient scaler for fp16 autocast, else None."""
    if resolved(precision, device) != "fp16":
        return None
    return GradScaler(device.type, init_scale=init_scale)
