"""One optimisation step's forward/backward, whole or in chunks with cached feature gradients.

Gradient caching (GradCache, Gao et al. 2021), exact: with K chunks of the local batch,
  1. forward every chunk without a graph, remembering each chunk's RNG state;
  2. compute the loss once over the whole global batch from detached copies of the features
     and the model's scalars (logit scale, bias), and backpropagate it to those copies only;
  3. re-forward each chunk with its RNG state restored (same dropout masks) and backpropagate
     the cached gradients ∂L/∂features through it; DDP (or FSDP) averages once, on the last chunk.
The scalars' cached gradient is fed into exactly one chunk's backward: open_clip's feature
accumulation recomputes the loss per chunk and counts the logit scale's gradient K times.
The result equals keeping every chunk's graph and backpropagating the global loss once;
encoder activations are kept for one chunk at a time.

Inputs: `prepare(images, tokens)` puts a batch, or a chunk of it, on the device (copy, normalise).
The whole-batch step prepares the batch once; the chunked step keeps the batch where the loader left
it (pinned host memory on CUDA) and prepares each chunk as it runs, twice (forward, re-forward): the
device holds one chunk's inputs, not the local batch's (a million 224-px images are ~150 GB of uint8).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch.nn.parallel import DistributedDataParallel

from clipdist.parallel import finish_gradient_sync, gradient_sync


def _as_given(images, tokens):
    return images, tokens


class WholeBatchStep:
    """The plain step: forward the local batch with its graph, loss, backward."""

    def __init__(self, model, loss_fn, autocast=None, prepare=None):
        self.model, self.loss_fn, self.autocast = model, loss_fn, autocast or nullcontext()
        self.prepare = prepare or _as_given

    def loss(self, images, tokens) -> torch.Tensor:
        inputs = self.prepare(images, tokens)
        with self.autocast:
            outputs = self.model(*inputs)
        return self.loss_fn(*outputs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        finish_gradient_sync(self.model)


class GradCacheStep(WholeBatchStep):
    """The same step in `chunks` pieces; `loss` runs phases 1–2's forward, `backward` the rest."""

    def __init__(self, model, loss_fn, chunks: int, autocast=None, prepare=None):
        super().__init__(model, loss_fn, autocast, prepare)
        if chunks < 1:
            raise ValueError(f"grad_cache.chunks must be at least 1, got {chunks}")
        self.chunks = chunks
        self._pending = None

    def loss(self, images, tokens) -> torch.Tensor:
        if images.shape[0] < self.chunks:
            raise ValueError(f"grad_cache.chunks={self.chunks} is more than the local batch ({images.shape[0]})")
        pieces = list(zip(images.tensor_split(self.chunks), tokens.tensor_split(self.chunks)))
        module = self.model.module if isinstance(self.model, DistributedDataParallel) else self.model
        rng_states, outputs = [], []
        with torch.no_grad():
            for piece in pieces:
                inputs = self.prepare(*piece)
                rng_states.append(_rng_state(inputs[0].device))
                with self.autocast:
                    outputs.append(module(*inputs))
                del inputs
        # Detached leaves: the loss's backward stops here and leaves the gradients in .grad.
        image_features = torch.cat([out[0] for out in outputs]).requires_grad_()
        text_features = torch.cat([out[1] for out in outputs]).requires_grad_()
        scalars = [s.detach().requires_grad_() for s in outputs[0][2:]]  # logit scale (and bias)
        self._pending = (pieces, rng_states, image_features, text_features, scalars)
        return self.loss_fn(image_features, text_features, *scalars)

    def backward(self, loss: torch.Tensor) -> None:
        pieces, rng_states, image_features, text_features, scalars = self._pending
        self._pending = None
        loss.backward()
        sizes = [piece[0].shape[0] for piece in pieces]
        image_grads, text_grads = image_features.grad.split(sizes), text_features.grad.split(sizes)
        for k, (piece, rng) in enumerate(zip(pieces, rng_states)):
            last = k == len(pieces) - 1
            inputs = self.prepare(*piece)
            with gradient_sync(self.model, enabled=last), _restored_rng(rng, inputs[0].device):
                with self.autocast:
                    outputs = self.model(*inputs)
                scalar_grads = [s.grad if last else torch.zeros_like(s) for s in scalars]
                torch.autograd.backward(list(outputs), [image_grads[k], text_grads[k], *scalar_grads])
        finish_gradient_sync(self.model)


def build_step(model, loss_fn, chunks: int = 1, autocast=None, prepare=None) -> WholeBatchStep:
    if chunks > 1:
        return GradCacheStep(model, loss_fn, chunks, autocast, prepare)
    return WholeBatchStep(model, loss_fn, autocast, prepare)


def _rng_state(device: torch.device):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextmanager
def _restored_rng(state, device: torch.device):
    """Run a block with a saved RNG state (the chunk's dropout masks again), then put the current one back."""
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield
