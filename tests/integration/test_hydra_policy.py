"""Hydra that can run nothing clipdist did not install, resolvers that read no environment, and no write outside the
run directory — a corpus by mechanism: each payload (what Hydra would instantiate, read or write) reaches Hydra by
every route a user or a config folder has (a flag in any spelling, a search path, a quoted key, a linked group
folder, an override), and each is refused in one line with nothing run and no secret said.

The payloads run `touch <marker>` if Hydra ever acts on them; the marker must never appear."""

from __future__ import annotations

import os
import pickle

import pytest
import yaml
from helpers import refusal

SECRET = "s3cr3t-hydra-value"

# What a config's hydra node may hold that Hydra would run or write: (YAML under `hydra:`, a phrase of the refusal)
PAYLOADS = {
    "callback": (
        '"callbacks":\n    x:\n      "_target_": subprocess.call\n      _args_: [[touch, MARKER]]',
        "callbacks",
    ),
    "launcher": ("launcher:\n    _target_: os.system", "hydra.launcher._target_"),
    "sweeper": ("sweeper:\n    _target_: os.system", "hydra.sweeper._target_"),
    "logging_factory": (
        "job_logging:\n    version: 1\n    filters:\n      f:\n        (): subprocess.call\n"
        "        args: [touch, MARKER]",
        "logging may build only",
    ),
    "logging_class": (
        "hydra_logging:\n    version: 1\n    handlers:\n      h:\n        class: logging.handlers.SocketHandler\n"
        "        host: 127.0.0.1\n        port: 9",
        "logging may build only",
    ),
    "logging_stream": (
        "hydra_logging:\n    version: 1\n    handlers:\n      h:\n        class: logging.StreamHandler\n"
        "        stream: ext://os.system",
        "streams",
    ),
    "log_file_outside": (
        "job_logging:\n    version: 1\n    handlers:\n      h:\n        class: logging.FileHandler\n"
        "        filename: MARKER",
        "a log file goes into the run directory",
    ),
    "env_set": ("job:\n    env_set:\n      LD_PRELOAD: MARKER.so", "env_set.LD_PRELOAD"),
}  # (hydra.run.dir and output_subdir from a group are overridden by clipdist's own config, _self_ last: no route)


def _folder(root, payload: str, marker, how: str):
    """A config folder offering `model=evil` whose file carries `payload` into the hydra node, written `how`."""
    yaml = f"# @package _global_\nhydra:\n  {payload.replace('MARKER', str(marker))}\n"
    if how == "quoted":
        yaml = yaml.replace("hydra:", '"hydra":')
    real = root / ("real" if how == "linked" else "conf") / "model"
    real.mkdir(parents=True)
    (real / "evil.yaml").write_text(yaml)
    if how == "linked":  # the group folder is a link: Hydra follows it
        (root / "conf").mkdir()
        os.symlink(real, root / "conf" / "model")
    if how == "decoys":  # many harmless files before it
        for index in range(200):
            (real / f"a{index:04d}.yaml").write_text("name: ViT-B-32\n")
    return root / "conf"


ROUTES = {
    "config-dir": lambda folder: ["--config-dir", str(folder)],
    "config-dir=": lambda folder: [f"--config-dir={folder}"],
    "abbreviated": lambda folder: ["--config-d", str(folder)],
    "short": lambda folder: ["-cd", str(folder)],
    "searchpath": lambda folder: [f"hydra.searchpath=[file://{folder}]"],
}


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "code-ran"
    yield path
    assert not path.exists(), "Hydra ran a payload"
    assert not (tmp_path / "code-ran_dir").exists(), "Hydra wrote outside the run directory"


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
@pytest.mark.parametrize("how", ["plain", "quoted", "linked", "decoys"])
def test_a_config_folder_that_would_run_or_write_is_refused_after_composition(
    tmp_path, capsys, monkeypatch, marker, payload, how
):
    text, said = PAYLOADS[payload]
    folder = _folder(tmp_path, text, marker, how)
    ways = ["plain", "quoted", "linked", "decoys"]
    route = list(ROUTES)[(sorted(PAYLOADS).index(payload) + ways.index(how)) % len(ROUTES)]  # each, over the set
    code, lines = refusal(capsys, monkeypatch, *ROUTES[route](folder), "model=evil", f"run_dir={tmp_path / 'run'}")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], (route, lines)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_every_route_to_a_folder_is_checked(tmp_path, capsys, monkeypatch, marker, route):
    folder = _folder(tmp_path, PAYLOADS["callback"][0], marker, "plain")
    code, lines = refusal(capsys, monkeypatch, *ROUTES[route](folder), "model=evil", f"run_dir={tmp_path / 'run'}")
    assert code == 2 and len(lines) == 1 and "callbacks" in lines[0], lines


