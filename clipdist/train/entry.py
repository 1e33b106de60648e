"""Training's entry: config → checks → world → Trainer(...).fit() on every rank.

run(cfg)                 checks the whole config before any rank starts, claims the run directory, starts the ranks
train(cfg, shards, plan) on every rank: device, host, process group, then the loop (train.trainer)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from clipdist import console
from clipdist.checkpoint.manager import Checkpointer
from clipdist.checkpoint.run_dir import RunLock, write_record
from clipdist.config import TrainConfig, as_dict, to_train_config
from clipdist.distributed import launch, parallel
from clipdist.errors import CollectiveTimeout, OutOfMemory, first_line, out_of_memory, timed_out_collective
from clipdist.preflight import preflight
from clipdist.train import startup
from clipdist.train.recipe import traps
from clipdist.train.trainer import Trainer

if TYPE_CHECKING:  # annotations only
    from clipdist.data.sources import Shards
    from clipdist.data.workers import LoaderPlan

log = logging.getLogger("clipdist")


def run(cfg, overrides: Sequence[str] = ()) -> dict | None:
    """Entry point: check everything the config alone can tell, claim the run directory, then train
    here or on spawned local ranks. `overrides` (the command line) go into the run's record."""
    cfg = to_train_config(cfg)
    env = launch.detect_env()
    shards, plan = preflight(cfg, env)
    if not env.is_main:
        console.open_run_log(Path(cfg.run_dir) / console.LOG_FILE)
        return train(cfg, shards, plan)
    with RunLock(cfg.run_dir):
        fetched = Checkpointer.fetch_remote(cfg)
        warnings = Checkpointer.check_resume(cfg, cfg.world.world_size)  # again, now that no one else can write
        write_record(cfg.run_dir, as_dict(cfg), list(overrides))
        console.open_run_log(Path(cfg.run_dir) / console.LOG_FILE)
        if fetched:
            log.log(*fetched)
        for warning in [*warnings, *traps(cfg, shards)]:  # the resume's, and settings that do not do what they seem
            log.warning("%s", warning)
        if env.launcher == "single" and cfg.world.world_size > 1:
            return launch.launch_local(train, cfg.world.world_size, cfg, shards, plan, timeout_s=cfg.world.timeout_s)[0]
        return train(cfg, shards, plan)


def _on_this_rank(error: Exception, rank: int, device, timeout_s: int) -> Exception | None:
    """A rank's failure that is the run's size or the world's pace, not a bug, as the one line to say (None: none of
    those): out of memory, or a collective that waited past world.timeout_s."""
    if out_of_memory(error):
        return OutOfMemory(
            f"out of memory on rank {rank} ({device}): {first_line(error)}. Lower world.batch_per_device or split "
            "it with grad_cache.chunks=K (`clipdist plan` says what fits); the checkpoints written so far are intact "
            "(resume=auto)"
        )
    if timed_out_collective(error):
        return CollectiveTimeout(
            f"a collective on rank {rank} waited past world.timeout_s={timeout_s} s ({first_line(error)}): another "
            "rank was slower, stuck or gone (its own error, if any, is above). Where the ranks are only uneven (a "
            "first compile, a slow file system), raise world.timeout_s; the checkpoints written so far are intact"
        )
    return None


def train(cfg: TrainConfig, shards: Shards, plan: LoaderPlan) -> dict | None:
    """Train on this rank (every rank calls it), with the loader plan preflight decided. Returns the last evaluation
    on rank 0."""
    env = launch.detect_env()
    device = parallel.select_device(cfg.world.device, env.local_rank)
    startup.configure_host(cfg, plan, env, device)
    backend = None if cfg.world.backend == "auto" else str(cfg.world.backend)
    launch.init_process_group(
        env,
        backend=backend,
        timeout_s=cfg.world.timeout_s,
        rendezvous_timeout_s=cfg.world.rendezvous_timeout_s,
        single=cfg.world.parallel == "fsdp",
    )
    console.name_rank(env.rank, env.world_size)
    try:
        if env.world_size > 1:
            where = launch.placement(env)
            if env.is_main:
                log.info("%s", where)
        return Trainer(cfg, shards, env, device, plan).fit()
    except Exception as error:
        said = _on_this_rank(error, env.rank, device, cfg.world.timeout_s)
        if said is None:
            raise
        raise said from error
    finally:
        launch.destroy_process_group()
