"""The training loop: config → world → data → towers → loss backend → step → log / eval / checkpoint."""
from __future__ import annotations

import logging
import math
import random
import signal
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import numpy as np
import open_clip
import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from clipdist import distributed
from clipdist.checkpoint import CheckpointManager, load
from clipdist.config import TrainConfig, to_train_config, validate
from clipdist.data.builtin import builtin_shards
from clipdist.data.pipeline import SkipCounter, expand_shards, train_stream
from clipdist.evaluate import evaluate
from clipdist.grad_cache import build_step
from clipdist.losses import build as build_loss
from clipdist.models import create_model, get_tokenizer
from clipdist.tracking import RunTracker

log = logging.getLogger("clipdist")


class ConfigError(ValueError):
    """A config that cannot run; the message says what to change."""


def run(cfg) -> dict | None:
    """Entry point from train.py: validate, start local ranks if the world preset asks, train."""
    cfg = cfg if isinstance(cfg, TrainConfig) else to_train_config(cfg)
    try:
        validate(cfg)
        build_loss(cfg.loss.name, **cfg.loss.options)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    env = distributed.detect_env()
    if env.launcher == "single" and cfg.world.world_size > 1:
        if not cfg.world.spawn:
            raise ConfigError(
                f"world={cfg.world.name} expects {cfg.world.world_size} processes ({cfg.world.nodes} node(s) × "
                f"{cfg.world.procs_per_node}) but this process was started alone. Launch it with "
                f"`torchrun --nproc-per-node {cfg.world.procs_per_node} train.py world={cfg.world.name}` or srun "
                "(see slurm/), or pick world=local / cpu2 / cpu4"
            )
        resolve_shards(cfg)  # build a built-in dataset once, before the ranks start
        return distributed.launch_local(train, cfg.world.world_size, cfg, timeout_s=cfg.world.timeout_s)[0]
    return train(cfg)


def check_world(cfg: TrainConfig, env: distributed.DistEnv) -> None:
    if env.world_size != cfg.world.world_size:
        raise ConfigError(
            f"world={cfg.world.name} expects {cfg.world.world_size} processes ({cfg.world.nodes} node(s) × "
            f"{cfg.world.procs_per_node}), but {env.launcher} started {env.world_size}. Pick the preset that "
            f"matches the launch, or override world.nodes / world.procs_per_node"
        )


def resolve_device(setting: str, local_rank: int) -> torch.device:
    if setting not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"world.device={setting!r}; choose auto, cpu or cuda")
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("world.device=cuda but no CUDA device is visible; use world=local or world=cpu2")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def resolve_shards(cfg: TrainConfig) -> tuple[str, str | None]:
    """Train and validation shard patterns: a built-in source's cache, or the user's paths."""
    if cfg.data.source:
        return builtin_shards(cfg.data.source, cfg.data.cache_dir, cfg.data.source_dir)
    if not cfg.data.train_shards:
        raise ConfigError("data.train_shards is not set: give your shards, e.g. data.train_shards='/data/{000..099}.tar'")
    return cfg.data.train_shards, cfg.data.val_shards


