"""`python train.py` / `clipdist train`: Hydra's composition under clipdist's policy (clipdist.hydra_policy), the
checks that need torch alone, then clipdist.train.entry.run in the run directory."""

from __future__ import annotations

import gc
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path, PurePath

from clipdist import hydra_policy
from clipdist.compat import floor_problem
from clipdist.distributed import host
from clipdist.errors import is_failure, printable, report_bug
from clipdist.files import discard_stdout, read_bounded


def train_main(overrides: list[str] | None = None, program: bool = False) -> None:
    """`python train.py [overrides]`, `clipdist train [overrides]`: Hydra composes clipdist/conf and trains."""
    host.spin_briefly()  # before torch loads libgomp
    problem = floor_problem()
    if problem:
        sys.exit(f"clipdist: error: {problem}")
    import hydra

    from clipdist.config import register

    register()
    hydra_policy.install()  # every composition checked, the resolvers that read outside refused
    program = program or overrides is None  # the process ends with this call
    if overrides is not None:
        sys.argv = [f"{os.path.basename(sys.argv[0])} train", *overrides]
    from clipdist.config import invalid_value, unknown_override
    from clipdist.distributed.world import launch_problem

    if (
        "--help" in sys.argv[1:] or "-h" in sys.argv[1:]
    ):  # every key with its default and meaning; Hydra's own: --hydra-help
        try:
            print(train_help())
        except BrokenPipeError:  # `| head`
            discard_stdout()
        return
    arguments = sys.argv[1:]
    problem = (
        launch_problem()
        or hydra_policy.argument_problem(arguments)
        or unknown_override(arguments)
        or invalid_value(arguments)
        or unwritable_run_dir(arguments)
    )
    if problem:  # before Hydra makes the directory (its traceback otherwise)
        print(f"error: {printable(problem)}", file=sys.stderr)
        sys.exit(2)
    try:
        hydra.main(version_base=None, config_path="pkg://clipdist.conf", config_name="config")(_run_composed)()
    except ValueError as error:  # Hydra's own check of its flags, before its reporting starts (-m with --cfg)
        said = hydra_policy.hydras_refusal(error)
        if said is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        hydra_policy.refuse(said)
    finally:
        if program:  # the interpreter's last collection skipped: the exit frees everything (3.7 s of a 5.8 s stop)
            gc.disable()
            gc.freeze()


def train_help() -> str:
    """`python train.py --help`: the config groups and their options, then every key with its default and what it
    is (from the schema's own comments: clipdist.config.describe_keys)."""
    from clipdist.config import CONF, describe_keys, group_options

    chosen = dict(
        re.findall(r"(?m)^\s*-\s*(\w+):\s*(\w+)\s*$", read_bounded(CONF / "config.yaml", 1 << 20).decode())
    )  # the defaults list: group -> option
    groups = []
    for folder in sorted(
        path for path in CONF.iterdir() if path.is_dir() and path.name not in ("hydra", "__pycache__")
    ):
        shown = [
            f"{name} (default)" if name == chosen.get(folder.name) else name for name in group_options(folder.name)
        ]
        groups.append(f"  {folder.name}=: {', '.join(shown)}")
    return "\n".join(
        [
            "python train.py [group=option ...] [key=value ...]    e.g. python train.py loss=disco world=cpu2",
            "",
            "Config groups (clipdist/conf/<group>/<option>.yaml):",
            *groups,
            "",
            "Keys (key = default  — what it is); a misspelt key is refused with the nearest ones:",
            *describe_keys(),
            "",
            "The composed config: python train.py --cfg job [overrides]; Hydra's help: python train.py --hydra-help.",
        ]
    )


