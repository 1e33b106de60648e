"""One rank's training: components → the loop (step, log, evaluate, checkpoint); train.entry starts it.

Trainer.__init__         every component built from config, in one place
Trainer.fit              the loop, top to bottom
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.profiler import record_function
from tqdm import tqdm

from clipdist import console
from clipdist.checkpoint.manager import Checkpointer
from clipdist.checkpoint.run_dir import log_sample_keys, rewind_logs
from clipdist.checkpoint.state import TrainState, host_rng_state, seed_everything, set_rng_state
from clipdist.config import TrainConfig, as_dict
from clipdist.data.batch import Batch, rows_consumed
from clipdist.distributed import launch, parallel
from clipdist.errors import TrainingDiverged
from clipdist.objective.signal import SignalWatch
from clipdist.tracking import RunTracker, StepProfiler, logs_step
from clipdist.train import startup
from clipdist.train.evaluate import evaluate
from clipdist.train.parts import build_parts

if TYPE_CHECKING:  # annotations only
    from clipdist.data.sources import Shards
    from clipdist.data.workers import LoaderPlan

log = logging.getLogger("clipdist")


class Trainer:
    """One rank's run: components built from config (build_parts, the stream, the checkpointer, the tracker),
    then `fit`, a plain loop."""

    def __init__(self, cfg: TrainConfig, shards: Shards, env: launch.DistEnv, device: torch.device, plan: LoaderPlan):
        self.cfg, self.shards, self.env, self.device = cfg, shards, env, device
        # Every rank must agree on the run directory (a ${now:...} name resolved per process can differ).
        self.run_dir = Path(parallel.all_ranks(cfg.run_dir)[0])
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        parts = build_parts(cfg, device, env.local_rank)
        self.autocast, self.loss_fn, self.model, self.tokenizer = (
            parts.autocast,
            parts.loss_fn,
            parts.model,
            parts.tokenizer,
        )
        self.train_model, self.scaler, self.step = parts.train_model, parts.scaler, parts.step
        self.compiled, self.cache_admitted, self.first_step_said = parts.compiled, parts.cache_admitted, False
        self.signal = SignalWatch()  # the teacher terms' targets: a warning where they collapse
        self.val_transform = parts.val_transform
        self.sharded = parallel.is_sharded(self.model)
        optimizer, scheduler, train_transform = parts.optimizer, parts.scheduler, parts.train_transform
        self.stream = startup.build_stream(self, plan, train_transform, self.say)
        self.state = TrainState(self.model, optimizer, scheduler, self.stream, scaler=self.scaler, ema=parts.ema)
        self.checkpointer = Checkpointer(cfg, self.run_dir, env, compile_cache=parts.compile_cache)
        self.resumed_from = self.checkpointer.restore(self.state)
        if self.resumed_from is None:
            seed_everything(cfg.seed + env.rank)
        for warning in rewind_logs(self.run_dir, self.state.step) if env.is_main else ():
            log.warning("%s", warning)
        self.eval_errors, self.shown_scale = 0, "-"  # evaluations that failed; the progress bar's logit scale
        self.tracker = RunTracker(
            self.run_dir,
            cfg.logging.wandb,
            cfg.logging.project,
            self.run_dir.name,
            as_dict(cfg),
            env.is_main,
            cfg.logging.tensorboard,
            self.state.step,
            notes=cfg.logging.wandb_notes,
        )
        self.on_terminal = sys.stderr.isatty()  # the bar; a redirected console gets a plain line a log step
        self.progress = tqdm(
            total=cfg.optim.max_steps,
            initial=self.state.step,
            dynamic_ncols=True,
            mininterval=1.0,
            disable=not (env.is_main and cfg.logging.progress and self.on_terminal),
            desc=f"train {cfg.loss.name} ×{env.world_size}",
        )

    def say(self, message: str, level: int = logging.INFO, detail: bool = False) -> None:
        """A line from rank 0 on the console and in train.log (clipdist.console); `detail`: train.log only."""
        if self.env.is_main:
            log.log(level, message, extra=console.DETAIL if detail else None)

    def say_where_it_starts(self) -> None:
        """Where the run starts (startup.start_lines), on the console and in train.log."""
        for line, level in startup.start_lines(self):
            self.say(line, level)

    def consumed(self, agreed, batch) -> None:
        """The stream moves past the step's batch (which the next start then never reads again)."""
        stream, step = self.stream, self.state.step + 1
        stream.consumed(agreed.counts)
        if switch := stream.switch_at(stream.batches):
            self.say(f"after step {step}: {switch}")
        if self.cfg.logging.sample_keys:
            log_sample_keys(self.run_dir, self.env.rank, step, batch.sample_keys, batch.seq_len)

    def fit(self) -> dict | None:
        cfg, state, checkpointer, stream = self.cfg, self.state, self.checkpointer, self.stream
        metrics, bad_steps, skipped_steps, self.overflow_steps = None, 0, 0, 0
        self.say_where_it_starts()
        profiler = StepProfiler(self.run_dir, self.env.rank, cfg.logging.profile_steps, cfg.logging.profile_wait)
        try:
            while state.step < cfg.optim.max_steps:
                started = time.perf_counter()
                profiler.step()
                with record_function("data"):
                    batch = self.next_batch()
                starting = self.step.objective.at(state.step + 1)
                self.step.start_terms(starting)
                for name in starting:
                    self.say(f"step {state.step + 1}: {name} counts from this step on (its start_at)")
                agreed, grad_norm = self.step(batch, checkpointer.requests())
                if agreed.saved:  # every rank has written the checkpoint begun earlier: it is published now
                    checkpointer.finish()
                if agreed.stop:  # this step's batch is not trained on: the saved position is before it
                    checkpointer.save(state, wait=True)
                    self.say(
                        f"stopped by a signal at step {state.step}: checkpoint written to "
                        f"{checkpointer.directory}; run again with resume=auto to continue"
                    )
                    break
                self.consumed(agreed, batch)
                if grad_norm is None:  # a non-finite global loss: every rank skipped the update
                    bad_steps, skipped_steps = bad_steps + 1, skipped_steps + 1
                    self.say(
                        f"step {state.step + 1}: non-finite loss, step skipped ({bad_steps} in a row)", logging.WARNING
                    )
                    if bad_steps >= cfg.max_nonfinite_steps:
                        raise TrainingDiverged(
                            checkpointer.divergence_advice(bad_steps, state.step, cfg.max_nonfinite_steps, cfg.optim.lr)
                        )
                    continue
                bad_steps = 0
                self.overflow_steps += self.step.overflowed  # fp16: the update skipped on every rank; the step counts
                state.step, state.samples_seen = state.step + 1, state.samples_seen + rows_consumed(agreed.counts)
                if state.ema is not None:
                    state.ema.update(state.step)
                seconds = time.perf_counter() - started  # the step alone: evaluation and checkpoints excluded
                if self.compiled[0] and not self.first_step_said:  # the compile's time (or its cache's): in the log
                    self.first_step_said = True
                    self.say(f"step {state.step}: {seconds:.1f} s with torch.compile's first compile (or its cache)")
                self.log_step(agreed, grad_norm, seconds, skipped_steps)
                if checkpointer.due(state.step, agreed.timer_elapsed):  # before evaluating: never costs a step
                    checkpointer.save(state)
                if state.step % cfg.eval_every == 0 or state.step == cfg.optim.max_steps:
                    metrics = self.evaluate()
            checkpointer.finish()  # the last save, written in the background while the run evaluated
        finally:
            self.say(f"run directory: {self.run_dir} (step {state.step})")
            profiler.stop()
            stream.close()
            checkpointer.close()
            self.progress.close()
            self.tracker.finish()
        return metrics

    def next_batch(self) -> Batch:
        """This rank's next batch. A stop signal while waiting gives a stand-in of the batch's shape instead: the
        step's collectives still match on every rank, and its agreement stops them. A read cut short (stuck past the
        stop's grace, StopSignal.interruptible) may stop anywhere in the data path — inside an augmentation that
        seeded torch's and Python's generators from a sample's key —, so the generators are put back as they were
        before the read: the stopped step and the checkpoint see the state the uninterrupted run has."""
        generators = host_rng_state()
        try:
            with self.checkpointer.stop.interruptible():
                return next(self.stream)
        except launch.StopRequested:
            set_rng_state(generators)
            return startup.stand_in_batch(self)

    def log_step(self, agreed, grad_norm: torch.Tensor, seconds: float, skipped_steps: int) -> None:
        """Progress bar every step; train_log.jsonl / W&B every log_every steps. The values that need a
        device-to-host copy (logit scale and bias, grad norm) are read only then: on a GPU each is a sync. A teacher
        term's targets that collapse: a warning at that step (from the agreed values: no sync)."""
        state, model = self.state, self.model
        for warning in self.signal.check(state.step, agreed.terms):
            self.say(warning, logging.WARNING)
        global_loss = agreed.loss
        stats = {
            "loss": global_loss,
            **agreed.terms,
            "lr": self.step.applied_lr,
            "samples_per_s": rows_consumed(agreed.counts) / seconds,
            "samples_per_s_per_device": rows_consumed(agreed.counts) / self.env.world_size / seconds,
        }
        self.progress.update(1)
        cadence = self.cfg.logging
        if logs_step(state.step, cadence.log_every, self.cfg.optim.max_steps, cadence.epoch_steps):
            stats["logit_scale"] = model.get_parameter("logit_scale").exp().item()
            if self.loss_fn.uses_logit_bias:
                stats["logit_bias"] = model.get_parameter("logit_bias").item()
            if self.scaler is not None:
                stats.update(loss_scale=self.scaler.get_scale(), overflow_steps=self.overflow_steps)
            stream = self.stream
            sources: dict[str, int | list[int]] = (
                {"source_samples": list(stream.source_samples)} if len(stream.source_samples) > 1 else {}
            )
            if self.step.decode is not None:  # data.decode_on=device: images the device did not decode (rank 0's)
                sources.update(host_decoded_images=self.step.host_decoded, unreadable_images=self.step.unreadable)
            self.tracker.log_train(
                {
                    **stats,
                    "grad_norm": float(grad_norm),
                    "samples_seen": state.samples_seen,
                    "skipped_samples": stream.skipped_samples,
                    "skipped_shards": stream.skipped_shards,
                    "skipped_steps": skipped_steps,
                    **sources,
                },
                state.step,
            )
            self.shown_scale = f"{stats['logit_scale']:.1f}"
            if self.cfg.logging.progress and not self.on_terminal:
                self.say(
                    f"step {state.step}/{self.cfg.optim.max_steps}: loss {global_loss:.3f}, lr {stats['lr']:.2e}, "
                    f"{stats['samples_per_s']:.0f} samples/s, scale {self.shown_scale}"
                )
        self.progress.set_postfix(
            loss=f"{global_loss:.3f}",
            samples_s=f"{stats['samples_per_s']:.0f}",
            lr=f"{stats['lr']:.2e}",
            scale=self.shown_scale,
            refresh=False,
        )

    def evaluate(self) -> dict | None:
        """Every evaluation set, on every rank: each encodes its share, all get the same metrics
        (clipdist.train.evaluate), so no rank waits on another's evaluation. A set that fails (on any rank: the failure
        is
        agreed) is logged and counted (eval_errors) and training goes on: evaluation never stops a run."""
        if not self.shards.evals:
            return None
        metrics = {}
        for evalset in self.shards.evals:
            try:
                metrics.update(
                    evaluate(
                        self.model,
                        self.tokenizer,
                        evalset,
                        self.val_transform,
                        self.device,
                        autocast=self.autocast,
                        max_skips_in_a_row=self.cfg.data.max_skips_in_a_row,
                        loss_block=self.cfg.world.batch_per_device,
                        lockstep=self.sharded,
                        retrieval_ties=str(self.cfg.data.retrieval_ties),
                    )
                )
            except Exception as error:  # noqa: BLE001 -- any failure of an evaluation is reported, not fatal
                self.eval_errors += 1
                self.say(
                    f"step {self.state.step}: evaluation of {evalset.name} failed ({type(error).__name__}: "
                    f"{error}); training goes on (eval_errors={self.eval_errors})",
                    logging.WARNING,
                )
        metrics.update(
            train_skipped=self.stream.skipped_samples,
            train_skipped_shards=self.stream.skipped_shards,
            eval_errors=self.eval_errors,
        )
        if not self.env.is_main:
            return None
        self.tracker.log_eval(metrics, self.state.step)
        self.say(
            f"step {self.state.step}: "
            + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        )
        return metrics
