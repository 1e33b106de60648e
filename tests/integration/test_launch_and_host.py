import os

import pytest
import torch

FAULTS_PER_ALLOCATION = """
import resource, statistics, sys, torch
from clipdist.distributed.host import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
faults = []
for _ in range(25):  # 40 MB: above glibc's largest dynamic mmap threshold (32 MB)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step = torch.empty(10_000_000)
    step.fill_(1)
    del step
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# The first few grow the heap (a 64-byte-aligned block does not fit the exact hole the last one left)
# until the freed blocks have merged: seen settled after 3-7 allocations.
print(kept, statistics.median(faults[15:]))
"""


def test_freed_step_memory_is_reused_not_faulted_in_again():
    import subprocess
    import sys

    def faults(mode):
        out = subprocess.run(
            [sys.executable, "-c", FAULTS_PER_ALLOCATION, mode], capture_output=True, text=True, timeout=120, check=True
        ).stdout.split()
        return out[0], float(out[1])

    kept, kept_faults = faults("keep")
    assert kept == "True"  # glibc (Linux): mallopt accepted
    assert kept_faults < faults("default")[1] / 3  # measured 0 vs 9766: a fresh 40 MB mapping faults in ~10k pages


def test_a_child_killed_while_it_writes_a_line_does_not_stop_the_parents_console():
    """Loader workers and forked ranks are stopped with SIGKILL; one killed inside a console line (holding
    tqdm's write lock, a semaphore a forked child shares with its parent) must not leave the trainer's
    next line waiting forever."""
    import subprocess
    import sys

    script = (
        "import os, signal, time\n"
        "from tqdm import tqdm\n"
        "import clipdist.console\n"
        "tqdm.write('before')\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    tqdm.get_lock().acquire()\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "os.waitpid(pid, 0)\n"
        "tqdm.write('after')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.split() == ["before", "after"], done.stderr


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize("low", [True, False])
def test_low_priority_loader_workers_run_under_sched_idle(tmp_path, low):
    from fixtures import image_bytes, write_tar
    from helpers import train_stream

    write_tar(
        tmp_path / "a.tar",
        [
            (f"{i:03d}.{ext}", image_bytes(i) if ext == "png" else b"a caption")
            for i in range(4)
            for ext in ("png", "txt")
        ],
    )
    stream = train_stream(
        [tmp_path / "a.tar"], 2, lambda image: torch.zeros(1), resampled=True, workers=1, low_priority_workers=low
    )
    try:
        next(stream)
        (worker,) = stream.worker_pids()
        assert (os.sched_getscheduler(worker) == os.SCHED_IDLE) is low
    finally:
        stream.close()


def _out_of_memory_on_rank_1():
    import torch.distributed as dist

    from clipdist.errors import OutOfMemory

    if dist.get_rank() == 1:
        raise OutOfMemory("out of memory on rank 1 (cpu)")
    dist.barrier()  # rank 0 waits for a rank that will never come


def test_an_error_on_one_rank_stops_the_others_at_once_and_is_raised_as_itself():
    """A ClipdistError only one rank meets (out of memory) must not leave the others waiting in a collective until
    its timeout: the failed rank exits 1, the launcher stops the rest and raises the rank's own error."""
    import time

    from clipdist.distributed.launch import launch_local
    from clipdist.errors import OutOfMemory

    started = time.monotonic()
    with pytest.raises(OutOfMemory, match="out of memory on rank 1"):
        launch_local(_out_of_memory_on_rank_1, 2, timeout_s=300)
    assert time.monotonic() - started < 60  # the barrier's own timeout is 300 s


def _a_bug_on_every_rank():
    import torch.distributed as dist

    raise KeyError(f"a bug on rank {dist.get_rank()}")  # no collective: which failure join sees first is its own


def test_a_rank_that_raises_leaves_no_file_in_the_temporary_folder(tmp_path, monkeypatch):
    """torch writes a raising rank's traceback to pytorch-errorfile-*.pickle in the temporary folder and never removes
    it: one file in /tmp for every failed launch (a world=cpu2 run that meets a bug, a failing test)."""
    import tempfile

    from clipdist.distributed.launch import launch_local, share_temp_dir

    share_temp_dir()  # multiprocessing's own folder where it is (removed at exit), before the temporary folder moves
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(Exception, match="a bug on rank [01]"):
        launch_local(_a_bug_on_every_rank, 2, timeout_s=60)
    assert not list(tmp_path.glob("pytorch-errorfile-*")), list(tmp_path.iterdir())


DESTROYED_GROUP_IN_GARBAGE = """
import gc
from datetime import timedelta
import torch.distributed as dist
from clipdist.distributed.launch import launch_local
from clipdist.distributed.network import free_port

def collect():
    gc.collect()  # what a rank's own collections do, sooner or later (a Trainer's config copies did)
    return 1

if __name__ == "__main__":
    gc.disable()  # the garbage below stays until something collects it
    address = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("gloo", init_method=address, rank=0, world_size=1, timeout=timedelta(seconds=30))
    cycle = [dist.group.WORLD]  # as an FSDP2 model's device mesh holds its group, in cycles
    cycle.append(cycle)
    dist.destroy_process_group()
    del cycle
    print(sorted(launch_local(collect, 2, timeout_s=30).items()))
"""


def test_ranks_forked_after_a_process_group_was_destroyed_do_not_hang(tmp_path):
    """A process group made and destroyed in the launching process (a test, `clipdist bench gpu`'s one-rank group)
    and still held in garbage was collected in a forked rank: its gloo destructor joined threads the rank never had,
    and the rank hung. launch_local freezes what the ranks inherit for their collector."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "launch.py"
    script.write_text(DESTROYED_GROUP_IN_GARBAGE)
    process = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the forked ranks too
        process.communicate()
        pytest.fail("the forked ranks hung collecting the destroyed process group")
    assert process.returncode == 0, err[-2000:]
    assert out.strip() == "[(0, 1), (1, 1)]"
