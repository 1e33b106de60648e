"""The sbatch scripts and the Hydra SLURM launcher under a real SLURM (slurmctld + slurmd + munged on this machine).

The cluster is started for this module from Debian's slurm-wlm and munge (`.ci/run` installs
them), with its own config, key, sockets, ports and spool in a temporary folder, and stopped
afterwards. Jobs use world=slurm_cpu (gloo srun tasks) and the tiny model.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import QUIET, REPO, read_jsonl

from clipdist.distributed.launch import free_port

pytestmark = pytest.mark.slurm
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "srun", "sinfo")
SMALL = ["world=slurm_cpu", *QUIET, "world.batch_per_device=16"]


class Hosts:
    """Nodes on this machine: each a network and UTS namespace with its own address and hostname, on a bridge.

    The namespaces, their veth pairs and the bridge (10.213.x.0/24, the controller on .1) are made here and
    removed by `remove`; a node's processes see an /etc/hosts naming every node and the controller. Traffic
    stays on the bridge."""

    def __init__(self, root: Path, count: int, controller: str):
        tag = f"{os.getpid() % 0xFFFFF:x}"
        self.bridge, self.controller = f"cdbr{tag}", controller
        taken = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
        subnet = next(f"10.213.{n}" for n in range(1, 255) if f" 10.213.{n}." not in taken)
        self.gateway = f"{subnet}.1"
        self.names = [f"cd{tag}n{i}" for i in range(1, count + 1)]
        self.addresses = [f"{subnet}.{10 + i}" for i in range(1, count + 1)]
        self.namespaces = [f"cd{tag}ns{i}" for i in range(1, count + 1)]
        self.hosts_file = root / "hosts"
        self.hosts_file.write_text(
            f"127.0.0.1 localhost\n{self.gateway} {controller}\n"
            + "".join(f"{address} {name}\n" for address, name in zip(self.addresses, self.names))
        )

    def create(self) -> None:
        def ip(*arguments: str) -> None:
            subprocess.run(["ip", *arguments], check=True, capture_output=True, text=True, timeout=30)

        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, (namespace, address) in enumerate(zip(self.namespaces, self.addresses)):
            veth = f"{self.bridge}v{i}"
            ip("netns", "add", namespace)
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", namespace, "link", "set", "eth0", "up")
            ip("-n", namespace, "link", "set", "lo", "up")

    def on(self, index: int, command: list[str]) -> list[str]:
        """`command` on node `index`: in its namespaces, with its hostname and the nodes' /etc/hosts."""
        # nsenter, not `ip netns exec`: that mounts a fresh /sys without the cgroup tree slurmd needs.
        return [
            "nsenter",
            f"--net=/run/netns/{self.namespaces[index]}",
            "--",
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"',
            "sh",
            self.names[index],
            str(self.hosts_file),
            *command,
        ]

    def remove(self) -> None:
        for namespace in self.namespaces:  # its end of the veth pair goes with it
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)


