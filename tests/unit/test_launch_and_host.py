import os

import pytest

from clipdist.data import workers as loader
from clipdist.distributed import host
from clipdist.distributed.host import intra_op_threads
from clipdist.distributed.world import _expand_first_host, detect_env


def test_torchrun_variables_win():
    env = detect_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"})
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (3, 8, 3, "torchrun")


def test_srun_variables_map_to_rank_world_and_local_rank():
    env = detect_env(
        {
            "SLURM_PROCID": "13",
            "SLURM_NTASKS": "64",
            "SLURM_LOCALID": "5",
            "SLURM_JOB_NODELIST": "gpu[003-010]",
            "SLURM_JOB_ID": "4242",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (13, 64, 5, "slurm")


def test_single_process_without_launcher_variables():
    assert detect_env({}).launcher == "single"
    assert detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).world_size == 1


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' in the environment is not a count"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' in the environment is not a count"),
        ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK=5 with WORLD_SIZE=2 in the environment: no launcher gives that rank"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK='x' in the environment is not a count"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "two"}, "SLURM_NTASKS='two' in the environment is not a count"),
        ({"SLURM_PROCID": "4", "SLURM_NTASKS": "2"}, "SLURM_PROCID=4 with SLURM_NTASKS=2 in the environment"),
    ],
)
def test_launcher_variables_no_launcher_sets_are_refused_in_one_line(environ, message):
    """A shell's leftover RANK=5 with WORLD_SIZE=2 ran silent (only rank 0 reports a refusal), WORLD_SIZE=abc was an
    internal error: train.py says it before anything starts (world.launch_problem)."""
    from clipdist.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        detect_env(environ)


def test_first_host_of_a_slurm_node_list():
    assert _expand_first_host("gpu[003-005,9],cpu1") == "gpu003"
    assert _expand_first_host("node7") == "node7"
    assert _expand_first_host("rack[2-3]-ib,gpu1") == "rack2-ib"


def test_intra_op_threads_leave_a_core_to_each_loader_worker():
    cpus = len(os.sched_getaffinity(0))
    assert intra_op_threads(None, 1, 0, {})[0] == cpus
    assert intra_op_threads(None, 1, 1, {})[0] == max(1, cpus - 1)
    assert intra_op_threads(None, 1, 4, {"SLURM_CPUS_PER_TASK": "12"}) == (
        8,
        "SLURM_CPUS_PER_TASK=12 - 4 loader worker(s)",
    )
    assert intra_op_threads(None, 2, 8, {"SLURM_CPUS_PER_TASK": "4"})[0] == 1  # never fewer than one


@pytest.mark.parametrize(
    "setting, cpus, readers_per_rank, readers, workers",
    [
        (3, "1", None, 3, 3),
        (0, "8", None, 1, 0),  # a number is taken as given
        # a CPU rank: one worker (and reader) per CPU, at most 4
        (None, "1", None, 1, 1),
        (None, "2", None, 2, 2),
        (None, "4", None, 4, 4),
        (None, "32", None, 4, 4),
        (None, "32", 2, 2, 2),
        (None, "32", 0, 1, 1),  # no more than the readers each rank reads
        (None, "12", None, 11, 11),
        (None, "12", 5, 5, 5),  # a GPU rank: every CPU it can spare
    ],
)
def test_automatic_loader_workers_follow_the_rank_cpus_and_readers(setting, cpus, readers_per_rank, readers, workers):
    device = "cuda" if cpus == "12" else "cpu"
    environ = {"SLURM_CPUS_PER_TASK": cpus}
    plan = loader.loader_workers(setting, 1, readers_per_rank, environ=environ, device_type=device)
    assert (plan.readers, plan.workers) == (readers, workers)
    assert plan.why.startswith(
        "data.workers" if setting is not None else f"data.workers=auto: SLURM_CPUS_PER_TASK={cpus}"
    )


def test_explicit_thread_counts_are_taken_as_given():
    assert intra_op_threads(3, 1, 2, {"OMP_NUM_THREADS": "1"}) == (3, "world.threads")
    assert intra_op_threads(None, 2, 2, {"OMP_NUM_THREADS": "5", "SLURM_CPUS_PER_TASK": "12"}) == (5, "OMP_NUM_THREADS")


def test_waiting_openmp_threads_spin_briefly_unless_the_user_says_otherwise():
    environ = {}
    assert host.spin_briefly(environ) == "GOMP_SPINCOUNT=300" and environ == {"GOMP_SPINCOUNT": "300"}
    assert host.openmp_wait(environ) == "GOMP_SPINCOUNT=300"
    for given in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "infinite"}):
        environ = dict(given)
        assert host.spin_briefly(environ) is None and environ == given
    assert host.openmp_wait({}) == "libgomp's default spinning"


def test_loader_workers_priority_is_the_setting_where_there_are_workers():
    from clipdist.data.workers import loader_priority

    assert loader_priority("normal", 2) == ("normal", "data.worker_priority=normal")
    assert loader_priority("low", 1) == ("low", "data.worker_priority=low")
    assert loader_priority("low", 0)[0] == "normal"  # no workers: nothing to lower


def test_local_ranks_this_machines_memory_cannot_hold_are_refused_before_any_fork(monkeypatch):
    """A mistyped count (`world.procs_per_node=5000`, `gradcheck --world 99999`) is refused in one line, on every
    route that forks local ranks, before a process starts."""
    from types import SimpleNamespace

    from clipdist.distributed import launch, world
    from clipdist.errors import ConfigError

    free = 3 * world.RANK_MEMORY_FLOOR + 1
    monkeypatch.setattr(world.psutil, "virtual_memory", lambda: SimpleNamespace(available=free))
    world.check_local_ranks(3, "three")  # what fits is taken
    with pytest.raises(ConfigError, match=r"^four: 4 local ranks need at least 0\.5 GiB .* start at most 3 here"):
        world.check_local_ranks(4, "four")
    preset = SimpleNamespace(name="cpu4", nodes=1, procs_per_node=4, world_size=4, spawn=True)
    with pytest.raises(ConfigError, match=r"^world=cpu4 with world.procs_per_node=4: 4 local ranks"):
        world.check_world(preset, detect_env({}))
    forked = []
    monkeypatch.setattr(launch.mp, "start_processes", lambda *args, **kwargs: forked.append(args))
    with pytest.raises(ConfigError, match="this launch: 4 local ranks"):
        launch.launch_local(print, 4)
    assert not forked


def test_train_refuses_a_rank_no_launcher_gives_before_anything_starts(tmp_path, capsys, monkeypatch):
    from helpers import refusal

    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, lines = refusal(capsys, monkeypatch, f"run_dir={tmp_path / 'run'}")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: RANK=5 with WORLD_SIZE=2"), lines
    assert not (tmp_path / "run").exists()
