"""What Hydra may run in a clipdist process, enforced where Hydra acts rather than on what a user typed.

Hydra can run code from a config: callbacks, a launcher or sweeper `_target_`, the `()` and `class` entries of the
logging configs it hands to `logging.config.dictConfig`, the environment `hydra.job.env_set` gives the job, and
`--experimental-rerun`, which unpickles a file. OmegaConf's resolvers read outside the config (`oc.env` reads the
environment). A check of the command line or of a config folder's text only sees one spelling of each; so:

- `install()` wraps Hydra's one composition function (`ConfigLoaderImpl.load_configuration`, which the run, a
  sweep's master and each sweep job, `--cfg` and `--info` all go through). Every composed config's `hydra` node is
  checked against the allowlist below before Hydra reads it (`hydra_problem`), whatever file, folder, search path
  or override put it there. A refusal is one `error:` line and exit 2.
- `install()` also replaces every resolver outside `KEPT_RESOLVERS` (`oc.env`, `oc.decode`, `oc.create`, and any a
  library registers) for the whole process with one that refuses, so no spelling the grammar accepts reads them.
- `install()` also bounds what a YAML file may expand to through anchors and aliases (`_bounded_yaml_loader`, for
  every OmegaConf load in the process: a config folder, a run's saved config): ten nested lists of ten aliases are
  10^10 values to OmegaConf, a hang and then the machine's memory, from a file of a few lines.
- `hydra_arguments(argv)` reads the command line with Hydra's own parser: an abbreviation (`--exp`) is the flag.
- `run_and_report` takes Hydra's place where Hydra reports a failure: one line, never a traceback. What Hydra's
  composition or its logging set-up raises beyond its own errors (a `hydra.verbose` of the wrong kind, a logging
  config naming a handler it lacks, `hydra.job.env_copy` naming an unset variable) is the hydra node's input, said
  as such (`_hydras_input`), not as a bug of clipdist's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

import omegaconf._utils
import omegaconf.basecontainer
import yaml
from hydra._internal import hydra as hydra_internal
from hydra._internal import utils as hydra_utils
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.core_plugins import basic_launcher
from hydra._internal.utils import get_args_parser
from hydra.core import utils as core_utils
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.basecontainer import BaseContainer
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from clipdist.errors import is_failure, one_line, report_bug

# Launchers and sweepers Hydra may instantiate: its own and submitit's (conf/hydra/launcher/slurm.yaml)
LAUNCHERS = (
    "hydra._internal.core_plugins.basic_launcher.BasicLauncher",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
)
SWEEPERS = ("hydra._internal.core_plugins.basic_sweeper.BasicSweeper",)
# What a logging config may have dictConfig build (its `()` and `class` entries) and the streams it may name
LOGGING_CALLABLES = (
    "clipdist.console.ConsoleHandler",
    "logging.StreamHandler",
    "logging.FileHandler",
    "logging.NullHandler",
    "logging.Formatter",
)
LOGGING_STREAMS = ("ext://sys.stdout", "ext://sys.stderr")
# The only place a FileHandler may write: the run directory, under a plain file name
LOG_FILE = re.compile(r"\$\{hydra\.runtime\.output_dir\}/(\$\{hydra\.job\.name\}|[\w-]+)\.log")
# hydra.job.env_set: tuning variables of the collectives and thread pools; none that names a library to load
ENV_SET = re.compile(r"(NCCL|GLOO|TORCH_NCCL)_\w+|OMP_NUM_THREADS|MKL_NUM_THREADS|CUDA_VISIBLE_DEVICES")
# Where a run writes: clipdist's values, so the run directory is run_dir (set run_dir=, not these)
OUTPUT = {
    "run.dir": "${run_dir}",
    "sweep.dir": "${run_dir}",
    "sweep.subdir": "${hydra.job.num}",
    "output_subdir": None,
    "job.chdir": False,
}
# Values (mappings, lists, scalars, counted as OmegaConf would build them: an alias as a copy) a YAML file may expand
# to; clipdist's largest composed config is ~400
MAX_YAML_VALUES = 100_000
# Resolvers that read nothing outside the config (Hydra's own: now, hydra; OmegaConf's selection helpers)
KEPT_RESOLVERS = frozenset({"now", "hydra", "oc.select", "oc.dict.keys", "oc.dict.values", "oc.deprecated"})

_installed: list[bool] = []


def install() -> None:
    """Wrap Hydra's composition with `hydra_problem` and replace the resolvers that read outside the config; once a
    process (repeated calls re-check the resolvers only: a library imported since may have added one)."""
    refuse_outside_resolvers()
    if _installed:
        return
    _bound_yaml()
    compose = ConfigLoaderImpl.load_configuration

    def load_configuration(self, *args, **kwargs):
        refuse_outside_resolvers()
        with _hydras_input("compose the config"):  # its own errors: run_and_report below says them in one line
            cfg = compose(self, *args, **kwargs)
        problem = hydra_problem(cfg)
        if problem:
            refuse(problem)
        _resolve_job(cfg)  # a refused resolver says so now, before Hydra makes the run directory
        return cfg

    ConfigLoaderImpl.load_configuration = load_configuration  # type: ignore[method-assign]
    _guard_configure_log()
    hydra_utils.run_and_report = run_and_report  # Hydra's own phases (its start, --cfg, --info, the job) report here
    _installed.append(True)


class UnboundedYaml(yaml.YAMLError):
    """A YAML document whose aliases expand past MAX_YAML_VALUES, or nested deeper than the reader recurses."""


def _bound_yaml() -> None:
    """OmegaConf's YAML loader (found by name at each load; basecontainer binds it once) replaced by one that counts
    what a document expands to before OmegaConf builds it."""
    loader = omegaconf._utils.get_yaml_loader

    def bounded_loader():
        return bounded(loader())

    omegaconf._utils.get_yaml_loader = bounded_loader
    omegaconf.basecontainer.get_yaml_loader = bounded_loader  # type: ignore[attr-defined]


def load_yaml(text: str):
    """`text` as yaml.safe_load reads it, bounded as every config file is (a command-line value's aliases would be
    copied out by OmegaConf just the same)."""
    return yaml.load(text, Loader=bounded(yaml.SafeLoader))  # noqa: S506 -- a SafeLoader


def bounded(base: type) -> type:
    """YAML loader `base` refusing (UnboundedYaml) a document that expands past MAX_YAML_VALUES or nests past the
    reader's recursion, before anything is built from it."""

    class Bounded(base):  # type: ignore[misc, valid-type]
        def compose_document(self):
            try:
                node = super().compose_document()
                values = _expanded_values(node, {})
            except RecursionError:
                raise UnboundedYaml(
                    f"{one_line(str(self.name))}: the YAML document is nested too deeply to read"
                ) from None
            if values > MAX_YAML_VALUES:
                raise UnboundedYaml(
                    f"{one_line(str(self.name))}: the YAML document expands to {values:,} values through its "
                    f"aliases (at most {MAX_YAML_VALUES:,}: an alias bomb); write the values out, or use Hydra's "
                    "defaults list"
                )
            return node

    return Bounded