class LocalSlurm:
    """A cluster on this machine: its config, daemons and the environment that points clients at it.

    One node (this host), or `nodes` nodes, each slurmd in its own namespaces (`Hosts`)."""

    def __init__(self, root: Path, nodes: int = 0):
        self.root = root
        self.processes: list[subprocess.Popen] = []
        host = socket.gethostname()
        self.hosts = Hosts(root, nodes, host) if nodes else None
        state, spool = root / "state", root / "spool"
        state.mkdir()
        spool.mkdir()
        if self.hosts:
            controller = f"{host}({self.hosts.gateway})"
            node_lines = "".join(
                f"NodeName={name} NodeAddr={address} CPUs=2 RealMemory=8000 State=UNKNOWN\n"
                for name, address in zip(self.hosts.names, self.hosts.addresses)
            )
        else:
            controller, node_lines = host, f"NodeName={host} CPUs=8 RealMemory=8000 State=UNKNOWN\n"
        self.conf = root / "slurm.conf"
        self.conf.write_text(f"""\
ClusterName=clipdist-test
SlurmctldHost={controller}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root / "munge.socket"},cred_expire=10
StateSaveLocation={state}
SlurmdSpoolDir={spool}/%n
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd-%n.pid"}
SlurmctldLogFile={root / "slurmctld.log"}
SlurmdLogFile={root / "slurmd-%n.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
MinJobAge=600
JobRequeue=1
KillWait=10
{node_lines}PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        # Jobs inherit this environment (sbatch --export=ALL): this Python first on PATH, and no
        # OMP_NUM_THREADS, so the tasks' threads come from --cpus-per-task as on a cluster.
        # Nor a launcher's variables another test may have left in this process (a login shell has none).
        launcher = {
            "OMP_NUM_THREADS",
            "MASTER_ADDR",
            "MASTER_PORT",
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
        }
        self.env = {
            **{k: v for k, v in os.environ.items() if k not in launcher},
            "SLURM_CONF": str(self.conf),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        }

    def start(self) -> None:
        key = self.root / "munge.key"
        subprocess.run(
            ["mungekey", "--create", f"--keyfile={key}", "--force"], check=True, timeout=30, capture_output=True
        )
        key.chmod(0o600)
        self._daemon(
            [
                "munged",
                "-F",
                "--force",
                f"--socket={self.root / 'munge.socket'}",
                f"--key-file={key}",
                f"--pid-file={self.root / 'munged.pid'}",
                f"--log-file={self.root / 'munged.log'}",
                f"--seed-file={self.root / 'munged.seed'}",
            ]
        )
        self._daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)])
        if self.hosts:
            self.hosts.create()
            for index, name in enumerate(self.hosts.names):
                (self.root / "spool" / name).mkdir()
                self._daemon(self.hosts.on(index, ["slurmd", "-D", "-N", name, "-f", str(self.conf)]), f"slurmd-{name}")
        else:
            (self.root / "spool" / socket.gethostname()).mkdir()
            self._daemon(["slurmd", "-D", "-f", str(self.conf)])
        nodes = len(self.hosts.names) if self.hosts else 1
        deadline = time.time() + 60
        while time.time() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%t", check=False).stdout.split()
            if states == ["idle"] * nodes:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the nodes never became idle (sinfo: {states!r}); logs in {self.root}")

    def _daemon(self, command: list[str], name: str | None = None) -> None:
        name = name or command[0]
        log = open(self.root / f"{name}.out", "w")
        self.processes.append(
            subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        )
        time.sleep(0.3)
        if self.processes[-1].poll() is not None:
            raise RuntimeError(f"{name} exited at start: {(self.root / f'{name}.out').read_text()[-500:]}")

    def stop(self) -> None:
        for job in self.run("squeue", "-h", "-o", "%i", check=False).stdout.split():
            self.run("scancel", job, check=False)
        for process in reversed(self.processes):
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if self.hosts:
            self.hosts.remove()

    def run(self, *command: str, check: bool = True, cwd: Path | None = None, timeout: float = 60):
        return subprocess.run(
            list(command), env=self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=check
        )

    def sbatch(self, cwd: Path, *arguments: str, extra_env: dict | None = None) -> int:
        result = subprocess.run(
            ["sbatch", "--parsable", *arguments],
            env={**self.env, **(extra_env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        text = self.run("scontrol", "show", "job", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_for_steps(self, job_id: int, run_dir: Path, steps: int, log: Path, seconds: float = 240) -> None:
        """Until the job's run has logged `steps` steps; fails if the job ends first or the time runs out."""
        deadline = time.time() + seconds
        while not ((run_dir / "train_log.jsonl").exists() and len(read_jsonl(run_dir / "train_log.jsonl")) >= steps):
            assert time.time() < deadline and not finished(self.job(job_id)), (self.job(job_id), _tail(log))
            time.sleep(0.3)

    def stopped_and_requeued(self, cwd: Path, steps: int, *arguments: str) -> tuple[Path, str]:
        """Submit, wait for `steps` logged steps, USR1 -> checkpoint -> requeue -> run to the end; the run directory
        and the job's one log, once the job has COMPLETED."""
        job_id = self.sbatch(cwd, *arguments)
        run_dir, output = cwd / "runs" / f"slurm-{job_id}", cwd / f"slurm-{job_id}.out"
        self.wait_for_steps(job_id, run_dir, steps, output)
        job = self.usr1_and_requeue(job_id)
        log = output.read_text()
        assert job["JobState"] == "COMPLETED", log[-3000:]
        return run_dir, log

    def usr1_and_requeue(self, job_id: int) -> dict[str, str]:
        """What the time limit does: USR1 to the batch script (checkpoint, requeue); the job once it has ended."""
        self.run("scancel", "--signal=USR1", "--batch", str(job_id))
        self.wait(job_id, lambda job: job["Restarts"] == "1", 120)
        return self.wait(job_id, finished, 400, poke_requeued=True)

    def wait(self, job_id: int, until, seconds: float, poke_requeued: bool = False) -> dict[str, str]:
        deadline, held_since = time.time() + seconds, None
        while time.time() < deadline:
            job = self.job(job_id)
            if until(job):
                return job
            if poke_requeued and job["JobState"] == "PENDING" and job.get("Reason") == "BeginTime":
                # A requeued job waits cred_expire before it may start again; no need to wait here. But not
                # within the second its first run was killed in: slurmd compares credential times in whole
                # seconds and kills the restart as "Job credential revoked" (seen when the stop was quick).
                held_since = held_since or time.time()
                if time.time() - held_since >= 2:
                    self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} did not reach the state in {seconds} s: {self.job(job_id)}")


