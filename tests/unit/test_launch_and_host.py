import itertools
import os

import pytest
import torch

from clipdist.data import workers as loader
from clipdist.distributed import host
from clipdist.distributed.host import intra_op_threads
from clipdist.distributed.launch import _expand_first_host, detect_env


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
    "setting, cpus, shards_per_rank, readers, workers, choices",
    [
        (3, "1", None, 3, 3, (3,)),
        (0, "8", None, 1, 0, (0,)),  # a number is taken as given
        # a CPU rank: readers up to its CPUs, the most divisible; it starts with no more workers than its spare CPUs
        # (and at most 4); a rank of one CPU has no time for a second worker
        (None, "1", None, 1, 1, (1,)),
        (None, "2", None, 2, 1, (1, 2)),
        (None, "4", None, 4, 2, (1, 2, 4)),
        (None, "8", None, 8, 4, (1, 2, 4, 8)),  # 7 spare CPUs: 8 readers (as many divisors as 6, and larger)
        (None, "6", None, 6, 3, (1, 2, 3, 6)),  # 5 spare: 6, so start with 3 (4 is not a divisor)
        (None, "32", None, 30, 3, (1, 2, 3, 5, 6, 10, 15, 30)),  # 31 spare: 30 (as many divisors as 24, and larger)
        (None, "32", 2, 2, 2, (1, 2)),
        (None, "32", 0, 1, 1, (1,)),  # no more than the shards each rank reads
        (None, "12", None, 11, 11, (11,)),
        (None, "12", 5, 5, 5, (5,)),  # a GPU rank: every CPU it can spare
    ],
)
def test_automatic_loader_workers_follow_the_rank_cpus_and_the_shards(
    setting, cpus, shards_per_rank, readers, workers, choices
):
    device = "cuda" if cpus == "12" else "cpu"
    plan = loader.loader_workers(setting, 1, shards_per_rank, environ={"SLURM_CPUS_PER_TASK": cpus}, device_type=device)
    assert (plan.readers, plan.workers, plan.choices) == (readers, workers, choices)
    assert plan.why.startswith(
        "data.workers" if setting is not None else f"data.workers=auto: SLURM_CPUS_PER_TASK={cpus}"
    )
    assert plan.cpus == (None if setting is not None else int(cpus))


def measured_workers(
    choices, workers, cpus, load_s, compute_s, *, fixed_threads=None, wait_s=0.0, rank_cpu_s=None, whole=True
):
    """A MeasuredWorkers fed 30 steps of a loader taking `load_s` CPU seconds a batch and a step computing
    `compute_s` with the threads `workers` workers leave of `cpus`, the rank's process spending `rank_cpu_s`
    CPU seconds a step (None: the cores are not counted), its workers making whole batches or not (`whole`);
    returns what it decided."""
    threads = (lambda w: fixed_threads) if fixed_threads else (lambda w: max(1, cpus - w))
    clock = itertools.count(0.0, rank_cpu_s or 0.0).__next__
    tuner = loader.MeasuredWorkers(
        choices, workers, threads, cpus=cpus if rank_cpu_s else None, clock=clock, whole=lambda w: whole
    )
    decisions = [tuner.observe(wait_s, compute_s + wait_s, load_s) for _ in range(30)]
    assert all(decision == (None, None) for decision in decisions[:29])
    assert tuner.observe(wait_s, compute_s + wait_s, load_s) == (None, None)  # once only
    return decisions[29]


