"""Training: config → checks → world → components → the loop (step, log, evaluate, checkpoint).

    run(cfg)                 checks the whole config before any rank starts, then starts the ranks
    train(cfg, shards)       on every rank: process group, Trainer(...).fit()
    Trainer.__init__         every component built from config, in one place
    Trainer.fit              the loop, top to bottom
"""
from __future__ import annotations

import hashlib
import logging
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import open_clip
import torch
from torch.profiler import record_function
from tqdm import tqdm

from clipdist import distributed
from clipdist.checkpoint import Checkpointer, StopRequested
from clipdist.config import Device, Precision, TrainConfig, as_dict, to_train_config, validate
from clipdist.data.faults import DataError, DataFailure
from clipdist.data.pipeline import check_shard_count, close_stream, first_eval_record, train_stream
from clipdist.data.sources import EvalSet, Shards, resolve_shards
from clipdist.errors import ConfigError, TrainingDiverged
from clipdist.evaluate import evaluate
from clipdist.grad_cache import build_step
from clipdist.losses import build as build_loss
from clipdist.models import create_model, create_model_for_loss, get_tokenizer, resolve_model_name
from clipdist.run_dir import RunLock, rewind_jsonl, write_record
from clipdist.state import TrainState, seed_everything
from clipdist.tracking import RunTracker, StepProfiler

log = logging.getLogger("clipdist")


def run(cfg, overrides: list[str] = ()) -> dict | None:
    """Entry point: check everything the config alone can tell, claim the run directory, then train
    here or on spawned local ranks. `overrides` (the command line) go into the run's record."""
    cfg = to_train_config(cfg)
    env = distributed.detect_env()
    shards = preflight(cfg, env)
    if not env.is_main:
        return train(cfg, shards)
    with RunLock(cfg.run_dir):
        warning = Checkpointer.check_resume(cfg, cfg.world.world_size)  # again, now that no one else can write
        if warning:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        write_record(cfg.run_dir, as_dict(cfg), list(overrides))
        if env.launcher == "single" and cfg.world.world_size > 1:
            return distributed.launch_local(train, cfg.world.world_size, cfg, shards,
                                            timeout_s=cfg.world.timeout_s)[0]
        return train(cfg, shards)


def preflight(cfg: TrainConfig, env: distributed.DistEnv) -> Shards:
    """Every check that needs no process group, before any rank starts; ConfigError says what to change."""
    validate(cfg)
    world = cfg.world
    launched_alone = env.launcher == "single" and world.world_size > 1
    if launched_alone and not world.spawn:
        raise ConfigError(
            f"world={world.name} expects {world.world_size} processes ({world.nodes} node(s) × "
            f"{world.procs_per_node}) but this process was started alone. Launch it with "
            f"`torchrun --nproc-per-node {world.procs_per_node} train.py world={world.name}` or srun "
            "(see slurm/), or pick world=local / cpu2 / cpu4"
        )
    if not launched_alone and env.world_size != world.world_size:
        raise ConfigError(
            f"world={world.name} expects {world.world_size} processes ({world.nodes} node(s) × "
            f"{world.procs_per_node}), but {env.launcher} started {env.world_size}. Pick the preset that "
            f"matches the launch, or override world.nodes / world.procs_per_node"
        )
    if world.device == Device.cuda and not torch.cuda.is_available():
        raise ConfigError(f"world.device=cuda (world={world.name}) but no CUDA device is visible; "
                          "use world=local or world=cpu2, or world.device=cpu")
    Checkpointer.check_resume(cfg, world.world_size)
    try:
        resolve_model_name(cfg.model.name)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if world.parallel == "fsdp":
        check_shardable(cfg.model.name)
    try:
        shards = resolve_shards(cfg.data)
        check_shard_count(len(shards.train), world.world_size, cfg.data.workers, resampled=cfg.data.resampled,
                          split=cfg.data.split)
    except (ValueError, FileNotFoundError) as error:
        raise ConfigError(str(error)) from None
    for evalset in shards.evals:
        check_eval_set(evalset)
    return shards


def check_shardable(model_name: str) -> None:
    """world.parallel=fsdp shards the towers block by block: the model must have transformer blocks
    (built on the meta device: the structure alone, no memory)."""
    try:
        model = create_model(model_name, device="meta")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if not distributed.transformer_blocks(model):
        raise ConfigError(f"world.parallel=fsdp: model {model_name} has no transformer blocks (module lists named "
                          f"{', '.join(distributed.BLOCK_LISTS)}) for fully_shard; use world.parallel=ddp")