def _slurm_unavailable() -> str | None:
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "a local SLURM cluster needs root (slurmd runs the jobs)"
    return None


def _started(root: Path, nodes: int = 0):
    reason = _slurm_unavailable()
    if reason:
        pytest.skip(reason)
    slurm = LocalSlurm(root, nodes)
    try:
        slurm.start()
    except (RuntimeError, subprocess.SubprocessError) as error:
        slurm.stop()
        pytest.skip(f"SLURM could not be started here: {error}")
    return slurm


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    slurm = _started(tmp_path_factory.mktemp("slurm"))
    yield slurm
    slurm.stop()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    missing = [tool for tool in ("ip", "nsenter", "unshare") if shutil.which(tool) is None]
    if missing:
        pytest.skip(
            f"two nodes need network namespaces ({', '.join(missing)} missing: apt-get install iproute2 util-linux)"
        )
    slurm = _started(tmp_path_factory.mktemp("slurm2"), nodes=2)
    yield slurm
    slurm.stop()


SBATCH_CPU = ["--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", "--time=10"]
SCRIPT = str(REPO / "slurm" / "train_1node.sbatch")


def finished(job: dict) -> bool:
    return job["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def test_sbatch_script_from_another_directory_checkpoints_on_usr1_requeues_and_resumes_into_one_log(
    cluster, cache_dir, tmp_path
):
    run_dir, log = cluster.stopped_and_requeued(
        tmp_path,
        8,
        *SBATCH_CPU,
        SCRIPT,
        *SMALL,
        f"data.cache_dir={cache_dir}",
        "optim.max_steps=60",
        "eval_every=60",
        "checkpoint_every=1000",
    )
    stopped = [int(step) for step in re.findall(r"stopped by a signal at step (\d+)", log)]
    assert len(stopped) == 1 and 8 <= stopped[0] < 60, log[-3000:]
    assert read_jsonl(run_dir / "metrics.jsonl")[-1]["step"] == 60
    host = (run_dir / "train.log").read_text()  # the host's lines: train.log only, not the console
    assert "1 intra-op thread(s) per rank (SLURM_CPUS_PER_TASK=1" in host  # 2 tasks never oversubscribe the node
    assert "waiting: GOMP_SPINCOUNT=300)" in host  # set before torch loaded libgomp (host.spin_briefly)
    assert "intra-op thread(s)" not in log
    assert read_jsonl(run_dir / "train_log.jsonl")[-1]["samples_seen"] == 60 * 32
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.dcp"))
    assert f"step_{stopped[0]:08d}.dcp" in checkpoints and "step_00000060.dcp" in checkpoints
    # One log with both halves; the resumed run went on from the checkpoint, no step lost.
    assert "restart 0" in log and "restart 1" in log and f"at step {stopped[0]}" in log
    assert "cannot continue sample for sample" not in log  # the requeued job continues the data stream exactly
    steps = [row["step"] for row in read_jsonl(run_dir / "train_log.jsonl")]
    assert steps[-1] == 60 and set(steps) == set(range(1, 61))
    resumed_from = steps.index(stopped[0] + 1, stopped[0])  # the first step after the checkpoint, second run
    assert steps[resumed_from:] == list(range(stopped[0] + 1, 61))


def test_failed_rank_ends_the_job_promptly_with_its_error_in_the_log(cluster, cache_dir, tmp_path):
    # A preset that cannot run on this node: every task stops at its one-line error, the job fails.
    started = time.time()
    job_id = cluster.sbatch(tmp_path, *SBATCH_CPU, SCRIPT, *SMALL[1:], "world=8gpu", f"data.cache_dir={cache_dir}")
    job = cluster.wait(job_id, finished, 120)
    assert job["JobState"] == "FAILED" and time.time() - started < 60
    assert (
        "error: world=8gpu expects 8 processes (1 node(s) × 8), but slurm started 2"
        in (tmp_path / f"slurm-{job_id}.out").read_text()
    )

    # A task killed mid-run: srun's --kill-on-bad-exit ends its peer at once, not after world.timeout_s.
    job_id = cluster.sbatch(
        tmp_path, *SBATCH_CPU, SCRIPT, *SMALL, f"data.cache_dir={cache_dir}", "optim.max_steps=400", "eval_every=1000"
    )
    run_dir = tmp_path / "runs" / f"slurm-{job_id}"
    cluster.wait_for_steps(job_id, run_dir, 3, tmp_path / f"slurm-{job_id}.out")
    tasks = [pid for pid in _pids_with(f"run_dir={run_dir}") if _environ(pid).get("SLURM_PROCID") == "1"]
    assert tasks, "rank 1's process not found"
    killed = time.time()
    os.kill(tasks[0], signal.SIGKILL)
    job = cluster.wait(job_id, finished, 60)
    assert job["JobState"] in ("FAILED", "CANCELLED") and time.time() - killed < 30, job