def _expanded_values(node, counted: dict) -> int:
    """The values `node` stands for with every alias copied (memoised per node: linear in the document's size)."""
    if id(node) in counted:
        return counted[id(node)]
    children = node.value if isinstance(node.value, list) else []
    total = 1 + sum(_expanded_values(child, counted) for item in children for child in _pair(item))
    counted[id(node)] = total
    return total


def _pair(item) -> tuple:
    return item if isinstance(item, tuple) else (item,)  # a mapping's (key, value) nodes, a sequence's node


def run_and_report(func):
    """Hydra's `run_and_report` as clipdist says it: what Hydra could not compose is one `error:` line (exit 2), any
    other exception one line saying it is a bug with its traceback in a file (exit 1); HYDRA_FULL_ERROR=1 raises."""
    try:
        return func()
    except BaseException as error:  # noqa: BLE001 -- said in one line below
        if not is_failure(error) or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        said = _composition_error(error) or hydras_refusal(error)
        if said:
            refuse(said)
        print(f"error: {report_bug(error)}", file=sys.stderr)
        raise SystemExit(1) from None


@contextlib.contextmanager
def _hydras_input(action: str):
    """Hydra acting on the composed hydra node: an exception outside Hydra's, OmegaConf's and YAML's own (theirs say
    the input already) is a value of that node Hydra took without checking it: refused in one line, exit 2."""
    try:
        yield
    except (HydraException, OmegaConfBaseException, yaml.YAMLError):
        raise
    except Exception as error:  # noqa: BLE001 -- said in one line
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        said = one_line(f"{type(error).__name__}: {error}".rstrip(": "))[:200]
        refuse(
            f"Hydra could not {action} ({said}): a hydra.* value it takes unchecked — hydra.verbose (true, a logger "
            "name or a list of them), hydra.job_logging / hydra.hydra_logging (a logging dictConfig whose handlers "
            "and formatters are defined), hydra.job.env_copy (variables set in this environment)"
        )