def check_eval_set(evalset: EvalSet) -> None:
    """Read the first sample of an evaluation set now, so a bad path or layout fails before training
    (not after the last step): it must decode, and have a caption or a label that has a class name."""
    what = evalset.key
    try:
        _, captions, label = first_eval_record(evalset.urls)
    except Exception as error:  # noqa: BLE001 -- whatever reading raised is the message
        raise ConfigError(f"{what}: cannot read its first sample: {error}") from None
    if label >= 0 and not captions and not evalset.classnames:
        raise ConfigError(f"{what}: samples have labels but no captions, and the set has no class names: put "
                          "classnames.txt (one name per line, in label order) beside the shards, or set data.classnames")
    if evalset.classnames and label >= len(evalset.classnames):
        raise ConfigError(f"{what}: a sample has label {label} but there are {len(evalset.classnames)} class names")


def train(cfg: TrainConfig, shards: Shards) -> dict | None:
    """Train on this rank (every rank calls it). Returns the last evaluation on rank 0."""
    env = distributed.detect_env()
    threads, source = distributed.intra_op_threads(cfg.world.threads, cfg.world.procs_per_node, cfg.data.workers)
    torch.set_num_threads(threads)
    if env.is_main:
        log.info("%d intra-op thread(s) per rank (%s)", threads, source)
    device = select_device(cfg.world.device, env.local_rank)
    if device.type == "cpu" and distributed.keep_freed_memory() and env.is_main:
        log.info("malloc keeps freed memory for reuse (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = 1 GiB, 2 GiB)")
    backend = None if cfg.world.backend == "auto" else str(cfg.world.backend)
    distributed.init_process_group(env, backend=backend, timeout_s=cfg.world.timeout_s,
                                   rendezvous_timeout_s=cfg.world.rendezvous_timeout_s,
                                   single=cfg.world.parallel == "fsdp")
    try:
        return Trainer(cfg, shards, env, device).fit()
    finally:
        distributed.destroy_process_group()


