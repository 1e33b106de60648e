"""TrainState: everything a run needs to continue where it stopped, saved and restored in one place."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict, set_state_dict

from clipdist.defaults import MAX_SEED
from clipdist.distributed.parallel import rank_and_world_size

RNG_KEY = "rank_{:05d}"  # a rank's generators among a checkpoint's tensors (rng.<key>.*: written by that rank)


def rng_tensors() -> dict[str, torch.Tensor]:
    """This process's Python, NumPy, torch (and CUDA) generator states as tensors, for the DCP folder (each rank
    writes its own: progress.pt does not grow with the world). python: [version, the 625 words], python_gauss: [its
    spare gauss, whether there is one]; numpy: [the 624
    keys, position, has_gauss], numpy_gauss: [cached]; torch (and cuda): the generators' bytes."""
    version, internal, gauss = random.getstate()
    _, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "python": torch.tensor([version, *internal], dtype=torch.int64),
        "python_gauss": torch.tensor([0.0 if gauss is None else gauss, float(gauss is not None)], dtype=torch.float64),
        "numpy": torch.tensor([*np.asarray(keys).tolist(), position, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([cached], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def rng_state_of(tensors: dict[str, torch.Tensor]) -> dict:
    """rng_tensors undone, as set_rng_state takes it."""
    python = tensors["python"].tolist()
    gauss, has_gauss_python = tensors["python_gauss"].tolist()
    numpy = tensors["numpy"].tolist()
    state = {
        "python": (python[0], tuple(python[1:]), gauss if has_gauss_python else None),
        "numpy": ("MT19937", numpy[:-2], numpy[-2], numpy[-1], float(tensors["numpy_gauss"][0])),
        "torch": tensors["torch"],
    }
    if "cuda" in tensors:
        state["cuda"] = tensors["cuda"]
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def host_rng_state() -> dict:
    """Python's, NumPy's and torch's CPU generators, as set_rng_state takes them (not CUDA's: the data path never
    draws from it, and reading it is a device call)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's generators from `seed` (a run's seed + rank: NumPy's 32 bits taken from it)."""
    random.seed(seed)
    np.random.seed(seed % (MAX_SEED + 1))
    torch.manual_seed(seed)


@dataclass
class TrainState:
    """The stateful parts of a run — model, optimizer, schedule, data stream, gradient scaler — with its step,
    samples seen and every rank's RNG. `progress` (progress.pt) holds what does not grow with the world: schedule,
    counters, the stream's layout and position; each rank's generators and the stream's readers go with the tensors
    (`sharded_state_dict`'s "rng" and "data", each rank writing its own). Loading restores this rank's part:
    `load_progress` first, which says the readers it needs (`reader_keys`)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR  # optim.schedules.lr_factor's
    stream: Any = None  # a TrainStream (state_dict / load_state_dict), or None where there is no data
    scaler: Any = None  # precision=fp16's gradient scaler (its scale and growth count), or None
    ema: Any = None  # optim.ema's weight average (optim.ema.WeightAverage: state_dict, reset), or None
    step: int = 0
    samples_seen: int = 0
    saved_world_size: int | None = None  # the loaded checkpoint's (load_progress)

    def sharded_state_dict(self) -> dict:
        """Model and optimizer state keyed by parameter name (DDP: whole tensors; FSDP: this rank's shards as
        DTensors), for torch.distributed.checkpoint; loading one into the same structure reshards to any world
        size and either parallelism."""
        model, optimizer = get_state_dict(self.model, self.optimizer)
        shards = {
            "model": model,
            "optimizer": optimizer,
            "rng": {RNG_KEY.format(rank_and_world_size()[0]): rng_tensors()},
        }
        if self.stream is not None:  # the readers' positions: each rank writes those it reads, one copy is kept
            shards["data"] = self.stream.reader_tensors()
        if self.ema is not None:  # the weight average, sharded as the weights
            shards["ema"] = self.ema.state_dict()
        return shards

    def sharded_state_dict_to_load(self, sizes: dict[str, torch.Size]) -> dict:
        """sharded_state_dict with room for what this rank takes from a checkpoint after load_progress, at the sizes
        its metadata gives (`sizes`: flattened key -> size): the readers it needs (one the checkpoint lacks is left
        out: the stream says which it missed) and its own generators where the world size is the saved one."""
        shards = self.sharded_state_dict()
        # the optimizer's per-parameter state only: its groups and hyperparameters are the config's (_follow_config)
        shards["optimizer"] = {"state": shards["optimizer"]["state"]}
        if "ema" in shards and not any(name.startswith("ema.") for name in sizes):
            del shards["ema"]  # a checkpoint without an average: it starts at the loaded weights
        rank, world_size = rank_and_world_size()
        key = RNG_KEY.format(rank)
        parts = [name.rsplit(".", 1)[1] for name in sizes if name.startswith(f"rng.{key}.")]
        shards["rng"] = (
            {
                key: {
                    part: torch.empty(
                        sizes[f"rng.{key}.{part}"],
                        dtype=torch.uint8
                        if part in ("torch", "cuda")
                        else torch.float64
                        if part.endswith("gauss")
                        else torch.int64,
                    )
                    for part in parts
                }
            }
            if parts and self.saved_world_size == world_size
            else {}
        )
        if self.stream is not None:
            shards["data"] = {
                key: {
                    part: torch.empty(sizes[f"data.{key}.{part}"], dtype=torch.int64)
                    for part in ("counts", "rng", "buffer")
                }
                for key in self.stream.reader_keys()
                if f"data.{key}.counts" in sizes
            }
        return shards

    def load_sharded_state_dict(self, loaded: dict) -> None:
        groups = get_optimizer_state_dict(self.model, self.optimizer)["param_groups"]  # this run's, by name
        optimizer = {"state": loaded["optimizer"]["state"], "param_groups": groups}
        set_state_dict(self.model, self.optimizer, model_state_dict=loaded["model"], optim_state_dict=optimizer)
        if self.ema is not None and "ema" not in loaded:
            self.ema.reset()
        for generators in loaded.get("rng", {}).values():  # this rank's, where the world size is the saved one
            set_rng_state(rng_state_of(generators))
        if self.stream is not None and loaded.get("data"):
            self.stream.load_reader_tensors(loaded["data"])

    def progress(self) -> dict:
        """All but the tensors: schedule, counters, the stream's layout and position, the world size. Nothing in
        it grows with the world (each rank's generators and readers are tensors: sharded_state_dict)."""
        stream = None if self.stream is None else self.stream.state_dict()
        if stream is not None:
            stream.pop("readers", None)  # in the DCP folder (sharded_state_dict's "data"): linear in a rank's readers
        return {
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "samples_seen": self.samples_seen,
            "world_size": rank_and_world_size()[1],
            "stream": stream,
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
        }

    def load_progress(self, saved: dict) -> None:
        """Schedule, counters, the stream's position; this rank's RNG where the world size is unchanged."""
        built = list(self.scheduler.base_lrs)  # optim.lr and its multipliers as this run's config gives them
        self.scheduler.load_state_dict(saved["scheduler"])
        self.scheduler.base_lrs = built
        self._follow_config()
        self.step, self.samples_seen = saved["step"], saved["samples_seen"]
        if self.scaler is not None and saved.get("scaler"):  # a run that changed to fp16 starts a new scale
            self.scaler.load_state_dict(saved["scaler"])
        if self.stream is not None:
            self.stream.load_state_dict(saved.get("stream"))
        rank, world_size = rank_and_world_size()
        self.saved_world_size = saved.get("world_size")
        if len(saved.get("rng", ())) == world_size:  # a checkpoint of the days every rank's RNG was in progress.pt
            set_rng_state(saved["rng"][rank])

    def load_legacy_state_dict(self, saved: dict) -> None:
        """The model and optimizer of a step_*.pt checkpoint (DDP, before the one format): whole state dicts."""
        self.model.load_state_dict(saved["model"])
        kept = [
            {key: value for key, value in group.items() if key != "params"} for group in self.optimizer.param_groups
        ]
        self.optimizer.load_state_dict(saved["optimizer"])
        for group, values in zip(self.optimizer.param_groups, kept):  # the groups load_progress set (_follow_config)
            group.update(values)

    def _follow_config(self) -> None:
        """The optimizer's hyperparameters and the schedule's rates are this run's config, not the checkpoint's
        (optim.lr, weight_decay, betas, eps, the layer decays and the terms' head_lr are free to change on resume:
        config.resume_rule): each group's lr set to its base rate times the schedule at the step the checkpoint
        reached. The checkpoint gives the per-parameter state (Adam's moments and step count), loaded after this into
        these groups, and the schedule's position."""
        scheduler, step = self.scheduler, self.scheduler.last_epoch
        rates = [base * rule(step) for base, rule in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
        for group, rate in zip(self.optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        scheduler._last_lr = rates  # what get_last_lr() gives: the next step's rate