def _pids_with(text: str) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes() and b"python" in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def test_hydra_submitit_launcher_trains_on_the_cluster(cluster, cache_dir, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            "-m",
            "hydra/launcher=slurm",
            "hydra.launcher.gpus_per_node=0",
            "hydra.launcher.cpus_per_task=1",
            "hydra.launcher.timeout_min=10",
            f"run_dir={tmp_path / 'run'}",
            f"data.cache_dir={cache_dir}",
            "optim.max_steps=6",
            "eval_every=6",
            *SMALL,
        ],
        env=cluster.env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    run_dir = tmp_path / "run" / "0"  # a sweep's job 0: its own run directory
    assert [row["step"] for row in read_jsonl(run_dir / "train_log.jsonl")] == list(range(1, 7))
    assert read_jsonl(run_dir / "metrics.jsonl")[-1]["step"] == 6


SCRIPT_64 = str(REPO / "slurm" / "train_64gpu.sbatch")
TWO_BY_TWO = ["--nodes=2", *SBATCH_CPU]  # over the script's 8 nodes × 8 GPUs; world and model on the command line
CPU_WORLD = [
    "world=slurm_cpu",
    "world.nodes=2",
    "world.procs_per_node=2",
    "model=tiny",
    "data=digits",
    "optim=tiny",
    *QUIET,
    "world.batch_per_device=16",
]


def test_64gpu_script_on_two_nodes_meets_on_the_first_requeues_and_resumes(two_nodes, cache_dir, tmp_path):
    """The unmodified 64-GPU script on 2 nodes × 2 tasks: the ranks meet at the first node of the allocation,
    USR1 → checkpoint → requeue → resume at that step, both halves in one log."""
    run_dir, log = two_nodes.stopped_and_requeued(
        tmp_path,
        6,
        *TWO_BY_TWO,
        SCRIPT_64,
        *CPU_WORLD,
        f"data.cache_dir={cache_dir}",
        "optim.max_steps=40",
        "eval_every=1000",
        "checkpoint_every=1000",
    )
    first, second = two_nodes.hosts.names
    placed = f"4 ranks on 2 node(s) ({first}: ranks 0-1, {second}: ranks 2-3), rendezvous at {first}:"
    assert log.count(placed) == 2, log[-3000:]  # both runs of the job, each met at the allocation's first node
    stopped = [int(step) for step in re.findall(r"stopped by a signal at step (\d+)", log)]
    assert len(stopped) == 1 and 6 <= stopped[0] < 40, log[-3000:]
    assert "restart 0" in log and "restart 1" in log and f"at step {stopped[0]}" in log
    assert "cannot continue sample for sample" not in log
    steps = [row["step"] for row in read_jsonl(run_dir / "train_log.jsonl")]
    assert steps[-1] == 40 and steps[steps.index(stopped[0] + 1, stopped[0]) :] == list(range(stopped[0] + 1, 41))
    assert read_jsonl(run_dir / "train_log.jsonl")[-1]["samples_seen"] == 40 * 4 * 16


def test_a_world_preset_that_does_not_match_the_allocation_fails_in_one_line(two_nodes, cache_dir, tmp_path):
    started = time.time()
    job_id = two_nodes.sbatch(
        tmp_path, *TWO_BY_TWO, SCRIPT_64, *CPU_WORLD, "world.nodes=1", f"data.cache_dir={cache_dir}"
    )
    job = two_nodes.wait(job_id, finished, 120)
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert job["JobState"] == "FAILED" and time.time() - started < 90, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert errors and all(line == errors[0] for line in errors), log[-3000:]  # one line (from each task)
    assert errors[0].startswith("error: world=slurm_cpu expects 2 processes (1 node(s) × 2), but slurm started 4")


def _tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.exists() else f"(no {path.name} yet)"