def test_the_loader_worker_count_follows_the_loader_and_the_step_the_run_measures():
    # 16 CPUs, 12 readers, started with 4 workers (12 threads). A loader-bound run (a batch: 1.2 s of a worker's
    # CPU, the step 0.1 s): 4 workers give 3.3 batches/s; 6 give 5 while the step slows to 0.12 s (8.3/s); 12
    # would give 10 but leave 4 threads (3.3/s)
    workers, line = measured_workers((1, 2, 3, 4, 6, 12), 4, 16, load_s=1.2, compute_s=0.1, wait_s=0.2)
    assert workers == 6 and line.startswith(
        "4 -> 6 loader worker(s), 12 -> 10 intra-op thread(s): over steps 11-30 "
        "a batch took 1200 ms of a loader worker's CPU and the step 100 ms"
    )
    # A model-bound run (0.05 s a batch, 1 s a step): one worker keeps up and frees three cores for threads
    workers, line = measured_workers((1, 2, 3, 4, 6, 12), 4, 16, load_s=0.05, compute_s=1.0)
    assert workers == 1 and line.startswith("4 -> 1 loader worker(s), 12 -> 15 intra-op thread(s)")
    # Close to balanced: no restart for less than the 10% it would gain
    workers, line = measured_workers((1, 2, 4), 2, 8, load_s=0.39, compute_s=0.2)
    assert workers is None and line.startswith("2 loader worker(s) kept: ")
    # Threads fixed (world.threads, OMP_NUM_THREADS): only the loader's side counts — the fewest that keep up
    assert measured_workers((1, 2, 3, 6), 1, 8, load_s=0.5, compute_s=0.3, fixed_threads=2)[0] == 2
    # One worker beyond the spare CPUs (1 rank, 2 cores, 2 readers): taken where the loader is what the rank waits
    # for and the cores have time left — 224-px web photos: a batch 371 ms of a worker, the step 220 ms (240 ms of
    # the rank's CPU): 1 worker 2.7 batches/s, 2 workers sharing the cores 2 / 0.611 = 3.3
    workers, line = measured_workers((1, 2), 1, 2, load_s=0.371, compute_s=0.22, wait_s=0.15, rank_cpu_s=0.24)
    assert workers == 2 and line.startswith(
        "1 -> 2 loader worker(s): over steps 11-30 a batch took 371 ms of a "
        "loader worker's CPU and the step 220 ms (240 ms of the rank's CPU)"
    )
    # ... only where each worker makes whole batches (data.pieces, a token budget, a replicated split: every worker's
    # rows of every batch, which 2 workers sharing the cores ran slower than 1); the log says what was left out
    workers, line = measured_workers(
        (1, 2), 1, 2, load_s=0.371, compute_s=0.22, wait_s=0.15, rank_cpu_s=0.24, whole=False
    )
    assert (
        workers is None
        and line.startswith("1 loader worker(s) kept: ")
        and line.endswith("; 2 would measure faster but, sharing the rank's cores, would not each make whole batches")
    )
    # ... and not where the step is the limit (digits: 36 ms a batch, the step 165 ms) or the cores are (a rank of
    # one CPU: 1 / (L + S) whatever the count)
    workers, line = measured_workers((1, 2), 1, 2, load_s=0.036, compute_s=0.165, rank_cpu_s=0.17)
    assert workers is None and line.startswith("1 loader worker(s) kept: ")
    assert measured_workers((1, 2), 1, 1, load_s=0.186, compute_s=0.11, wait_s=0.08, rank_cpu_s=0.12)[0] is None
    # the same loader-bound run without the cores counted would have moved: the cores' bound is what stops it
    assert measured_workers((1, 2), 1, 1, load_s=0.186, compute_s=0.11, wait_s=0.08)[0] == 2
    # One choice (a GPU rank, an explicit count): said, not changed
    assert measured_workers((7,), 7, 8, load_s=0.5, compute_s=0.1, wait_s=0.01)[1].startswith("the loader keeps up: ")
    assert measured_workers((3,), 3, 8, load_s=0.5, compute_s=0.1, wait_s=0.1)[1].startswith(
        "the loader limits this run: it needs ~5 worker(s) to keep up, this rank has 3: "
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


def test_loader_workers_priority_is_measured_where_cpu_ranks_cannot_spare_them_a_core():
    from clipdist.data.workers import loader_priority

    two_cpus = {"SLURM_CPUS_PER_TASK": "2"}
    assert loader_priority("auto", "cpu", 1, 1, two_cpus)[0] == "normal"  # a core for the rank, one for the worker
    mode, why = loader_priority("auto", "cpu", 1, 2, two_cpus)
    assert mode == "measured" and "SLURM_CPUS_PER_TASK=2" in why
    assert loader_priority("auto", "cuda", 1, 4, two_cpus)[0] == "normal"  # GPU ranks may spin on a sync
    assert loader_priority("low", "cuda", 1, 1, two_cpus)[0] == "low"
    assert loader_priority("normal", "cpu", 1, 8, two_cpus)[0] == "normal"
    assert loader_priority("low", "cpu", 1, 0, two_cpus)[0] == "normal"  # no workers: nothing to lower


def priority_run(waits: list[float], allowed: bool = True, step_s: float = 1.0):
    """MeasuredPriority over steps waiting `waits` seconds each: (the calls it made, its lines by step)."""
    from clipdist.data.workers import MeasuredPriority

    calls = []

    def set_low(low):
        calls.append(low)
        return allowed or low

    control, lines = MeasuredPriority(set_low, skip=2, window=4), {}
    for step, wait in enumerate(waits, 1):
        if line := control.observe(wait, step_s):
            lines[step] = line
    return calls, lines


def test_loader_workers_go_idle_only_when_the_run_shows_the_loader_keeps_up():
    calls, lines = priority_run([5.0, 5.0] + [0.001] * 4 + [0.05] * 8)  # warm-up waits are not counted
    assert calls == [True] and list(lines) == [6]
    assert "to idle priority: over steps 3-6 the rank waited 0.1% of its time" in lines[6]
    calls, lines = priority_run([0.0] * 2 + [0.3] * 12)  # loader-bound: stays normal, decided once
    assert calls == [] and list(lines) == [6] and "stay at normal priority" in lines[6] and "30.0%" in lines[6]
    calls, lines = priority_run([0.0] * 6 + [0.05] * 4 + [0.4] * 4 + [0.0] * 8)  # contention after going idle
    assert calls == [True, False] and list(lines) == [6, 14] and "back to normal priority" in lines[14]
    calls, lines = priority_run([0.0] * 6 + [0.4] * 4, allowed=False)  # an unprivileged process cannot go back
    assert calls == [True, False] and "cannot return" in lines[10] and "data.worker_priority=normal" in lines[10]


def test_a_worker_restart_measures_priority_afresh_and_says_which_steps():
    """LoaderTuning: a loader-bound rank (1 worker of 2 choices) moves to 2 workers at step 30; the 2 workers share
    the rank's cores, so their priority is measured from their restart: warm-up to step 40, decided over 41-60."""
    from clipdist.data.workers import LoaderPlan, LoaderTuning

    class Stream:
        low_priority_workers, counts = None, []

        def set_workers(self, workers):
            self.counts.append(workers)

        def set_worker_priority(self, low):
            return True

        def worker_readers(self, workers):  # each worker makes whole batches from readers of its own
            return [[worker] for worker in range(workers)]

    stream, threads = Stream(), torch.get_num_threads()  # a move sets this process's intra-op threads: put back
    tuning = LoaderTuning(
        stream,
        LoaderPlan(2, 1, (1, 2), "test", cpus=2),
        lambda workers: ("normal", "a core each") if workers == 1 else ("measured", "shared"),
        lambda workers: 1,
    )
    assert tuning.started == "loader workers at normal priority (a core each)"
    try:
        said = {step: tuning.observe(0.15, 0.37, 0.37) for step in range(1, 31)}
        said.update({step: tuning.observe(0.0, 0.25, 0.37) for step in range(31, 61)})
    finally:
        torch.set_num_threads(threads)
    assert stream.counts == [2] and said[30][0].startswith("1 -> 2 loader worker(s): over steps 11-30")
    assert said[30][1] == "loader workers at normal priority (shared)"
    assert [step for step, lines in said.items() if lines] == [30, 60]
    assert said[60] == [
        "loader workers to idle priority: over steps 41-60 the rank waited 0.0% of its time for data "
        "(the loader keeps up); they now decode in the time the rank leaves idle"
    ]
