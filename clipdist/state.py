"""TrainState: everything a run needs to continue where it stopped, saved and restored in one place."""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch


def rng_state() -> dict:
    """This process's Python, NumPy, torch (and CUDA) generator states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class TrainState:
    """Model, optimizer, schedule, progress counters and every rank's RNG.

    `state_dict(rngs)` takes the RNG states of all ranks (gathered by the caller, in rank
    order); `load_state_dict` restores this rank's when the world size is unchanged.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: int = 0
    samples_seen: int = 0
    data: dict | None = None  # the data stream's position (see Trainer.data_position), as saved

    def state_dict(self, rngs: list[dict]) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), **self.progress(rngs)}

    def progress(self, rngs: list[dict]) -> dict:
        """Everything but the model's and optimizer's tensors (all a sharded checkpoint keeps beside them)."""
        return {"scheduler": self.scheduler.state_dict(), "step": self.step, "samples_seen": self.samples_seen,
                "rng": rngs, "world_size": len(rngs), "data": self.data}

    def sharded_state_dict(self) -> dict:
        """Model and optimizer state as this rank's shards (DTensors, keyed by parameter name), for
        torch.distributed.checkpoint; loading one into the same structure reshards to any world size."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_sharded_state_dict(self, loaded: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optimizer"])

    def load_state_dict(self, saved: dict, rank: int, world_size: int) -> None:
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.load_progress(saved, rank, world_size)

    def load_progress(self, saved: dict, rank: int, world_size: int) -> None:
        self.scheduler.load_state_dict(saved["scheduler"])
        self.step, self.samples_seen = saved["step"], saved["samples_seen"]
        self.data = saved.get("data")  # None from checkpoints before the data position was saved
        if len(saved["rng"]) == world_size:
            set_rng_state(saved["rng"][rank])