def _guard_configure_log() -> None:
    """Hydra's `configure_log` (hydra.verbose and the logging configs) under `_hydras_input`, in every module that
    imported it by name (the run, the launchers, a sweep job through `run_job`)."""
    configure_log = core_utils.configure_log

    def guarded(*args, **kwargs):
        with _hydras_input("set up logging"):
            return configure_log(*args, **kwargs)

    main_module = importlib.import_module("hydra.main")  # the module: `hydra.main` is its decorator
    for module in (core_utils, hydra_internal, basic_launcher, main_module):
        if getattr(module, "configure_log", None) is configure_log:
            module.configure_log = guarded  # type: ignore[attr-defined]


HYDRA_PACKAGE = os.path.dirname(os.path.abspath(hydra_utils.__file__)).rsplit(os.sep, 1)[0] + os.sep


def hydras_refusal(error: BaseException) -> str | None:
    """A ValueError Hydra raises itself, checking its own flags (`--shell-completion` without a subcommand, `-m`
    with `--cfg`), as one line; None for anything raised elsewhere."""
    frames = traceback.extract_tb(error.__traceback__)
    if isinstance(error, ValueError) and frames and os.path.abspath(frames[-1].filename).startswith(HYDRA_PACKAGE):
        return f"{' '.join(str(error).split())} (Hydra's flags: python train.py --hydra-help)"
    return None


# What a key the composed config lacks means, where the schema knows more than Hydra's "not in" (config adds the
# loss backends' options: loss.tile is tiled's and siglip's); each takes the full key, None where it knows nothing
MISSING_KEY_HINTS: list[Callable[[str], str | None]] = []


