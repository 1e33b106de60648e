"""Every check before any rank starts, run once: the config's own (clipdist.config.validate) and each component's
checks of its settings, each one line (ConfigError) naming the key and what to change — the model's
(preflight.model: towers, loss, optimizer, parallelism), the data's (preflight.data: shards, readers, NaFlex budget,
evaluation sets), the launch's, the run directory's, the resume's, the trackers'.

    shards, plan = preflight(cfg, env)      # train.run: then the ranks start, each with the loader plan
"""

from __future__ import annotations

from clipdist.checkpoint.manager import Checkpointer
from clipdist.checkpoint.remote import check_remote
from clipdist.checkpoint.run_dir import check_run_dir
from clipdist.config import TrainConfig, validate
from clipdist.data.order import SampleOrder
from clipdist.data.sources import Shards
from clipdist.data.stream import check_pieces, run_readers
from clipdist.data.workers import LoaderPlan
from clipdist.distributed import launch
from clipdist.errors import as_config_error
from clipdist.losses import build as build_loss
from clipdist.preflight.data import check_data, check_naflex
from clipdist.preflight.model import check_model, check_shardable
from clipdist.tracking import check_tensorboard, check_wandb_online

__all__ = ["check_config", "check_naflex", "check_shardable", "preflight"]


def preflight(cfg: TrainConfig, env: launch.DistEnv) -> tuple[Shards, LoaderPlan]:
    """Every check that needs no process group, before any rank starts; ConfigError says what to change. The
    model is built once, on the meta device (its structure, no memory), for every check that needs it. Returns the
    shards and the loader plan the ranks run with (decided once, here)."""
    check_config(cfg)
    launch.check_launch(cfg.world, env)
    check_run_dir(cfg.run_dir)
    resuming = Checkpointer.resume_point(cfg)
    Checkpointer.check_resume(cfg, cfg.world.world_size, resuming)
    student = check_model(cfg, env.is_main)
    shards, plan = check_data(cfg, student, resuming)
    with as_config_error():
        if cfg.logging.wandb == "online" and env.is_main:
            check_wandb_online()
        if cfg.logging.tensorboard:
            check_tensorboard()
    return shards, plan


def check_config(cfg: TrainConfig) -> None:
    """The config's own checks (config.validate), then those its components make of their settings: the loss
    backend's options, the data layout (pieces, readers against the global batch), the remote's file system."""
    validate(cfg)
    with as_config_error():
        check_pieces(cfg.data.pieces, cfg.world.batch_per_device)
        if cfg.data.readers is not None:
            readers = run_readers(1, cfg.world.world_size, str(cfg.data.split), cfg.data.readers)
            SampleOrder(readers, cfg.world.batch_per_device * cfg.world.world_size)
        build_loss(cfg.loss.name, **cfg.loss.options())
    if cfg.checkpoint.remote:
        check_remote(cfg.checkpoint.remote)