def test_a_launcher_from_a_folders_group_is_checked(tmp_path, capsys, monkeypatch, marker):
    group = tmp_path / "conf" / "hydra" / "launcher"
    group.mkdir(parents=True)
    (group / "evil.yaml").write_text(f"_target_: os.system\n_args_: ['touch {marker}']\n")
    code, lines = refusal(capsys, monkeypatch, "-m", "--config-dir", str(tmp_path / "conf"), "hydra/launcher=evil")
    assert code == 2 and len(lines) == 1 and "hydra.launcher._target_=os.system" in lines[0], lines


def test_a_sweep_is_checked_as_its_jobs_are_composed(tmp_path, capsys, monkeypatch, marker):
    """`-m` with the payload only in one job's choice: the master config is clean, the job's is not."""
    folder = _folder(tmp_path, PAYLOADS["env_set"][0], marker, "plain")
    code, lines = refusal(
        capsys, monkeypatch, "-m", "--config-dir", str(folder), "model=tiny,evil", f"run_dir={tmp_path / 'run'}"
    )
    assert code == 2 and "env_set.LD_PRELOAD" in lines[-1], lines


@pytest.mark.parametrize(
    "override, said",
    [
        ("+hydra.callbacks.x._target_=os.system", "callbacks"),
        ("hydra.run.dir={tmp}/other", "hydra.run.dir"),
        ("hydra.run.dir=/proc/x", "hydra.run.dir"),
        ("hydra.sweep.subdir=../../x", "hydra.sweep.subdir"),
        ("hydra.output_subdir=/tmp/x", "hydra.output_subdir"),
        ("hydra.job.chdir=true", "hydra.job.chdir"),
        ("hydra.job.name=../x", "hydra.job.name"),
        ("+hydra.job.env_set.PYTHONPATH={tmp}", "env_set.PYTHONPATH"),
        ("+hydra.job.env_set.NCCL_NET_PLUGIN=x", "env_set.NCCL_NET_PLUGIN"),
        ("hydra/job_logging=default", None),  # Hydra's own file log, in the run directory: allowed
        # values Hydra acts on without checking them itself: its assertion, KeyError: one line, not a bug
        ("hydra.verbose=5", "hydra.verbose"),
        ("hydra.job.env_copy=[CLIPDIST_NEVER_SET_VARIABLE]", "KeyError: 'CLIPDIST_NEVER_SET_VARIABLE'"),
    ],
)
def test_overrides_of_the_hydra_node_are_held_to_the_same_policy(tmp_path, capsys, monkeypatch, override, said):
    argument = override.format(tmp=tmp_path)
    if said is None:
        from clipdist import hydra_policy
        from clipdist.config import register

        register()
        hydra_policy.install()
        from hydra import compose, initialize_config_module

        with initialize_config_module("clipdist.conf", version_base=None):
            cfg = compose("config", [argument], return_hydra_config=True)
        assert hydra_policy.hydra_problem(cfg) is None
        return
    code, lines = refusal(capsys, monkeypatch, argument, f"run_dir={tmp_path / 'run'}")
    assert code == 2 and len(lines) == 1 and said in lines[0], lines
    assert not (tmp_path / "other").exists()