def _composition_error(error: BaseException) -> str | None:
    """Hydra's or the YAML reader's message for a config it could not compose, on one line (its indented details
    and the HYDRA_FULL_ERROR hint left out), or a MISSING_KEY_HINTS line for a key it did not find; None for any
    other exception."""
    if not isinstance(error, (HydraException, OmegaConfBaseException, yaml.YAMLError)):
        return None
    not_found = (ConfigKeyError, ConfigAttributeError)
    # the key OmegaConf did not find: raised by it, or by Hydra while handling OmegaConf's (a config file's key)
    missing = next((e for e in (error, error.__cause__, error.__context__) if isinstance(e, not_found)), None)
    if missing is not None and missing.full_key:
        hints = (hint(str(missing.full_key)) for hint in MISSING_KEY_HINTS)
        hinted = next((hint for hint in hints if hint), None)
        if hinted:  # after the file Hydra names, where a config file's key it is ("In 'loss/mine': ...")
            where = re.match(r"In '[^'\n]*': ", str(error))
            return (where.group(0) if where else "") + hinted
    said = [str(error)] + ([str(error.__cause__)] if error.__cause__ is not None else [])
    if isinstance(error, yaml.constructor.ConstructorError):
        said.insert(0, "a config file is not plain YAML data (tags that build Python objects are not read)")
    elif isinstance(error, yaml.YAMLError) and not isinstance(error, UnboundedYaml):
        said.insert(0, "a config file is not YAML")
    kept: list[str] = []
    menu = False  # within a menu's indented items: they go on the header's line
    for raw in (line for text in said for line in text.splitlines()):
        line = raw.strip()
        if not line or line.startswith(("Set the environment", "full_key", "object_", "reference_type")):
            continue
        if menu and raw[:1].isspace():
            kept[-1] += (" " if kept[-1].endswith(":") else ", ") + line
            continue
        menu = line.endswith(":")
        if line not in kept:
            kept.append(line)
    return "; ".join(kept) or type(error).__name__


def _resolve_job(cfg) -> None:
    """Resolve every value outside the hydra node once, so a refusing resolver refuses before the job starts; any
    other failure (a `${hydra:...}` Hydra sets only at the job's start, a missing key) is left to the run's checks."""
    for key in cfg:
        if key != "hydra":
            try:
                OmegaConf.to_container(OmegaConf.masked_copy(cfg, [key]), resolve=True)
            except Exception:  # noqa: BLE001, S112 -- said by the run's own checks
                continue


def refuse(problem: str):
    """One `error:` line on stderr and exit 2: raised as SystemExit, which Hydra's error reporting passes through
    (it reports Exceptions with their stack) and OmegaConf's resolver calls do not wrap."""
    print(f"error: {one_line(problem)}", file=sys.stderr)
    raise SystemExit(2)


def refuse_outside_resolvers() -> None:
    """Every registered resolver outside KEPT_RESOLVERS replaced by one that refuses: `${oc.env:X}`, `${ oc.env:X}`,
    a nested `${oc.decode:...}`: each is a call of the registered function, however it is spelled."""
    for name in list(_resolvers()):
        if name not in KEPT_RESOLVERS and not getattr(_resolvers()[name], "_clipdist_refuses", False):
            OmegaConf.register_new_resolver(name, _refusing(name), replace=True)


def _resolvers() -> dict:
    return BaseContainer._resolvers


def _refusing(name: str):
    def refused(*_args, **_kwargs):
        refuse(
            f"${{{name}:...}}: clipdist configs do not read the environment or parse text as config (the value would "
            "be resolved into errors, logs and the saved config); write the value itself"
        )

    refused._clipdist_refuses = True  # type: ignore[attr-defined]
    return refused


