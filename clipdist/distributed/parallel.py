"""How the model is spread over ranks: DDP or FSDP2 wrapping, the gradient sync the wrappers leave to
us, and the few collectives the loop uses (the loss backends' own are in clipdist.losses.collectives)."""

from __future__ import annotations

import copy
import weakref
from contextlib import contextmanager
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from clipdist.registry.terms import training_only_parts


def wrap_model(
    model: torch.nn.Module,
    *,
    parallel: str = "ddp",
    compile: bool = False,
    compile_mode: str = "default",
    param_dtype: torch.dtype | None = None,
    sync_batchnorm: bool = False,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """What the training step calls.

    ddp: the towers compiled in place (torch.compile, in `compile_mode`), then DDP outermost when there is more than
    one rank — so DDP's `no_sync` stays reachable for gradient caching.
    fsdp: FSDP2 (`fully_shard`) on every transformer block of both towers (each compiled first),
    then on the root, which takes the rest (embeddings, projections, logit scale and bias); the
    model is changed in place and returned. `param_dtype` (bf16 on CUDA) is the compute dtype of
    the gathered parameters; gradients are reduced in fp32. `reshard_after_forward=False`: a block's gathered
    parameters are kept from its forward to its backward (one all-gather a step fewer, all of them held at once).
    Gradients are averaged over ranks, as DDP's are, so every loss backend's exactness argument holds unchanged.
    `sync_batchnorm`: BatchNorm layers become SyncBatchNorm (statistics over every rank's samples), before either
    wrapper.
    """
    if sync_batchnorm and dist.is_initialized() and dist.get_world_size() > 1:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if parallel == "fsdp":
        return _fully_shard(
            model,
            compile_mode=compile_mode if compile else None,
            param_dtype=param_dtype,
            reshard_after_forward=reshard_after_forward,
        )
    if compile:
        model.compile(mode=compile_mode)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    device = next(model.parameters()).device
    # Buffers are broadcast from rank 0 before every forward (a collective and a sync per step) only when
    # training changes them (BatchNorm statistics); CLIP towers' buffers (attention masks) are constants.
    # Gradients live in DDP's buckets (no copy of every gradient into them and back after the all-reduce).
    running_stats = any(
        isinstance(module, torch.nn.modules.batchnorm._NormBase) and module.track_running_stats
        for module in model.modules()
    )
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        forward_sync_buffers=running_stats,
        gradient_as_bucket_view=True,
    )


