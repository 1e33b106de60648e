"""Gradient caching: the chunked step's gradients equal the whole step's, the scale counted once."""

from __future__ import annotations

import torch

from clipdist.data.batch import Batch
from clipdist.losses import build
from clipdist.model.factory import create_model_for_loss
from clipdist.tools.gradcheck import _random_batch, run_gradchecks
from clipdist.train.step import build_step


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_grad_cache_is_exact_under_ddp_for_every_backend():
    for report in run_gradchecks(["naive", "disco", "tiled", "siglip"], 2, local_batch=[4, 3], chunks=3):
        assert report.exact, (report.backend, report.diagnosis)
        assert report.chunks == 3


def _syncs_per_step(chunks: int):
    """On each rank: gradient all-reduces DDP runs for one step, and whether the wrapper keeps no_sync."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from clipdist.distributed.parallel import wrap_model

    torch.manual_seed(0)
    compiled = wrap_model(create_model_for_loss("clipdist-tiny", build("disco")), compile=True)
    keeps_no_sync = isinstance(compiled, DistributedDataParallel) and compiled.module._compiled_call_impl is not None
    torch.manual_seed(0)
    model = wrap_model(create_model_for_loss("clipdist-tiny", build("disco")))
    calls = []

    def counting_allreduce(_, bucket):
        calls.append(bucket.index())
        buffer = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])

    model.register_comm_hook(None, counting_allreduce)
    images, tokens = _random_batch(8, "clipdist-tiny", dist.get_rank(), torch.float32).values()
    build_step(model, build("disco"), chunks=chunks).gradients(Batch.of(images, tokens))
    return keeps_no_sync, len(calls)


def test_compiled_ddp_keeps_no_sync_and_chunks_sync_once():
    from clipdist.distributed.launch import launch_local

    whole = launch_local(_syncs_per_step, 2, 1, timeout_s=120)
    chunked = launch_local(_syncs_per_step, 2, 4, timeout_s=120)
    assert whole[0][0] and chunked[0][0]  # compiled in place, DDP outermost
    assert whole[0][1] >= 1
    assert chunked[0][1] == whole[0][1]  # 4 chunks, one gradient sync: no all-reduce per chunk