def hydra_arguments(argv: list[str]) -> argparse.Namespace | None:
    """The command line as Hydra's own parser reads it (any unambiguous prefix of a flag is that flag), or None
    where it cannot read it (Hydra then says why)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return get_args_parser().parse_args(argv)
    except SystemExit:
        return None


def argument_problem(argv: list[str]) -> str | None:
    """A flag clipdist refuses: `--experimental-rerun` in any spelling (Hydra unpickles its file before composing)."""
    arguments = hydra_arguments(argv)
    if arguments is not None and arguments.experimental_rerun is not None:
        return (
            "--experimental-rerun unpickles its file (a pickle can run code): refused. Re-run a run with the "
            "overrides it saved in <run_dir>/hydra/overrides.yaml (python train.py name=<its name> resumes it)"
        )
    return None


def searches_user_folders(argv: list[str], overrides: list) -> bool:
    """Whether a user's config folder may add group options: --config-dir / --config-path in any spelling, or an
    override of hydra.searchpath."""
    arguments = hydra_arguments(argv)
    if arguments is None:
        return True  # Hydra will say what it cannot read
    named = arguments.config_dir is not None or arguments.config_path is not None
    return named or any(str(o.key_or_group).lstrip("+~").startswith("hydra.searchpath") for o in overrides)


def hydra_problem(cfg) -> str | None:
    """Why Hydra must not act on this composed config (one line), or None: read unresolved, so nothing in it runs
    while it is checked."""
    node = cfg.get("hydra") if hasattr(cfg, "get") else None
    if node is None:
        return None
    hydra: Any = OmegaConf.to_container(node, resolve=False)
    callbacks = hydra.get("callbacks") or {}
    if callbacks:
        return (
            f"hydra.callbacks.{one_line(str(next(iter(callbacks))))}: clipdist runs no Hydra callbacks (a callback "
            "is code Hydra runs around the job); remove it from the config folder or the overrides"
        )
    for section, allowed in (("launcher", LAUNCHERS), ("sweeper", SWEEPERS)):
        target = (hydra.get(section) or {}).get("_target_")
        if target not in allowed:
            return (
                f"hydra.{section}._target_={one_line(str(target))[:120]}: not a {section} clipdist runs with "
                f"(one of {', '.join(allowed)}); hydra/launcher=slurm is the cluster's"
            )
    launcher = hydra.get("launcher") or {}
    for key in ("setup", "srun_args"):
        if launcher.get(key):
            return (
                f"hydra.launcher.{key}: lines the job's shell or srun would run; clipdist's launcher takes none "
                "(set up the environment in your own sbatch script: slurm/)"
            )
    for section in ("hydra_logging", "job_logging"):
        problem = _logging_problem(hydra.get(section) or {}, f"hydra.{section}")
        if problem:
            return problem
    job = hydra.get("job") or {}
    for name in job.get("env_set") or {}:
        if not ENV_SET.fullmatch(str(name)) or "PLUGIN" in str(name):
            return (
                f"hydra.job.env_set.{one_line(str(name))}: a variable clipdist does not set for a job (it may make "
                "a program load code); set it in the job's own environment"
            )
    if not re.fullmatch(r"[\w-]+", str(job.get("name", "train"))):
        return f"hydra.job.name={one_line(str(job.get('name')))[:80]}: a plain name (letters, digits, - and _)"
    for dotted, wanted in OUTPUT.items():
        value: Any = hydra
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value != wanted:
            return (
                f"hydra.{dotted}={one_line(str(value))[:120]}: clipdist writes a run only into its run directory; "
                "set run_dir=<path> (a sweep's jobs go into <run_dir>/<job number>)"
            )
    return None


def _logging_problem(config, where: str) -> str | None:
    """The first entry of a dictConfig mapping that would build or reach something outside LOGGING_CALLABLES,
    LOGGING_STREAMS and the run directory."""
    items = config.items() if isinstance(config, dict) else enumerate(config) if isinstance(config, list) else ()
    for key, value in items:
        path = f"{where}.{one_line(str(key))}"
        if isinstance(value, (dict, list)):
            problem = _logging_problem(value, path)
            if problem:
                return problem
        elif key in ("()", "class") and value not in LOGGING_CALLABLES:
            return f"{path}={one_line(str(value))[:120]}: logging may build only {', '.join(LOGGING_CALLABLES)}"
        elif isinstance(value, str) and value.startswith("ext://") and value not in LOGGING_STREAMS:
            return f"{path}={one_line(value)[:120]}: logging may name only the streams {', '.join(LOGGING_STREAMS)}"
        elif key == "filename" and not (isinstance(value, str) and LOG_FILE.fullmatch(value)):
            return (
                f"{path}={one_line(str(value))[:120]}: a log file goes into the run directory "
                "(${hydra.runtime.output_dir}/<name>.log)"
            )
    return None