def unwritable_run_dir(arguments: list[str]) -> str | None:
    """One line where the run directory the overrides name (runs/<name> under the working directory by default)
    cannot be made or written — a read-only file system, no permission — else None. Checked on the nearest folder
    that exists; a value with an interpolation is checked up to it."""
    given = [a.split("=", 1)[1] for a in arguments if a.lstrip("+").startswith("run_dir=")]
    value = given[-1].strip("'\"") if given else "runs/x"
    literal = value.split("${", 1)[0]
    folder = Path(literal if literal.endswith("/") or not literal else os.path.dirname(literal) or ".")
    if given and "${" not in value:
        folder = Path(value)
    folder = folder.expanduser().absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if folder.is_dir() and os.access(folder, os.W_OK | os.X_OK):
        return None
    what = "is not a folder" if not folder.is_dir() else "cannot be written (a read-only file system or no permission)"
    return (
        f"run_dir={value}: {folder} {what}; choose a run directory on a writable file system "
        "(run_dir=/path/to/runs/<name>)"
    )


def _run_composed(cfg) -> None:
    """Hydra's task: the composed config → clipdist.train.entry.run in Hydra's output directory, which is
    the run directory; a ClipdistError is one `error:` line (HYDRA_FULL_ERROR=1 for the traceback), any
    other failure one line saying it is a bug, with its traceback in a file of the run directory (errors.report_bug),
    both on stderr and, once the run has started, at the end of train.log."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    from clipdist import console
    from clipdist.distributed.world import detect_env
    from clipdist.errors import ClipdistError, ConfigError

    hydra = HydraConfig.get()
    run_dir = hydra.runtime.output_dir  # resolved once by Hydra: ${now:...} can not differ from it
    created = _created_by_hydra(run_dir)
    console.configure(main=detect_env().is_main)
    nameless = _nameless_run(cfg, run_dir)  # before run_dir becomes Hydra's folder
    with open_dict(cfg):
        if OmegaConf.is_interpolation(cfg, "name"):
            multirun = hydra.mode is not None and hydra.mode.name == "MULTIRUN"
            cfg.name = (
                f"{os.path.basename(os.path.dirname(run_dir))}-{hydra.job.num}"
                if multirun
                else os.path.basename(run_dir)
            )
        cfg.run_dir = run_dir
    try:
        if nameless:
            raise ConfigError(nameless)
        complete = _quick_checks(cfg)  # the schema, the world against the launch: before the towers' libraries load
        if complete:
            logging.getLogger("clipdist").info("%s", complete)
            return
        from clipdist.distributed.launch import StopSignal
        from clipdist.train.entry import run

        StopSignal.in_this_process = False  # this run's own stop, not an earlier one's in the same process

        typed = OmegaConf.to_container(hydra.overrides.task, resolve=False)  # as typed: ${...} kept
        run(cfg, overrides=list(typed) if isinstance(typed, list) else [])
        if StopSignal.in_this_process and cfg.logging.report:  # a scheduler's grace is for the checkpoint
            logging.getLogger("clipdist").info("report: left to `clipdist report %s` (the run was stopped)", run_dir)
        elif cfg.logging.report:
            _write_report(run_dir)
    except ClipdistError as error:
        if created and _created_by_hydra(run_dir):  # refused before the run began: leave nothing behind
            shutil.rmtree(run_dir, ignore_errors=True)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if not isinstance(error, ConfigError) or detect_env().is_main:  # a config refusal: every rank's is the same
            logging.getLogger("clipdist").error("%s", error)
        elif detect_env().world_size > 1:  # rank 0 says it: a launcher ends the launch at the first rank's exit
            time.sleep(RANK_REFUSAL_WAIT_S)
        sys.exit(2 if isinstance(error, ValueError) else 1)
    except BaseException as error:  # noqa: BLE001 -- a bug: one line, the traceback in a file of the run directory
        if not is_failure(error) or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        logging.getLogger("clipdist").error("%s", report_bug(error, run_dir if os.path.isdir(run_dir) else None))
        raise SystemExit(1) from None


NAME_PROBE = "clipdist-name-probe"  # a name no run has: _nameless_run resolves run_dir with it


def _nameless_run(cfg, run_dir: str) -> str | None:
    """Why the composed run_dir is no folder of the run's own (None: it is): one with no last part of its own
    (`run_dir=`, `.`, `..`, `/`, or runs/<name> with `name=`, `.`, `..`) is the working directory, the folder of
    every run, or one above them."""
    from omegaconf import OmegaConf, open_dict

    value, name = (str(OmegaConf.select(cfg, key, default="") or "") for key in ("run_dir", "name"))
    probe = cfg.copy()  # does run_dir take the name, by any spelling (${name}, ${oc.select:name}, ...)?
    with open_dict(probe):
        probe.name = NAME_PROBE
    named = NAME_PROBE in str(OmegaConf.select(probe, "run_dir", default="") or "")
    if PurePath(value.strip()).name in ("", ".", "..") or (named and PurePath(name).name in ("", ".", "..")):
        return (
            f"run_dir={value!r} (name={name!r}) is {run_dir}, no folder of the run's own: give the run a name, or "
            "run_dir=<a folder for this run>"
        )
    return None


RANK_REFUSAL_WAIT_S = 5.0  # how long the other ranks wait for rank 0 to reach the same refusal and say it


def _quick_checks(cfg) -> str | None:
    """What can be said before the towers' libraries load (the ~10 s open_clip, timm and transformers take, and the
    minute a run's start takes): first what needs no torch at all (`_checks_without_torch`: a second), then a CUDA
    device asked for, a checkpoint that cannot be read, and a run that is already complete (returned: the line to
    say; nothing else runs). preflight repeats the checks with the rest."""
    checked = _checks_without_torch(cfg)
    from clipdist.checkpoint.manager import Checkpointer
    from clipdist.distributed.launch import check_cuda

    check_cuda(checked.world)
    found = Checkpointer.resume_point(checked)
    step = found[1].get("step") if found else None
    if isinstance(step, int) and step >= checked.optim.max_steps:
        return (
            f"run {checked.run_dir} is already complete at step {step} (optim.max_steps={checked.optim.max_steps}); "
            "raise optim.max_steps to train on, or set name= for a new run"
        )
    return None


def _checks_without_torch(cfg):
    """The checks a comparison answers, before torch is imported: the schema's values, the world preset against the
    launch, the run directory (its records, and a run in progress holding its lock), a package a logger needs, and
    training shards that are not there. Returns the typed config."""
    from clipdist.checkpoint.run_dir import check_run_dir, in_use, running_holder
    from clipdist.config import to_train_config, validate
    from clipdist.data.sources import resolve_shards
    from clipdist.distributed.world import check_world, detect_env
    from clipdist.errors import as_config_error
    from clipdist.tracking import check_tensorboard

    checked = to_train_config(cfg)
    validate(checked)
    env = detect_env()
    check_world(checked.world, env)
    check_run_dir(checked.run_dir)  # a record that is a link or a FIFO: said before anything in it is read
    holder = running_holder(checked.run_dir) if env.is_main else None
    if holder:
        raise in_use(checked.run_dir, holder)
    with as_config_error(FileNotFoundError):
        if checked.logging.tensorboard:
            check_tensorboard()
        resolve_shards(checked.data)
    return checked


def _created_by_hydra(run_dir: str) -> bool:
    """Whether the run directory holds nothing yet (Hydra made it as it started; the run log opens at its first
    line). Every rank of a refused launch asks, and another rank may remove it between two looks: gone is empty."""
    try:
        with os.scandir(run_dir) as entries:
            return not any(entries)
    except (FileNotFoundError, NotADirectoryError):
        return not os.path.exists(run_dir)


def _write_report(run_dir: str) -> None:
    """report.png / report.txt at the end of a run or a stop, from the main rank; a failure is a warning only."""
    from clipdist.distributed.world import detect_env
    from clipdist.tools.report import write_report

    if not detect_env().is_main or not os.path.isfile(os.path.join(run_dir, "train_log.jsonl")):
        return
    try:
        picture, _ = write_report(run_dir)
    except Exception as error:  # noqa: BLE001 -- the run is done either way
        logging.getLogger("clipdist").warning(
            "the run's report could not be written (%s: %s)", type(error).__name__, error
        )
    else:
        logging.getLogger("clipdist").info("report: %s", picture)