def autocast_for(precision: str, device: torch.device):
    if precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"precision={precision!r}; choose auto, fp32 or bf16")
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    """AdamW (no weight decay on gains, biases, embeddings' scalars, logit scale/bias) + warmup/cosine."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "logit_" in name or "positional" in name else decay).append(param)
    optim = cfg.optim
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
    )

    def lr_factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        progress = (step - optim.warmup_steps) / max(1, optim.max_steps - optim.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def rng_state() -> dict:
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


def train(cfg: TrainConfig) -> dict | None:
    """Train on this rank (every rank calls it). Returns the last evaluation on rank 0."""
    env = distributed.detect_env()
    check_world(cfg, env)
    device = resolve_device(cfg.world.device, env.local_rank)
    backend = None if cfg.world.backend == "auto" else cfg.world.backend
    distributed.init_process_group(env, backend=backend, timeout_s=cfg.world.timeout_s)
    try:
        return _train(cfg, env, device)
    finally:
        distributed.destroy_process_group()


def _train(cfg: TrainConfig, env: distributed.DistEnv, device: torch.device) -> dict | None:
    # Every rank must agree on the run directory (a ${now:...} name can differ by a second).
    run_dir = Path(distributed.all_ranks(cfg.run_dir)[0])
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    autocast = autocast_for(cfg.precision, device)
    loss_fn = build_loss(cfg.loss.name, **cfg.loss.options)

    if env.local_rank == 0:
        resolve_shards(cfg)  # writes a built-in dataset's shards once per node
    distributed.barrier()
    train_pattern, val_pattern = resolve_shards(cfg)
    train_urls = expand_shards(train_pattern, "data.train_shards")
    val_urls = expand_shards(val_pattern, "data.val_shards") if val_pattern else None

    torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = create_model(cfg.model.name, cfg.model.checkpoint, cfg.model.grad_checkpointing,
                         init_logit_scale=cfg.loss.init_logit_scale,
                         init_logit_bias=cfg.loss.init_logit_bias if loss_fn.uses_logit_bias else None).to(device)
    tokenizer = get_tokenizer(cfg.model.name)
    mean, std = model.visual.preprocess_cfg["mean"], model.visual.preprocess_cfg["std"]
    train_transform = open_clip.image_transform(model.visual.image_size, is_train=cfg.data.augment, mean=mean, std=std)
    val_transform = open_clip.image_transform(model.visual.image_size, is_train=False, mean=mean, std=std)
    optimizer, scheduler = build_optimizer(model, cfg)

    checkpoints = CheckpointManager(run_dir, cfg.keep_checkpoints)
    start_step, samples_seen = 0, 0
    resumed = _resume(cfg, checkpoints)
    if resumed is not None:
        state, path = resumed
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_step, samples_seen = state["step"], state["samples_seen"]
        if len(state["rng"]) == env.world_size:
            set_rng_state(state["rng"][env.rank])
        if env.is_main:
            log.info("resumed from %s at step %d", path, start_step)
    else:
        random.seed(cfg.seed + env.rank)
        np.random.seed(cfg.seed + env.rank)

    ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None) \
        if env.world_size > 1 else model
    if cfg.model.compile:
        ddp_model = torch.compile(ddp_model)

    step_fn = build_step(ddp_model, loss_fn, cfg.grad_cache.chunks_for(cfg.world.batch_per_device), autocast)
    local_batch = cfg.world.batch_per_device
    global_batch = local_batch * env.world_size
    skips = SkipCounter()
    stream = train_stream(
        train_urls, local_batch, train_transform, tokenizer, resampled=cfg.data.resampled, split=cfg.data.split,
        shuffle_buffer=cfg.data.shuffle_buffer, workers=cfg.data.workers, rank=env.rank,
        world_size=env.world_size, seed=cfg.seed + 7919 * start_step, skips=skips,
    )
    tracker = RunTracker(run_dir, cfg.logging.wandb, cfg.logging.project, run_dir.name, asdict(cfg), env.is_main)
    max_logit = math.log(cfg.optim.max_logit_scale)

    def run_eval(step: int) -> dict | None:
        metrics = None
        if env.is_main and val_urls:
            metrics = evaluate(model, tokenizer, val_urls, val_transform, cfg.data.classnames, cfg.data.templates,
                               device, autocast=autocast)
            metrics["train_skipped"] = skips.count
            tracker.log_eval(metrics, step)
            progress.write(f"step {step}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                       for k, v in metrics.items()))
        distributed.barrier()
        return metrics

    def save(step: int) -> None:
        rngs = distributed.all_ranks(rng_state())
        if env.is_main:
            checkpoints.save({
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "step": step, "samples_seen": samples_seen,
                "rng": rngs, "config": asdict(cfg), "world_size": env.world_size,
            }, step)
        distributed.barrier()

    progress = tqdm(total=cfg.optim.max_steps, initial=start_step, disable=not (env.is_main and cfg.logging.progress),
                    dynamic_ncols=True, mininterval=1.0, desc=f"train {cfg.loss.name} ×{env.world_size}")
    stop = StopSignal()
    metrics = None
    step, bad_steps, skipped_steps = start_step, 0, 0
    step_time = time.perf_counter()
    try:
        if step >= cfg.optim.max_steps and env.is_main:
            progress.write(f"run {run_dir} is already complete at step {step} (optim.max_steps="
                           f"{cfg.optim.max_steps}); raise optim.max_steps to train on, or set name= for a new run")
        while step < cfg.optim.max_steps:
            images, tokens = next(stream)
            loss = step_fn.loss(images.to(device), tokens.to(device))
            # One collective gives every rank the global loss and whether any rank was signalled,
            # so all ranks skip, stop or step together.
            agreed = distributed.all_reduce_mean(torch.stack([loss.detach().float().cpu(), stop.flag()]).to(device))
            global_loss, stopping = agreed[0].item(), agreed[1].item() > 0
            if stopping:
                save(step)
                progress.write(f"stopped by a signal at step {step}: checkpoint written to {checkpoints.directory}; "
                               "run again with resume=auto to continue")
                break
            if not math.isfinite(global_loss):
                bad_steps += 1
                skipped_steps += 1
                progress.write(f"step {step + 1}: non-finite loss, step skipped ({bad_steps} in a row)")
                if bad_steps >= cfg.max_nonfinite_steps:
                    save(step)
                    raise TrainingDiverged(
                        f"{bad_steps} non-finite losses in a row (max_nonfinite_steps={cfg.max_nonfinite_steps}); "
                        f"the last good state (step {step}) is saved in {checkpoints.directory}. Lower optim.lr, "
                        "check the data, or raise max_nonfinite_steps"
                    )
                continue
            bad_steps = 0
            optimizer.zero_grad(set_to_none=True)
            step_fn.backward(loss)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
            optimizer.step()
            scheduler.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, max_logit)
            samples_seen += global_batch
            step += 1

            now = time.perf_counter()
            seconds, step_time = now - step_time, now
            stats = {"loss": global_loss, "lr": scheduler.get_last_lr()[0],
                     "logit_scale": model.logit_scale.exp().item(),
                     **({"logit_bias": model.logit_bias.item()} if loss_fn.uses_logit_bias else {}),
                     "samples_per_s": global_batch / seconds, "samples_per_s_per_device": local_batch / seconds}
            progress.update(1)
            progress.set_postfix(loss=f"{global_loss:.3f}", samples_s=f"{stats['samples_per_s']:.0f}",
                                 lr=f"{stats['lr']:.2e}", scale=f"{stats['logit_scale']:.1f}", refresh=False)
            if step % cfg.logging.log_every == 0:
                tracker.log_train({**stats, "grad_norm": float(grad_norm), "samples_seen": samples_seen,
                                   "skipped_samples": skips.count, "skipped_steps": skipped_steps}, step)
            if step % cfg.eval_every == 0 or step == cfg.optim.max_steps:
                metrics = run_eval(step)
            if step % cfg.checkpoint_every == 0 or step == cfg.optim.max_steps:
                save(step)
    finally:
        stop.restore()
        progress.close()
        tracker.finish()
    return metrics


class TrainingDiverged(RuntimeError):
    """Too many non-finite losses in a row; the last good state has been checkpointed."""


class StopSignal:
    """SIGTERM / SIGUSR1 (preemption, SLURM's --signal) ask for a checkpoint and a clean exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: int | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, _frame) -> None:
        self.received = signum

    def flag(self) -> torch.Tensor:
        return torch.tensor(0.0 if self.received is None else 1.0)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _resume(cfg: TrainConfig, checkpoints: CheckpointManager):
    if cfg.resume == "auto":
        return checkpoints.load_latest()
    if cfg.resume == "never":
        existing = checkpoints.checkpoints()
        if existing:
            raise ConfigError(
                f"{checkpoints.directory} already holds {existing[0].name}; resume=never would overwrite that run. "
                "Use resume=auto to continue it, or name=<new name> for a new run"
            )
        return None
    path = Path(cfg.resume)
    if not path.is_file():
        raise ConfigError(f"resume={cfg.resume!r}: no such checkpoint file (use auto, never, or a path)")
    return load(path), path
