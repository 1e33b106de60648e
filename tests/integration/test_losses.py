"""Every backend against the single-process loss on the global batch, at the feature level.

Each rank calls the loss on its slice of a global float64 batch. The contract checked:
mean over ranks of the loss == L; gradient at rank r's features == N·∂L/∂f_r (what DDP's
average turns into the single-process gradient); mean over ranks of the logit scale's
gradient == ∂L/∂s (and the logit bias's, for siglip). References: each backend's own (its registry entry's
`reference`) and, where that is CLIP's or SigLIP's loss, open_clip's ClipLoss / SigLipLoss with world size 1.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fixtures import global_batch, max_error, scalar_parameters, single_process
from open_clip.loss import ClipLoss, SigLipLoss

from clipdist.distributed.launch import launch_local
from clipdist.losses import BACKENDS, build
from clipdist.losses.distill import DistillationLoss
from clipdist.losses.reference import distill_loss_reference
from clipdist.registry import load
from clipdist.registry.losses import CLIP, SIGLIP

TOLERANCE = 1e-12

# (local batch per rank for world size n, logit scale). One loss module per backend runs
# all cases in order, so the batch size changing between calls is covered too.
CASES = [
    (lambda n: [4] * n, 1 / 0.07),
    (lambda n: [4] * n, 100.0),
    (lambda n: [3] * n, 100.0),
    (lambda n: [2 + r for r in range(n)], 100.0),
]


def distributed(loss_fn, sizes, seed, scale, with_bias=False):
    """The same quantities as DDP would see them: rank-local gradients averaged over ranks."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    image, text = global_batch(sizes, seed)
    rows = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    local_image = image[rows].clone().requires_grad_(True)
    local_text = text[rows].clone().requires_grad_(True)
    scalars = scalar_parameters(scale, with_bias)
    loss = loss_fn(local_image, local_text, *scalars)
    loss.backward()
    image_grad, text_grad = torch.zeros_like(image), torch.zeros_like(text)
    image_grad[rows] = local_image.grad
    text_grad[rows] = local_text.grad
    values = torch.stack([loss.detach(), *(s.grad for s in scalars)])
    for tensor in (image_grad, text_grad, values):
        dist.all_reduce(tensor)
        tensor /= world_size
    return values[0], image_grad, text_grad, *values[1:]


OPEN_CLIP = {CLIP: ClipLoss, SIGLIP: SigLipLoss}  # the references open_clip also defines (at world size 1)


def open_clip_reference(name: str):
    """open_clip's definition of the loss backend `name` computes, or its own reference where open_clip has none."""
    reference = BACKENDS[name].reference
    return OPEN_CLIP[reference]() if reference in OPEN_CLIP else load(reference)


# Every registered backend, plus the ring backends with tiles smaller than the local and global batch
# so rows and columns span several (and partial) tiles.
LOSSES = {
    **{name: (name, {}) for name in BACKENDS},
    "tiled(tile=3)": ("tiled", {"tile": 3}),
    "siglip(tile=3)": ("siglip", {"tile": 3}),
}


def check_all_backends():
    """Worker: {(loss, case): (max rel. error vs ours, vs open_clip)} on rank 0."""
    world_size = dist.get_world_size()
    errors = {}
    for backend, (name, options) in LOSSES.items():
        loss_fn = build(name, **options)
        bias = loss_fn.uses_logit_bias
        for case, (sizes_for, scale) in enumerate(CASES):
            sizes = sizes_for(world_size)
            got = distributed(loss_fn, sizes, case, scale, bias)
            errors[(backend, case)] = (
                max_error(got, single_process(loss_fn.reference, sizes, case, scale, bias)),
                max_error(got, single_process(open_clip_reference(name), sizes, case, scale, bias)),
            )
    return errors if dist.get_rank() == 0 else None


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_backend_matches_single_process_loss_and_gradients(world_size):
    errors = launch_local(check_all_backends, world_size, timeout_s=120)[0]
    assert set(errors) == {(b, c) for b in LOSSES for c in range(len(CASES))}
    bad = {key: err for key, err in errors.items() if max(err) > TOLERANCE}
    assert not bad, f"not exact at world size {world_size}: {bad}"


# Relative errors are taken against at least 1: a layout of one pair has a CLIP loss and gradients of exactly 0 (the
# ring's LSE − positive gives 4e-16), and a well-separated SigLIP pair a loss of 1e-10 that softplus(x) − x computes to
# the round-off of x (7e-15). Bugs are O(1): a missing term, a gradient N× or 1/N.
ROUND_OFF_FLOOR = 1.0

# Groups of a world of 4 a random layout runs on: the whole world (group=None, as training passes it), subgroups of
# two and three ranks, and a group of one.
MEMBERS = [(0, 1, 2, 3), (1, 3), (0, 1, 2), (2,)]


def layout_draw(rng: random.Random) -> dict:
    """One layout: a group, each member's local batch (0 rows on some ranks, never on all), the feature width, the
    scalars, the ring's tile and the upstream gradient the loss is multiplied by."""
    members = rng.choice(MEMBERS)
    sizes = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in members]
    if not sum(sizes):
        sizes[rng.randrange(len(sizes))] = rng.choice([1, 4])
    return {
        "members": members,
        "sizes": sizes,
        "dim": rng.choice([1, 2, 5, 16]),
        "scale": 10 ** rng.uniform(0, 2),
        "bias": rng.uniform(-12, 2),
        "tile": rng.choice([1, 2, 3, 7, 64]),
        "upstream": rng.uniform(0.5, 2),
        "seed": rng.randrange(10**6),
    }


