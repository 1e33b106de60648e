"""One optimisation step, read top to bottom: own terms → forward → loss → agree → backward → clip → optimizer.

    step = build_step(model, objective, optimizer, scheduler, chunks=K, ...)
    agreed, grad_norm = step(batch, requests)     # training (a data.batch.Batch): grad_norm None if not stepped
    loss = step.gradients(batch)                  # gradients only (gradcheck, plan)

The model is called with the batch's named inputs (`model(**batch)`), and the objective (clipdist.objective) turns
its forward into the loss, term by term. A term with a forward of its own (Term.own_forward: the teacher terms'
student views) runs first, each chunk backpropagated at once, its gradients held on the rank (no_sync) until the
model's backward reduces everything: one term's graph is alive at a time.

Gradient caching (GradCache, Gao et al. 2021) is the same step with another forward and backward
(`CachedStep`), exact: with K chunks of the local batch,
  1. forward every chunk without a graph, remembering each chunk's RNG state;
  2. compute the loss once over the whole global batch from detached copies of the features
     and the model's scalars (logit scale, bias), and backpropagate it to those copies only;
  3. re-forward each chunk with its RNG state restored (same dropout masks) and backpropagate
     the cached gradients ∂L/∂features through it; DDP (or FSDP) averages once, on the last chunk.
The scalars' cached gradient is fed into exactly one chunk's backward: open_clip's feature
accumulation recomputes the loss per chunk and counts the logit scale's gradient K times.
The result equals keeping every chunk's graph and backpropagating the global loss once;
encoder activations are kept for one chunk at a time. The batch stays where the loader put it (pinned
host memory on CUDA) and each chunk is put on the device as it runs: the device holds one chunk's inputs.

The step's agreement (global loss, stop signal, checkpoint timer, the stream's counts) is one all-reduce,
issued after the loss and read once backward is enqueued: the step's one host sync, where the optimizer needs it. On
CUDA it waits for the all-reduce and its copy to the host alone (`Pending`), not for the backward behind them.

With a gradient scaler (precision=fp16, clipdist.model.precision) the loss is scaled before its backward (the
cached feature gradients carry the scale into every chunk's backward) and the gradients unscaled once,
before clipping; an overflow anywhere skips the update on every rank (`Step.overflowed`); the step still
counts and the schedule advances, as in open_clip_train.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function

from clipdist.checkpoint.manager import Requests
from clipdist.data.batch import Batch, as_batch, floats_to
from clipdist.data.device_decode import is_encoded
from clipdist.distributed import parallel
from clipdist.model.short_text import trim
from clipdist.objective import Outputs, as_objective
from clipdist.optim.optimizer import run_lr

log = logging.getLogger("clipdist")


@dataclass(frozen=True)
class Pending:
    """A device tensor on its way to the host: on CUDA a copy into pinned memory and an event recorded after it on
    the stream, so that reading it waits for the copy alone — not for what the stream was given since (the backward):
    the host goes on enqueueing the optimizer and the next step while backward runs. On the CPU the tensor itself."""

    values: torch.Tensor
    ready: torch.cuda.Event | None = None

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Pending:
        if tensor.device.type != "cuda":
            return cls(tensor)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tensor.device))  # the stream the copy was put on
        return cls(host, ready)

    def wait(self) -> list:
        if self.ready is not None:
            self.ready.synchronize()
        return self.values.tolist()


NOTHING_ASKED = Requests()  # no stop, no timer, no save written: a step outside a run (gradcheck, benchmarks)


@dataclass(frozen=True)
class StepAgreement:
    """What every rank learns from the step's one all-reduce, so that all skip, stop, save or step together."""

    loss: float  # the global loss: the mean of the ranks' losses
    stop: bool  # some rank received a stop signal
    timer_elapsed: bool  # some rank's checkpoint_every_minutes timer ran out
    saved: bool  # every rank has written its part of the checkpoint being saved in the background
    counts: list[int]  # Batch.counts summed over ranks
    terms: dict  # the objective's terms beside the total (CoCa: contrastive_loss, caption_loss), means over ranks

    @staticmethod
    def start(loss: torch.Tensor, requests: Requests, counts: list[int], terms=()) -> Pending:
        """Collective, not read yet: the mean over ranks of (loss, *terms, stop, timer, written, *counts), on its
        way to the host; `requests` from Checkpointer.requests."""
        flags = torch.tensor([*map(float, requests), *counts], dtype=torch.float64)
        values = [loss.detach().reshape(1).double(), *(term.reshape(1).double() for term in terms)]
        if loss.device.type == "cuda":
            flags = flags.pin_memory()  # a copy from pageable memory would wait for the forward to finish
        return Pending.of(parallel.all_reduce_mean(torch.cat([*values, flags.to(loss.device, non_blocking=True)])))

    @classmethod
    def read(cls, pending: Pending, term_names=()) -> StepAgreement:
        values, world_size = pending.wait(), parallel.rank_and_world_size()[1]
        loss, terms = values[0], dict(zip(term_names, values[1 : 1 + len(term_names)]))
        values = values[1 + len(term_names) :]
        return cls(
            loss,
            values[0] > 0,
            values[1] > 0,
            values[2] > 1 - 1e-9,
            [round(value * world_size) for value in values[3:]],
            terms,
        )