def test_a_logging_config_hydra_cannot_apply_is_one_line(tmp_path):
    """dictConfig's own failure (a handler the config lacks), raised where Hydra sets up the job's logging: one line,
    exit 2, no bug report (a process of its own: the failed set-up leaves this one's logging half-made)."""
    from helpers import REPO, python

    result = python(
        [str(REPO / "train.py"), "+hydra.job_logging.root.handlers=[nope]", f"run_dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        timeout=120,
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert "Hydra could not set up logging (ValueError: Unable to configure root logger)" in lines[0]
    assert not list(tmp_path.glob("**/clipdist-bug-*"))


@pytest.mark.parametrize("flag", ["--experimental-rerun", "--experimental", "--exp", "--experimental-rerun="])
def test_experimental_rerun_is_refused_in_every_spelling(tmp_path, capsys, monkeypatch, marker, flag):
    class Runs:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    pickled = tmp_path / "config.pickle"
    pickled.write_bytes(pickle.dumps(Runs()))
    arguments = [flag + str(pickled)] if flag.endswith("=") else [flag, str(pickled)]
    code, lines = refusal(capsys, monkeypatch, *arguments)
    assert code == 2 and len(lines) == 1 and "unpickles" in lines[0], lines


@pytest.mark.parametrize(
    "value",
    [
        "${oc.env:CLIPDIST_HYDRA_SECRET}",
        "${ oc.env:CLIPDIST_HYDRA_SECRET}",
        "${oc.env: CLIPDIST_HYDRA_SECRET, x}",
        "x-${oc.env:CLIPDIST_HYDRA_SECRET}-y",
        '${oc.decode:"${oc.env:CLIPDIST_HYDRA_SECRET}"}',
        '${oc.create:"{a: ${oc.env:CLIPDIST_HYDRA_SECRET}}"}',
        '${oc.decode:"x"}',
    ],
)
@pytest.mark.parametrize("key, extra", [("model.name", ()), ("data.train_shards", ("--cfg", "job", "--resolve"))])
def test_no_resolver_reads_the_environment_in_any_spelling(tmp_path, capsys, monkeypatch, value, key, extra):
    monkeypatch.setenv("CLIPDIST_HYDRA_SECRET", SECRET)
    code, lines = refusal(capsys, monkeypatch, *extra, f"{key}='{value}'", f"run_dir={tmp_path / 'run'}")
    assert code == 2 and len(lines) == 1 and "do not read the environment" in lines[0], lines
    assert SECRET not in "".join(lines) and not (tmp_path / "run").exists()


def test_a_config_folder_value_that_reads_the_environment_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CLIPDIST_HYDRA_SECRET", SECRET)
    group = tmp_path / "conf" / "model"
    group.mkdir(parents=True)
    (group / "mine.yaml").write_text("name: ${ oc.env:CLIPDIST_HYDRA_SECRET}\n")
    code, lines = refusal(capsys, monkeypatch, "--config-dir", str(tmp_path / "conf"), "model=mine")
    assert code == 2 and "do not read the environment" in lines[0] and SECRET not in "".join(lines), lines


def test_a_yaml_tag_that_builds_python_is_one_line(tmp_path, capsys, monkeypatch, marker):
    group = tmp_path / "conf" / "model"
    group.mkdir(parents=True)
    (group / "tag.yaml").write_text(f'name: !!python/object/apply:os.system ["touch {marker}"]\n')
    code, lines = refusal(capsys, monkeypatch, "--config-dir", str(tmp_path / "conf"), "model=tag")
    assert code == 2 and len(lines) == 1 and "not plain YAML data" in lines[0], lines


def _alias_bomb(levels: int) -> str:
    """A few lines of YAML: level i a list of ten aliases of level i-1 — 10^levels values once copied out."""
    lines = ["# @package _global_", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join([*lines, "model:", "  name: clipdist-tiny", ""])


@pytest.mark.parametrize(
    "text, said",
    [
        (_alias_bomb(9), "values through its aliases (at most 100,000: an alias bomb)"),  # 10^9: hours, then memory
        ("# @package _global_\nx: " + "[" * 20000 + "]" * 20000 + "\n", "nested too deeply to read"),
    ],
    ids=["alias-bomb", "deep"],
)
def test_a_config_file_that_expands_without_bound_is_one_line(tmp_path, capsys, monkeypatch, text, said):
    """A config folder's YAML whose aliases copy out past MAX_YAML_VALUES (10^6 took OmegaConf over 120 s and 650 MB
    here, 10^9 would take the machine) or nested past the reader's recursion: refused in one line naming the file,
    at once; an alias or two (a legitimate anchor) still reads."""
    group = tmp_path / "conf" / "model"
    group.mkdir(parents=True)
    (group / "evil.yaml").write_text(text)
    code, lines = refusal(capsys, monkeypatch, "--config-dir", str(tmp_path / "conf"), "model=evil")
    assert code == 2 and len(lines) == 1 and f"{group / 'evil.yaml'}: the YAML document" in lines[0], lines
    assert said in lines[0], lines
    from clipdist import hydra_policy

    assert hydra_policy._expanded_values(yaml.compose(_alias_bomb(3)), {}) < hydra_policy.MAX_YAML_VALUES
    from omegaconf import OmegaConf

    assert OmegaConf.create("base: &b {lr: 0.1}\nother: *b\n").other.lr == 0.1


def test_plain_data_folders_and_cfg_job_still_work(tmp_path, capsys, monkeypatch):
    """What works today keeps working: a user's model preset from --config-dir (any spelling), shown by --cfg job."""
    from helpers import hydra_composes_once

    from clipdist.cli import train_main

    group = tmp_path / "conf" / "model"
    group.mkdir(parents=True)
    (group / "mine.yaml").write_text("name: clipdist-tiny\nlock_image: false\n")
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    for route in (["--config-dir", str(tmp_path / "conf")], ["--config-d", str(tmp_path / "conf")]):
        with hydra_composes_once():
            train_main(["--cfg", "job", *route, "model=mine", "optim.lr=0.002"])
        shown = capsys.readouterr().out
        assert "name: clipdist-tiny" in shown and "lr: 0.002" in shown, shown


@pytest.mark.parametrize(
    "flags, said",
    [
        (
            ["-m", "optim.lr=0.1,0.2", "--cfg", "job"],
            "Only one of --run, --multirun, --cfg, --info and --shell_completion",
        ),
        (["--shell-completion"], "Expecting one subcommand from ['install', 'uninstall', 'query']"),
    ],
)
def test_hydras_own_check_of_its_flags_is_one_line(tmp_path, capsys, monkeypatch, flags, said):
    """Hydra refuses flags that do not go together with a ValueError of its own: raised before its reporting starts
    (-m with --cfg: the interpreter's traceback) or inside it (a bug report): one line, exit 2."""
    monkeypatch.chdir(tmp_path)
    code, lines = refusal(capsys, monkeypatch, *flags)
    assert code == 2 and len(lines) == 1 and said in lines[0], lines
    assert not list(tmp_path.glob("clipdist-bug-*"))