BLOCK_LISTS = ("resblocks", "blocks", "layers")  # open_clip transformers, timm ViTs, HF-style text towers


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of every tower (open_clip `resblocks`, timm `blocks`): FSDP's units, outermost
    only (a block list inside a block belongs to that block's unit)."""
    lists = [
        name
        for name, module in model.named_modules()
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and name.rsplit(".", 1)[-1] in BLOCK_LISTS
    ]
    outer = [name for name in lists if not any(name.startswith(other + ".") for other in lists)]
    blocks = [block for name in outer for block in cast(torch.nn.ModuleList, model.get_submodule(name))]
    return [block for block in blocks if any(True for _ in block.parameters())]


def _fully_shard(
    model: torch.nn.Module, *, compile_mode: str | None, param_dtype: torch.dtype | None, reshard_after_forward: bool
) -> torch.nn.Module:
    if not dist.is_initialized():
        raise RuntimeError("world.parallel=fsdp needs a process group (torchrun, srun or world.spawn)")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    _STRUCTURES[model] = meta_copy(model)  # before sharding: what a teacher's forward runs on (plain_structure)
    for block in transformer_blocks(model):  # preflight (trainer.check_shardable) made sure there are some
        if compile_mode is not None:
            block.compile(mode=compile_mode)
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    parts = [getattr(model, part) for part in training_only_parts() if hasattr(model, part)]
    for module in parts:  # a loss term's own module (a decoder) is called outside the model's forward
        fully_shard(module, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        for method in getattr(module, "fsdp_methods", ()):  # its methods the term calls besides forward
            register_fsdp_forward_method(module, method)
    if any(getattr(module, "calls_image_tower", False) for module in parts):
        # a term runs the image tower outside the model's forward (the teacher terms' student views): its own unit,
        # so the parameters outside its blocks are gathered for each call too (kept for backward, as the root's)
        visual = cast(torch.nn.Module, model.visual)
        visual.register_forward_hook(_without_views)  # runs before FSDP2's own (registered after it)
        fully_shard(visual, mp_policy=policy, reshard_after_forward=False)
    # fully_shard cannot shard 0-dim parameters (the logit scale and bias): they stay whole on every rank,
    # outside FSDP, and their gradients are averaged by finish_gradient_sync after backward.
    scalars = [param for param in model.parameters() if param.ndim == 0]
    # The root's parameters are needed again at once by backward: keep them gathered after forward.
    fully_shard(model, mp_policy=policy, reshard_after_forward=False, ignored_params=set(scalars))
    vars(model)["replicated_parameters"] = scalars  # a plain list: nn.Module.__setattr__ would put it here too
    if parts:
        # FSDP2 makes the first unit to run forward the root: a term's module or the image tower runs before the
        # model's forward (Objective.own_backward), so the model is made the root now (torch has no public call)
        fully_shard.state(model)._lazy_init()  # type: ignore[attr-defined]
    _register_methods_beside_forward(model, [name for name in ("encode_image", "encode_text") if hasattr(model, name)])
    return model


def _register_methods_beside_forward(model: torch.nn.Module, names: list[str]) -> None:
    """The model's `names` (evaluation calls encode_image and encode_text, not forward) gather the root's shards as
    forward does where called alone (register_fsdp_forward_method). Called inside the model's own forward (open_clip's
    forward calls both) they run plain: FSDP2's hooks around them would end the root's forward early (its
    post-forward, finding the root idle, reshards it), and backward would gather the root's weights again."""
    inside = [0]  # the model's forwards running (a hook that always runs counts them out, an error too)
    model.register_forward_pre_hook(lambda module, args: inside.__setitem__(0, inside[0] + 1))
    model.register_forward_hook(lambda module, args, out: inside.__setitem__(0, inside[0] - 1), always_call=True)
    for name in names:
        plain = getattr(model, name)
        register_fsdp_forward_method(model, name)
        hooked = getattr(model, name)

        def method(*args, _plain=plain, _hooked=hooked, **kwargs):
            return (_plain if inside[0] else _hooked)(*args, **kwargs)

        setattr(model, name, method)


def _without_views(module, args, output):
    """A unit's outputs that are views of another tensor (open_clip's per-patch tokens), copied: FSDP2 hooks its
    backward onto what a unit returns, and an in-place op on a view would drop that hook."""
    if isinstance(output, tuple):
        return tuple(_without_views(module, args, item) for item in output)
    return output.clone() if isinstance(output, torch.Tensor) and output._base is not None else output


_STRUCTURES: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


def meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """`module`'s structure with every parameter and buffer on the meta device (no storage), no forward hooks and
    nothing compiled (a compiled call would run the original's modules): torch.func.functional_call runs it with
    whole tensors of one's choice."""
    memo: dict = {}
    for tensor in (*module.parameters(), *module.buffers()):
        empty = torch.empty_like(tensor, device="meta")
        parameter = isinstance(tensor, torch.nn.Parameter)
        memo[id(tensor)] = torch.nn.Parameter(empty, tensor.requires_grad) if parameter else empty
    plain = copy.deepcopy(module, memo)
    for inner in plain.modules():
        inner._forward_hooks.clear()
        inner._forward_pre_hooks.clear()
        inner._compiled_call_impl = None
    return plain


def plain_structure(model: torch.nn.Module) -> torch.nn.Module:
    """The model as it was before FSDP2 sharded it, on the meta device (meta_copy; kept by wrap_model, since a
    sharded module's own forward gathers its shards and puts its own parameters back): an unsharded model's copy is
    made now."""
    kept = _STRUCTURES.get(model)
    return kept if kept is not None else meta_copy(model)


def finish_gradient_sync(model: torch.nn.Module) -> None:
    """Average over ranks the gradients FSDP leaves to us (the 0-dim scalars it keeps whole: logit scale
    and bias), as it averages all others. Called once after the step's last backward; nothing to do
    under DDP, which averages every gradient itself."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    grads = [param.grad for param in getattr(model, "replicated_parameters", ()) if param.grad is not None]
    if grads:
        for grad, mean in zip(grads, all_reduce_mean(torch.stack(grads))):
            grad.copy_(mean)


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def total_norm(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the 2-norm of `tensors` together, the tensors to scale in place to clip them). FSDP2's gradients (DTensors
    sharded over a 1-D mesh) are taken as their local shards: the squares of this rank's shards summed over the mesh,
    those of the tensors kept whole on every rank (the 0-dim scalars) added once — no DTensor dispatch per tensor
    (the DTensor norm and clip took 7.3 ms a step against 5.7 for clipdist-tiny's 62 gradients, one CPU rank)."""
    sharded = [tensor for tensor in tensors if isinstance(tensor, DTensor)]
    if not sharded or any(tensor.device_mesh.ndim != 1 or not tensor.placements[0].is_shard() for tensor in sharded):
        return full_tensor(torch.nn.utils.get_total_norm(tensors, foreach=True)), tensors
    local = [tensor.to_local() for tensor in sharded]
    whole = [tensor for tensor in tensors if not isinstance(tensor, DTensor)]
    norm = torch.nn.utils.get_total_norm(local, foreach=True)
    squares = norm.double() ** 2
    dist.all_reduce(squares, group=sharded[0].device_mesh.get_group())
    if whole:
        squares = squares + torch.nn.utils.get_total_norm(whole, foreach=True).double() ** 2
    return squares.sqrt().to(norm.dtype), local + whole


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: every rank calls it); any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool):
    """Backward passes inside accumulate gradients locally when not `enabled` (DDP's no_sync, FSDP's
    set_requires_gradient_sync); the next backward with sync reduces everything accumulated."""
    if enabled:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over ranks (a copy; the input is left alone)."""
    out = tensor.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out)
        out /= dist.get_world_size()
    return out


def rank_and_world_size() -> tuple[int, int]:
    """(rank, world size) of the default group; (0, 1) without one."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def all_ranks(obj) -> list:
    """Every rank's `obj` (picklable), in rank order."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextmanager
def node_leaders_first(local_rank: int, needed: bool = True):
    """Local rank 0 of every node runs the block first (to fetch a download into the node's cache), the
    node's other ranks after it (to read that cache): one barrier, which every rank reaches once."""
    if needed and local_rank != 0:
        barrier()
    yield
    if needed and local_rank == 0:
        barrier()


def uses_cuda(setting: str) -> bool:
    """Whether world.device (auto, cpu, cuda) puts the ranks on CUDA devices."""
    return setting == "cuda" or (setting == "auto" and torch.cuda.is_available())


def select_device(setting: str, local_rank: int) -> torch.device:
    """The rank's device for world.device (auto: CUDA where visible), made current."""
    if uses_cuda(setting):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