def clip_gradients(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Scale all gradients so their global norm is at most `max_norm` (0: no clipping); the norm before.
    Under FSDP each rank holds a shard of every gradient (DTensors): the norm is reduced over ranks."""
    norm, grads = parallel.total_norm([param.grad for param in model.parameters() if param.grad is not None])
    if max_norm and grads:  # torch.nn.utils.clip_grads_with_norm_'s coefficient, on the grads (or their shards)
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


class Step:
    """The plain step: the local batch forwarded with its graph. `model` is what runs (DDP/FSDP-wrapped,
    compiled); `device` and `normalize` put a batch (or a chunk) on the device and normalise uint8 pixels
    there (None: as given); `decode` makes an encoded batch's pixels on the device, once a step
    (data.decode_on=device: device_decode.decode_rows); `trim_text`: captions cut to the batch's (or chunk's)
    longest (short_text.trim)."""

    def __init__(
        self,
        model,
        loss_fn,
        optimizer=None,
        scheduler=None,
        *,
        autocast=None,
        device=None,
        normalize=None,
        decode=None,
        grad_clip: float = 0.0,
        max_logit_scale: float = 100.0,
        scaler=None,
        input_dtype: torch.dtype | None = None,
        trim_text: bool = False,
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.objective = as_objective(loss_fn)  # the contrastive backend, CoCa's caption term, distillation
        self.autocast, self.device, self.normalize = autocast or nullcontext(), device, normalize
        self.decode = decode
        self.host_decoded = 0  # encoded batches' rows this rank's workers decoded (no JPEG the device takes)
        self.unreadable = 0  # encoded rows no decoder could read (device_decode.Decoded.unreadable), left black
        self.grad_clip, self.max_log_scale = grad_clip, math.log(max_logit_scale)
        self.scaler, self.input_dtype = scaler, input_dtype  # input_dtype: pure_bf16 / pure_fp16 weights
        self.trim_text = trim_text
        self.overflowed = False  # the last step's scaled gradients overflowed: its update was skipped on every rank
        # the run's lr the last optimizer step used (optimizer.run_lr), for the logs
        self.applied_lr: float | None = None
        self.module = model.module if isinstance(model, DistributedDataParallel) else model

    def __call__(self, batch: Batch, requests: Requests = NOTHING_ASKED) -> tuple[StepAgreement, torch.Tensor | None]:
        """One training step on this rank's batch; every rank calls it. The optimizer steps unless a rank was
        asked to stop or the global loss is not finite (then grad_norm is None and nothing changed)."""
        batch = self.decoded(as_batch(batch))
        self.optimizer.zero_grad(set_to_none=True)
        rng = _rng_state(self.rng_device)  # a stop gives back what this step drew (dropout masks)
        with record_function("own_terms"):
            own = self.own_terms(batch)
        with record_function("forward_and_loss"):
            outputs, replay = self.forward(batch)
            loss, terms = self.objective(outputs.with_parts(own))
        agreement = StepAgreement.start(loss, requests, batch.counts, terms.values())
        with record_function("backward"):
            self.backward(loss, outputs, replay)
        agreed = StepAgreement.read(agreement, list(terms))
        if agreed.stop:  # not trained on: the checkpoint saved next holds the state before this step, RNG included
            _set_rng_state(rng, self.rng_device)
            return agreed, None
        if not math.isfinite(agreed.loss):
            return agreed, None
        with record_function("optimizer"):
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)  # found_inf agreed over ranks here
            grad_norm = clip_gradients(self.module, self.grad_clip)
            if self.scaler is not None:
                self.scaler.step(self.optimizer)  # no update where found_inf
                self.scaler.update()
                self.overflowed = not math.isfinite(grad_norm)  # the global norm: the same on every rank
            else:
                self.optimizer.step()
            self.applied_lr = run_lr(self.optimizer)  # before the schedule moves on to the next step's
            self.scheduler.step()
            with torch.no_grad():
                self.module.logit_scale.clamp_(0, self.max_log_scale)
            self.objective.commit()  # a term's own state (self-distillation's centre)
        return agreed, grad_norm

    def start_terms(self, names: list[str]) -> None:
        """Terms that count from the next step on (Objective.at): their own modules' optimizer state made fresh, as
        the paper's heads and mask token are at the terms' start (SigLIP 2 §2.3). Their weights are still those of
        step 0, a zero gradient every step since (OwnModule.touch) and decoupled weight decay their only change."""
        for term, _ in self.objective.terms:
            if term.name in names and self.optimizer is not None:
                for parameter in (p for module in term.modules() for p in module.parameters()):
                    for value in self.optimizer.state.get(parameter, {}).values():
                        if isinstance(value, torch.Tensor):
                            value.zero_()  # Adam's step count and moments: as before its first step

    def gradients(self, batch) -> torch.Tensor:
        """This rank's loss, with the gradients it leaves (averaged over ranks, as DDP does) in .grad."""
        batch = self.decoded(as_batch(batch))
        own = self.own_terms(batch)
        outputs, replay = self.forward(batch)
        loss, _ = self.objective(outputs.with_parts(own))
        self.backward(loss, outputs, replay)
        return loss

    def decoded(self, batch: Batch) -> Batch:
        """The batch, its images decoded on the device where they came encoded (data.decode_on=device): once a
        step, before any chunk or term reads them."""
        if not is_encoded(batch["image"]):
            return batch
        if self.decode is None:
            raise ValueError("an encoded batch (data.decode_on=device) reached a step that has no decoder")
        with record_function("decode"):
            decoded = self.decode(batch["image"])
        self.host_decoded += decoded.host_decoded
        self.unreadable += len(decoded.unreadable)
        for row in decoded.unreadable:
            key = batch.sample_keys[row] if batch.sample_keys else f"row {row}"
            log.warning("%s: its JPEG decoded neither on the device nor by PIL; trained on as a black image", key)
        return Batch({**batch.inputs, "image": decoded.pixels}, batch.counts, batch.sample_keys)

    def pieces(self, batch: Batch) -> list[Batch]:
        """The batch as the step forwards it: whole here, in chunks under gradient caching."""
        return [batch]

    def own_terms(self, batch: Batch) -> dict:
        """The own-forward terms (a teacher term's student views: Objective.own_backward), each backpropagated
        apart, chunk by chunk, before the model's forward: their gradients stay on this rank until the model's
        backward reduces everything (DDP's no_sync, FSDP2's requires_gradient_sync). {} at once without such
        terms (FSDP2's switch walks every module, twice a step)."""
        if not self.objective.own_forward:
            return {}
        with parallel.gradient_sync(self.model, enabled=False):
            pieces = self.pieces(batch)
            return self.objective.own_backward(
                lambda: (self.inputs(piece) for piece in pieces),  # one chunk on the device at a time
                batch.rows,
                lambda share: self.scaled(share).backward(),
                within=lambda: self.autocast,
            )

    @property
    def rng_device(self) -> torch.device:
        return self.device or torch.device("cpu")

    def inputs(self, batch: Batch) -> dict:
        """The model's named inputs of `batch` (or a chunk of it) on the device; its uint8 pixels normalised there,
        its images in the weights' dtype where the weights are not fp32 (pure_bf16 / pure_fp16)."""
        if self.trim_text:
            batch = batch.map(trim, names=("text",))
        inputs = dict(batch.to(self.device) if self.device is not None else batch)
        image = inputs["image"] if self.normalize is None else self.normalize(inputs["image"])
        inputs["image"] = floats_to(image, self.input_dtype)
        return inputs

    def forward(self, batch: Batch) -> tuple[Outputs, None]:
        """(the forward in the parts the objective takes, what backward needs again: nothing here)."""
        with self.autocast:
            inputs = self.inputs(batch)
            return self.objective.merge([self.objective.chunk_outputs(self.model(**inputs), inputs)]), None

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def backward(self, loss, outputs, replay) -> None:
        self.scaled(loss).backward()
        parallel.finish_gradient_sync(self.model)


