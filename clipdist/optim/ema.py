"""optim.ema: an exponential moving average of the weights, kept beside them.

After optimizer step t (1-based), where t ≥ start_step and (t − start_step) is a multiple of `every`:

    ema ← decay · ema + (1 − decay) · θ        (torch.lerp: ema + (1 − decay)(θ − ema))

and before start_step the average is the weights themselves (copied). The average is held in fp32 whatever the
weights' precision, one tensor per parameter of the model as it is trained: under FSDP2 a DTensor sharded as its
parameter (each rank averages its own shard), under DDP a whole tensor on every rank (each rank the same). Its
state is those tensors, keyed by the parameters' names: a checkpoint's "ema" beside its "model", which DCP
reshards to any world size and either parallelism. Buffers are not averaged (an export takes the model's).
"""

from __future__ import annotations

import torch

from clipdist.config import EmaConfig


class WeightAverage:
    def __init__(self, model: torch.nn.Module, config: EmaConfig, max_steps: int = 0):
        self.decay, self.every = float(config.decay), int(config.every)
        self.start_step = config.first_step(max_steps)
        named = list(model.named_parameters())
        self.names = [name for name, _ in named]
        self.params = [parameter for _, parameter in named]
        with torch.no_grad():
            self.average = [parameter.detach().float().clone() for parameter in self.params]

    def update(self, step: int) -> None:
        """After optimizer step `step`: the average moves toward the weights (or is them, before start_step)."""
        with torch.no_grad():
            if step < self.start_step:
                self.reset()
            elif (step - self.start_step) % self.every == 0:  # one foreach call: a kernel per group, not per tensor
                torch._foreach_lerp_(self.average, self.weights(), 1.0 - self.decay)

    def reset(self) -> None:
        """The average set to the weights (a run that starts averaging, or resumes one that had none)."""
        with torch.no_grad():
            for average, weight in zip(self.average, self.weights()):  # DTensor has no _foreach_copy_
                average.copy_(weight)

    def weights(self) -> list[torch.Tensor]:
        """The weights in fp32 (the parameters themselves where they are)."""
        return [parameter.detach().float() for parameter in self.params]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The average's tensors by parameter name: DCP saves them, and loads a checkpoint's into them in place."""
        return dict(zip(self.names, self.average))