def select_device(setting: Device, local_rank: int) -> torch.device:
    if setting == Device.cuda or (setting == Device.auto and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def uses_bf16(precision: Precision, device: torch.device) -> bool:
    return precision == Precision.bf16 or (precision == Precision.auto and device.type == "cuda")


def autocast_for(precision: Precision, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if uses_bf16(precision, device) else nullcontext()


def build_optimizer(model: torch.nn.Module, optim):
    """AdamW (no weight decay on gains, biases, logit scale/bias, positional embeddings) + warmup/cosine."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "logit_" in name or "positional" in name else decay).append(param)
    # The fused kernel (CPU and CUDA) updates all parameters in one call: for a small model on the CPU the
    # default per-parameter loop costs ~15x more (26.5 vs 1.8 ms a step for clipdist-tiny's 62 tensors).
    fused = all(param.device.type in ("cpu", "cuda") and param.is_floating_point() for param in decay + no_decay)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, fused=fused or None,
    )

    def lr_factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        progress = (step - optim.warmup_steps) / max(1, optim.max_steps - optim.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def clip_gradients(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Scale all gradients so their global norm is at most `max_norm` (0: no clipping); the norm before.
    Under FSDP each rank holds a shard of every gradient (DTensors): the norm is reduced over ranks."""
    grads = [param.grad for param in model.parameters() if param.grad is not None]
    norm = distributed.full_tensor(torch.nn.utils.get_total_norm(grads, foreach=True))
    if max_norm:
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm, foreach=True)
    return norm


class Trainer:
    """One rank's run: components built from config, then `fit`, a plain loop."""

    def __init__(self, cfg: TrainConfig, shards: Shards, env: distributed.DistEnv, device: torch.device):
        self.cfg, self.shards, self.env, self.device = cfg, shards, env, device
        # Every rank must agree on the run directory (a ${now:...} name resolved per process can differ).
        self.run_dir = Path(distributed.all_ranks(cfg.run_dir)[0])
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.autocast = autocast_for(cfg.precision, device)
        self.loss_fn = build_loss(cfg.loss.name, **cfg.loss.options())

        torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
        self.model = create_model_for_loss(
            cfg.model.name, self.loss_fn, init_logit_scale=cfg.loss.init_logit_scale,
            init_logit_bias=cfg.loss.init_logit_bias, checkpoint=cfg.model.checkpoint,
            grad_checkpointing=cfg.model.grad_checkpointing,
        ).to(device)
        self.tokenizer = get_tokenizer(cfg.model.name)
        # Wrapped before the optimizer is built: under FSDP the parameters become this rank's shards,
        # gathered in bf16 on CUDA where autocast computes in bf16 (gradients are reduced in fp32).
        gathered_dtype = torch.bfloat16 if device.type == "cuda" and uses_bf16(cfg.precision, device) else None
        self.train_model = distributed.wrap_model(self.model, parallel=str(cfg.world.parallel), compile=cfg.model.compile,
                                                  param_dtype=gathered_dtype)
        self.sharded = distributed.is_sharded(self.model)
        optimizer, scheduler = build_optimizer(self.model, cfg.optim)
        self.state = TrainState(self.model, optimizer, scheduler)
        self.checkpointer = Checkpointer(cfg, self.run_dir, env)
        self.resumed_from = self.checkpointer.restore(self.state)
        if self.resumed_from is None:
            seed_everything(cfg.seed + env.rank)
        if env.is_main:  # the logs hold no step twice: what comes after the checkpoint will be logged again
            for log_file in ("train_log.jsonl", "metrics.jsonl"):
                rewind_jsonl(self.run_dir / log_file, self.state.step)

        self.step_fn = build_step(self.train_model, self.loss_fn, cfg.grad_cache.chunks_for(cfg.world.batch_per_device),
                                  self.autocast)

        visual = self.model.visual
        mean, std = visual.preprocess_cfg["mean"], visual.preprocess_cfg["std"]
        self.val_transform = open_clip.image_transform(visual.image_size, is_train=False, mean=mean, std=std)
        self.eval_errors = 0
        self.shown_scale = "-"  # the logit scale on the progress bar, as last logged
        saved = self.state.data or {}
        self.skipped_samples = saved.get("skipped_samples", 0)
        self.source_samples = saved.get("source_samples") or [0] * len(shards.sources)
        if len(self.source_samples) != len(shards.sources):
            self.source_samples = [0] * len(shards.sources)
        self.data_layout = self._data_layout()
        position, stream_seed, self.data_warning = self._data_resume()
        self.data_readers = dict(position["readers"]) if position else {}
        self.data_batches = position["batches"] if position else 0
        low_priority, why = distributed.low_priority_workers(str(cfg.data.worker_priority), self.device.type,
                                                             cfg.world.procs_per_node, cfg.data.workers)
        if env.is_main and cfg.data.workers:
            log.info("loader workers at %s priority (%s)", "idle" if low_priority else "normal", why)
        self.batches = train_stream(
            shards.sources, cfg.world.batch_per_device,
            open_clip.image_transform(visual.image_size, is_train=cfg.data.augment, mean=mean, std=std),
            self.tokenizer, resampled=cfg.data.resampled, split=cfg.data.split, shuffle_buffer=cfg.data.shuffle_buffer,
            workers=cfg.data.workers, rank=env.rank, world_size=env.world_size, seed=stream_seed,
            weights=cfg.data.weights, max_skips_in_a_row=cfg.data.max_skips_in_a_row, resume=position,
            low_priority_workers=low_priority,
        )
        self.tracker = RunTracker(self.run_dir, cfg.logging.wandb, cfg.logging.project, self.run_dir.name,
                                  as_dict(cfg), env.is_main)
        self.progress = tqdm(total=cfg.optim.max_steps, initial=self.state.step, dynamic_ncols=True, mininterval=1.0,
                             disable=not (env.is_main and cfg.logging.progress),
                             desc=f"train {cfg.loss.name} ×{env.world_size}")

    def _data_layout(self) -> dict:
        """What a saved data position depends on: it is resumed exactly only when all of this is unchanged."""
        data = self.cfg.data
        shards = "\n::\n".join("\n".join(urls) for urls in self.shards.sources)
        return {"world_size": self.env.world_size, "workers": data.workers, "split": str(data.split),
                "resampled": data.resampled, "seed": self.cfg.seed, "shuffle_buffer": data.shuffle_buffer,
                "weights": list(data.weights) if data.weights else None,
                "shards": hashlib.sha1(shards.encode()).hexdigest()}

    def _data_resume(self) -> tuple[dict | None, int, str | None]:
        """(this rank's saved stream position or None, the stream's seed, a warning for the user or None).

        Same layout: the stream continues sample for sample. Otherwise (another world size, worker
        count, shard list, seed, ...) it restarts reshuffled, seeded by the step, at the same global
        sample count — said in one warning."""
        cfg, saved = self.cfg, self.state.data
        if self.resumed_from is None:
            return None, cfg.seed, None
        if saved and saved.get("layout") == self.data_layout:
            return saved["ranks"][self.env.rank], cfg.seed, None
        if not saved or "layout" not in saved:
            reason = "the checkpoint holds no data position (written by an older clipdist)"
        else:
            changed = [key for key, value in self.data_layout.items() if saved["layout"].get(key) != value]
            reason = "changed since the checkpoint: " + ", ".join(
                f"{key} {saved['layout'].get(key)} -> {self.data_layout[key]}" if key != "shards" else "the shard list"
                for key in changed)
        return None, cfg.seed + 7919 * self.state.step, (
            f"warning: the data stream cannot continue sample for sample ({reason}); it restarts reshuffled "
            f"at sample {self.state.samples_seen}, so samples already seen in this epoch may come again")

    def data_position(self) -> dict:
        """Collective: every rank's readers' positions after the batches trained on, and the totals."""
        return {"layout": self.data_layout, "skipped_samples": self.skipped_samples,
                "source_samples": list(self.source_samples),
                "ranks": distributed.all_ranks({"readers": self.data_readers, "batches": self.data_batches})}

    def checkpoint(self) -> None:
        """Collective: the checkpoint of the state after the last step, with the data stream's position."""
        self.state.data = self.data_position()
        self.checkpointer.save(self.state)

    def say(self, message: str) -> None:
        """A line on the console from rank 0 (through tqdm, so the progress bar stays intact)."""
        if self.env.is_main:
            self.progress.write(message)

    @property
    def global_batch(self) -> int:
        return self.cfg.world.batch_per_device * self.env.world_size

    def fit(self) -> dict | None:
        cfg, state, checkpointer = self.cfg, self.state, self.checkpointer
        metrics, bad_steps, skipped_steps = None, 0, 0
        if self.resumed_from is not None:
            self.say(f"resumed from {self.resumed_from} at step {state.step}")
        if self.data_warning:
            self.say(self.data_warning)
        if state.step >= cfg.optim.max_steps:
            self.say(f"run {self.run_dir} is already complete at step {state.step} (optim.max_steps="
                                f"{cfg.optim.max_steps}); raise optim.max_steps to train on, or set name= for a new run")
        profiler = StepProfiler(self.run_dir, self.env.rank, cfg.logging.profile_steps, cfg.logging.profile_wait)
        try:
            while state.step < cfg.optim.max_steps:
                started = time.perf_counter()
                profiler.step()
                with record_function("data"):
                    images, tokens, info = self.next_batch()
                with record_function("forward_and_loss"):
                    loss = self.step_fn.loss(images.to(self.device), tokens.to(self.device))
                # One collective gives every rank the global loss, whether any rank was signalled or is due
                # a timed checkpoint, and the samples skipped and read per source on all ranks, so all ranks
                # skip, stop, save or step together.
                with record_function("agree"):
                    agreed = distributed.all_reduce_mean(torch.cat([
                        torch.stack([loss.detach().float().cpu(), checkpointer.stop.flag(), checkpointer.time_flag()]),
                        torch.tensor([info["skipped"], *info["sources"]], dtype=torch.float32),
                    ]).to(self.device)).tolist()
                global_loss, stopping, time_due = agreed[0], agreed[1] > 0, agreed[2] > 0
                if stopping:  # this step's batch is not trained on: the saved position is before it
                    self.checkpoint()
                    self.say(f"stopped by a signal at step {state.step}: checkpoint written to "
                             f"{checkpointer.directory}; run again with resume=auto to continue")
                    break
                counts = [round(value * self.env.world_size) for value in agreed[3:]]
                self.skipped_samples += counts[0]
                self.source_samples = [total + count for total, count in zip(self.source_samples, counts[1:])]
                self.data_readers[info["reader"]] = info["state"].state
                self.data_batches += 1
                if not math.isfinite(global_loss):
                    bad_steps, skipped_steps = bad_steps + 1, skipped_steps + 1
                    self.say(f"step {state.step + 1}: non-finite loss, step skipped ({bad_steps} in a row)")
                    if bad_steps >= cfg.max_nonfinite_steps:
                        self.checkpoint()
                        raise TrainingDiverged(
                            f"{bad_steps} non-finite losses in a row (max_nonfinite_steps={cfg.max_nonfinite_steps}); "
                            f"the last good state (step {state.step}) is saved in {checkpointer.directory}. Lower "
                            "optim.lr, check the data, or raise max_nonfinite_steps")
                    continue
                bad_steps = 0
                grad_norm = self.optimize(loss)
                seconds = time.perf_counter() - started  # the step alone: evaluation and checkpoints excluded
                self.log_step(global_loss, grad_norm, seconds, skipped_steps)
                if checkpointer.due(state.step) or time_due:  # before evaluating: an evaluation never costs a step
                    self.checkpoint()
                if state.step % cfg.eval_every == 0 or state.step == cfg.optim.max_steps:
                    metrics = self.evaluate()
        finally:
            profiler.stop()
            close_stream(self.batches)
            checkpointer.close()
            self.progress.close()
            self.tracker.finish()
        return metrics

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """This rank's next (images, tokens, info) (see pipeline.TrainingBatches). A stop signal while waiting
        gives zeros of the batch's shape instead: the step's collectives still match on every rank, and its
        all-reduce stops them."""
        try:
            with self.checkpointer.stop.interruptible():
                batch = next(self.batches)
        except StopRequested:
            size = self.model.visual.image_size
            height, width = (size, size) if isinstance(size, int) else size
            rows = self.cfg.world.batch_per_device
            return (torch.zeros(rows, 3, height, width), torch.zeros(rows, self.tokenizer.context_length, dtype=torch.long),
                    {"skipped": 0, "sources": [0] * len(self.shards.sources)})
        if isinstance(batch, DataFailure):
            raise DataError(f"rank {self.env.rank}: {batch.message}")
        return batch

    def optimize(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward (DDP averages gradients), clip, AdamW, schedule, clamp the logit scale; one step done."""
        state = self.state
        state.optimizer.zero_grad(set_to_none=True)
        with record_function("backward"):
            self.step_fn.backward(loss)
        with record_function("optimizer"):
            grad_norm = clip_gradients(self.model, self.cfg.optim.grad_clip)
            state.optimizer.step()
            state.scheduler.step()
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, math.log(self.cfg.optim.max_logit_scale))
        state.samples_seen += self.global_batch
        state.step += 1
        return grad_norm

    def log_step(self, global_loss: float, grad_norm: torch.Tensor, seconds: float, skipped_steps: int) -> None:
        """Progress bar every step; train_log.jsonl / W&B every log_every steps. The values that need a
        device-to-host copy (logit scale and bias, grad norm) are read only then: on a GPU each is a sync."""
        state, model = self.state, self.model
        stats = {"loss": global_loss, "lr": state.scheduler.get_last_lr()[0], "samples_per_s": self.global_batch / seconds,
                 "samples_per_s_per_device": self.cfg.world.batch_per_device / seconds}
        self.progress.update(1)
        if state.step % self.cfg.logging.log_every == 0:
            stats["logit_scale"] = model.logit_scale.exp().item()
            if self.loss_fn.uses_logit_bias:
                stats["logit_bias"] = model.logit_bias.item()
            sources = {"source_samples": list(self.source_samples)} if len(self.source_samples) > 1 else {}
            self.tracker.log_train({**stats, "grad_norm": float(grad_norm), "samples_seen": state.samples_seen,
                                    "skipped_samples": self.skipped_samples, "skipped_steps": skipped_steps, **sources},
                                   state.step)
            self.shown_scale = f"{stats['logit_scale']:.1f}"
        self.progress.set_postfix(loss=f"{global_loss:.3f}", samples_s=f"{stats['samples_per_s']:.0f}",
                                  lr=f"{stats['lr']:.2e}", scale=self.shown_scale, refresh=False)

    def evaluate(self) -> dict | None:
        """Every evaluation set on rank 0 (the other ranks wait; under FSDP they run it alongside, since
        every forward gathers the sharded weights from all ranks). A set that fails is logged and counted
        (eval_errors) and training goes on: evaluation never stops a run."""
        metrics = None
        if self.shards.evals and (self.env.is_main or self.sharded):  # FSDP: every rank gathers the weights
            metrics = {}
            for evalset in self.shards.evals:
                try:
                    metrics.update(evaluate(self.model, self.tokenizer, evalset, self.val_transform, self.device,
                                            autocast=self.autocast,
                                            max_skips_in_a_row=self.cfg.data.max_skips_in_a_row))
                except Exception as error:  # noqa: BLE001 -- any failure of an evaluation is reported, not fatal
                    self.eval_errors += 1
                    if self.env.is_main:
                        log.warning("step %d: evaluation of %s failed (%s: %s); training goes on (eval_errors=%d)",
                                    self.state.step, evalset.name, type(error).__name__, error, self.eval_errors)
            metrics.update(train_skipped=self.skipped_samples, eval_errors=self.eval_errors)
            if not self.env.is_main:
                metrics = None
        if metrics is not None:
            self.tracker.log_eval(metrics, self.state.step)
            self.say(f"step {self.state.step}: " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()))
        distributed.barrier()
        return metrics