class CachedStep(Step):
    """The same step with gradient caching in `chunks` pieces (the module docstring's steps 1-3)."""

    def __init__(self, model, loss_fn, optimizer=None, scheduler=None, *, chunks: int, **options):
        super().__init__(model, loss_fn, optimizer, scheduler, **options)
        if chunks < 1:
            raise ValueError(f"grad_cache.chunks must be at least 1, got {chunks}")
        self.chunks = chunks

    def pieces(self, batch: Batch) -> list[Batch]:
        return batch.split(self.chunks)

    def forward(self, batch: Batch):
        pieces = self.pieces(batch)
        rng_states, chunks = [], []
        with torch.no_grad():
            for piece in pieces:
                inputs = self.inputs(piece)
                rng_states.append(_rng_state(self.rng_device))
                with self.autocast:  # each term takes its part here (CoCa's logits reduced, the teacher's features)
                    chunks.append(self.objective.chunk_outputs(self.module(**inputs), inputs))
                del inputs
        # Detached leaves: the loss's backward stops here and leaves the gradients in .grad.
        image_features = torch.cat([chunk.features[0] for chunk in chunks]).requires_grad_()
        text_features = torch.cat([chunk.features[1] for chunk in chunks]).requires_grad_()
        scalars = [s.detach().requires_grad_() for s in chunks[0].features[2:]]  # logit scale (and bias)
        return self.objective.merge(chunks, (image_features, text_features, *scalars)), (pieces, rng_states)

    def backward(self, loss, outputs, replay) -> None:
        (image_features, text_features, *scalars), (pieces, rng_states) = outputs.features, replay
        self.scaled(loss).backward()
        sizes = [piece.rows for piece in pieces]
        image_grads, text_grads = image_features.grad.split(sizes), text_features.grad.split(sizes)
        for k, (piece, rng) in enumerate(zip(pieces, rng_states)):
            last = k == len(pieces) - 1
            inputs = self.inputs(piece)
            with parallel.gradient_sync(self.model, enabled=last), _restored_rng(rng, self.rng_device):
                with self.autocast:
                    chunk = self.objective.chunk_outputs(self.model(**inputs), inputs, per_chunk=True)
                scalar_grads = [s.grad if last else torch.zeros_like(s) for s in scalars]
                pairs = [
                    (out, grad)
                    for out, grad in zip(chunk.features, [image_grads[k], text_grads[k], *scalar_grads])
                    if out.requires_grad
                ]  # a locked tower's features have no graph
                own = self.objective.chunk_loss(chunk, outputs)  # CoCa: the chunk's share of w·N/T·Σ CE
                if own is not None:
                    pairs.append((self.scaled(own), None))
                torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        parallel.finish_gradient_sync(self.model)


def build_step(model, loss_fn, optimizer=None, scheduler=None, *, chunks: int = 1, **options) -> Step:
    """The step for `chunks` (1: the plain step; more: gradient caching); `options` as Step takes them."""
    if chunks > 1:
        return CachedStep(model, loss_fn, optimizer, scheduler, chunks=chunks, **options)
    return Step(model, loss_fn, optimizer, scheduler, **options)


def _rng_state(device: torch.device):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(state, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


@contextmanager
def _restored_rng(state, device: torch.device):
    """Run a block with a saved RNG state (the chunk's dropout masks again), then put the current one back."""
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        _set_rng_state(state, device)
        yield