def features(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: unit rows times a norm in [0.5, 1.5) (exactness is algebra, not the unit sphere)."""
    generator = torch.Generator().manual_seed(case["seed"])
    shape = (sum(case["sizes"]), case["dim"])
    norms = 0.5 + torch.rand(shape[0], 1, generator=generator, dtype=torch.float64)
    image, text = (F.normalize(torch.randn(shape, generator=generator, dtype=torch.float64), dim=-1) for _ in "it")
    return image * norms, text * norms.flip(0)


def gradients(loss_fn, bias: bool, image, text, case, group=None, rows=slice(None)):
    """(loss, ∂/∂image, ∂/∂text, ∂/∂scale[, ∂/∂bias]) of upstream·loss on `rows` of the batch; on a group, the
    members' contributions averaged as DDP averages them (the loss too)."""
    local = [tensor[rows].clone().requires_grad_(True) for tensor in (image, text)]
    scalars = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (case["scale"], case["bias"])]
    scalars = scalars[: 2 if bias else 1]
    loss = loss_fn(*local, *scalars)
    (loss * case["upstream"]).backward()
    grads = [torch.zeros_like(image), torch.zeros_like(text)]
    for full, part in zip(grads, local):
        full[rows] = part.grad
    values = torch.stack([loss.detach(), *(s.grad for s in scalars)])
    if group is not None:
        for tensor in (*grads, values):
            dist.all_reduce(tensor, group=group)
            tensor /= len(case["members"])
    return values[0], *grads, *values[1:]


def exact_over_random_layouts(seed: int, draws: int):
    """Worker: every backend on `draws` random layouts (the same on every rank); each rank returns
    [(draw, backend, max rel. error against the backend's reference)] of the layouts whose group it is in."""
    rank, rng = dist.get_rank(), random.Random(seed)
    groups = {members: dist.new_group(list(members)) for members in MEMBERS}  # every rank makes each, in order
    errors = []
    for draw in range(draws):
        case = layout_draw(rng)
        members = case["members"]
        if rank not in members:
            continue
        position = members.index(rank)
        group = None if len(members) == dist.get_world_size() else groups[members]
        image, text = features(case)
        rows = slice(sum(case["sizes"][:position]), sum(case["sizes"][: position + 1]))
        for name, spec in BACKENDS.items():
            loss_fn = build(name, **({"tile": case["tile"]} if spec.options else {}), group=group)
            bias = loss_fn.uses_logit_bias
            got = gradients(loss_fn, bias, image, text, case, groups[members], rows)
            want = gradients(loss_fn.reference, bias, image, text, case)
            errors.append((draw, name, max_error(got, want, ROUND_OFF_FLOOR)))
        # distillation's ring term, from a teacher one feature wider with its own scale
        teacher = features({**case, "dim": case["dim"] + 1, "seed": case["seed"] + 1})
        teacher_scale = torch.tensor(case["scale"] / 2, dtype=torch.float64)
        ring = DistillationLoss(tile=case["tile"], group=group)
        local = {"teacher_image": teacher[0][rows], "teacher_text": teacher[1][rows], "teacher_scale": teacher_scale}
        whole = {"teacher_image": teacher[0], "teacher_text": teacher[1], "teacher_scale": teacher_scale}
        got = gradients(functools.partial(ring, **local), False, image, text, case, groups[members], rows)
        want = gradients(functools.partial(distill_loss_reference, **whole), False, image, text, case)
        errors.append((draw, "distill", max_error(got, want, ROUND_OFF_FLOOR)))
    return errors


def test_every_backend_is_exact_over_random_layouts():
    """Every backend's and distillation's loss and gradients equal the single-process ones over random layouts:
    groups of 1–4 ranks, local batches of 0–8 rows (a rank with none too), widths 1–16, scales 1–100, tiles smaller
    and larger than every block."""
    results = launch_local(exact_over_random_layouts, 4, 20261129, 40, timeout_s=240)
    errors = [error for rank in sorted(results) for error in results[rank]]  # a subgroup's layouts on its ranks
    assert {name for _, name, _ in errors} == {*BACKENDS, "distill"} and len({draw for draw, _, _ in errors}) == 40
    bad = [(draw, name, error) for draw, name, error in errors if error > TOLERANCE]
    assert not bad, f"not exact: {bad}"


def mismatched_precision(name: str):
    """Worker: rank 1 passes float32 features, the others float64 (a rank left out of a float64 check, say)."""
    dtype = torch.float32 if dist.get_rank() == 1 else torch.float64
    features = F.normalize(torch.randn(3, 8, dtype=dtype), dim=-1)
    scalars = [torch.tensor(10.0), torch.tensor(-10.0)][: 2 if BACKENDS[name].reference == SIGLIP else 1]
    try:
        build(name)(features, features, *scalars)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("name", list(BACKENDS))
def test_features_of_another_precision_on_one_rank_raise_the_same_error_on_every_rank(name):
    """The blocks the ranks exchange would differ in size: gloo aborted every rank (SIGABRT); NCCL may read garbage."""
    messages = launch_local(mismatched_precision, 3, name, timeout_s=60)
    assert len(set(messages.values())) == 1, messages
    assert "precision differs across ranks" in messages[0] and "['float64', 'float32', 'float64']" in messages[0]


def mismatched_feature_dims():
    """Worker: rank 1 passes d=6, the others d=8; every rank must raise, none may hang."""
    dim = 6 if dist.get_rank() == 1 else 8
    features = F.normalize(torch.randn(3, dim, dtype=torch.float64), dim=-1)
    try:
        build("disco")(features, features, torch.tensor(10.0))
    except ValueError as error:
        return str(error)
    return None


def test_mismatched_feature_dims_raise_on_every_rank():
    messages = launch_local(mismatched_feature_dims, 3, timeout_s=60)
    assert len(messages) == 3
    assert all(m is not None and "feature dimension differs across ranks" in m for m in messages.values())
