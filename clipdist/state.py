"""TrainState: everything a run needs to continue where it stopped, saved and restored in one place."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from clipdist.parallel import all_ranks, rank_and_world_size


def rng_state() -> dict:
    """This process's Python, NumPy, torch (and CUDA) generator states, as plain types and tensors (what a
    checkpoint may hold: clipdist.weights reads them back with weights_only)."""
    name, keys, position, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, keys.tolist(), position, has_gauss, cached),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class TrainState:
    """The stateful parts of a run — model, optimizer, schedule, data stream, gradient scaler — with its step,
    samples seen and every rank's RNG. `progress` is a collective (every rank's RNG and stream position are gathered into
    it); loading restores this rank's part."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stream: Any = None  # a TrainStream (state_dict / load_state_dict), or None where there is no data
    scaler: Any = None  # precision=fp16's gradient scaler (its scale and growth count), or None
    step: int = 0
    samples_seen: int = 0

    def sharded_state_dict(self) -> dict:
        """Model and optimizer state keyed by parameter name (DDP: whole tensors; FSDP: this rank's shards as
        DTensors), for torch.distributed.checkpoint; loading one into the same structure reshards to any world
        size and either parallelism."""
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_sharded_state_dict(self, loaded: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optimizer"])

    def progress(self) -> dict:
        """Collective. All but the model and optimizer tensors: schedule, counters, every rank's RNG, the
        stream's position, the world size."""
        rngs = all_ranks(rng_state())
        return {"scheduler": self.scheduler.state_dict(), "step": self.step, "samples_seen": self.samples_seen,
                "rng": rngs, "world_size": len(rngs), "stream": None if self.stream is None else self.stream.state_dict(),
                "scaler": None if self.scaler is None else self.scaler.state_dict()}

    def load_progress(self, saved: dict) -> None:
        """Schedule, counters, the stream's position; this rank's RNG where the world size is unchanged."""
        self.scheduler.load_state_dict(saved["scheduler"])
        self.step, self.samples_seen = saved["step"], saved["samples_seen"]
        if self.scaler is not None and saved.get("scaler"):  # a run that changed to fp16 starts a new scale
            self.scaler.load_state_dict(saved["scaler"])
        if self.stream is not None:
            self.stream.load_state_dict(saved.get("stream"))
        rank, world_size = rank_and_world_size()
        if len(saved["rng"]) == world_size:
            set_rng_state(saved["rng"][rank])

    def load_legacy_state_dict(self, saved: dict) -> None:
        """The model and optimizer of a step_*.pt checkpoint (DDP, before the one format): whole state dicts."""
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
