"""Who this process is in the launch (torchrun's or srun's variables) and whether that is the world the config asks
for: torch-free, so a refusal needs no torch (distributed.launch starts the ranks)."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass

import hostlist
import psutil

from clipdist.errors import ConfigError, printable

# Under srun, rank 0's store listens on a port of this range picked by the job id: two jobs sharing a first
# node get different ports, and no ephemeral port (32768 and up on Linux) is taken.
SRUN_PORTS = range(20000, 32768)
# The private memory one local rank forked on the CPU needs at the least: gradcheck's ranks held 46-131 MiB and the
# default run's two 149-157 MiB (psutil's USS, this machine)
RANK_MEMORY_FLOOR = 128 * 2**20


@dataclass(frozen=True)
class DistEnv:
    """Rank, world size and local rank as the launcher set them."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "torchrun" | "slurm" | "single"
    nodes: int | None = None  # the launch's node count, where the launcher says it

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _expand_first_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[003-005,9],cpu1' -> 'gpu003', 'r[2-3]-ib' -> 'r2-ib' (python-hostlist,
    SLURM's own syntax)."""
    try:
        return hostlist.expand_hostlist(nodelist)[0]
    except (hostlist.BadHostlist, IndexError):
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}") from None


def loopback_rendezvous(env: DistEnv) -> str | None:
    """MASTER_ADDR when an srun job over several nodes meets at an address only one node reaches (an inherited
    `localhost`, 127.x, ::1): the other nodes' ranks would wait out the rendezvous timeout. Else None."""
    address = os.environ.get("MASTER_ADDR", "")
    if env.launcher != "slurm" or (env.nodes or 1) < 2 or not address:
        return None
    try:
        loopback = ipaddress.ip_address(address).is_loopback
    except ValueError:
        loopback = address.lower() in ("localhost", "localhost.localdomain", "ip6-localhost")
    return address if loopback else None


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read rank/world from torchrun's variables, else from srun's, else one process.

    Under srun (one task per device, no torchrun) MASTER_ADDR defaults to the first node
    of the job and MASTER_PORT to a port derived from the job id, written back into
    `os.environ` so that `init_process_group("env://")` finds them.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world_size, local_size = _count(env, "WORLD_SIZE"), _count(env, "LOCAL_WORLD_SIZE", 0)
        nodes = world_size // local_size if local_size and world_size % local_size == 0 else None
        return _checked(DistEnv(_count(env, "RANK"), world_size, _count(env, "LOCAL_RANK", 0), "torchrun", nodes))
    if "SLURM_PROCID" in env and _count(env, "SLURM_NTASKS", 1) > 1:
        if environ is None:
            os.environ.setdefault("MASTER_ADDR", _expand_first_host(env.get("SLURM_JOB_NODELIST", "localhost")))
            job = _count(env, "SLURM_JOB_ID", 0)
            os.environ.setdefault("MASTER_PORT", str(SRUN_PORTS.start + job % len(SRUN_PORTS)))
        slurm_nodes = _count(env, "SLURM_STEP_NUM_NODES", 0) or _count(env, "SLURM_NNODES", 0)
        return _checked(
            DistEnv(
                _count(env, "SLURM_PROCID"),
                _count(env, "SLURM_NTASKS"),
                _count(env, "SLURM_LOCALID", 0),
                "slurm",
                slurm_nodes or None,
            )
        )
    return DistEnv(0, 1, 0, "single")


def launch_problem() -> str | None:
    """What is wrong with the launcher's variables this process was given (detect_env's refusal), said by every
    process before anything starts; None where they make a launch."""
    try:
        detect_env()
    except ConfigError as error:
        return str(error)
    return None


LAUNCH_VARIABLES = {"torchrun": ("RANK", "WORLD_SIZE"), "slurm": ("SLURM_PROCID", "SLURM_NTASKS")}


def _count(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    """A launcher's variable as a whole number of 0 or more (`default` where unset or empty); a ConfigError
    naming it otherwise (a shell's leftover `WORLD_SIZE=abc` was an internal error)."""
    text = env.get(name, "")
    if not text.strip() and default is not None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(
            f"{name}={printable(text)[:40]!r} in the environment is not a count: a launcher (torchrun, srun) sets it; "
            "unset it to run as one process"
        )
    return value


def _checked(env: DistEnv) -> DistEnv:
    """The launcher's rank within its world: a rank a launcher cannot give (RANK=5 with WORLD_SIZE=2, left in a
    shell from another job) was silent, since only rank 0 reports a refusal."""
    if not env.rank < env.world_size:
        rank, world = LAUNCH_VARIABLES[env.launcher]
        raise ConfigError(
            f"{rank}={env.rank} with {world}={env.world_size} in the environment: no launcher gives that rank; "
            f"unset {rank} and {world} (left from another job?) to run as one process"
        )
    return env


def check_local_ranks(count: int, asked: str) -> None:
    """Refuse to fork `count` local ranks (`asked`: the setting that asks for them) that this machine's free memory
    cannot hold, at RANK_MEMORY_FLOOR each: a mistyped count would otherwise fork thousands of processes."""
    available = psutil.virtual_memory().available
    if count * RANK_MEMORY_FLOOR > available:
        raise ConfigError(
            f"{asked}: {count} local ranks need at least {count * RANK_MEMORY_FLOOR / 2**30:.1f} GiB "
            f"({RANK_MEMORY_FLOOR >> 20} MiB each), and this machine has {available / 2**30:.1f} GiB free; "
            f"start at most {available // RANK_MEMORY_FLOOR} here, or launch the ranks on more nodes"
        )


def check_world(world, env: DistEnv) -> None:
    """The world preset against how this process was launched: process count, node layout, rendezvous."""
    launched_alone = env.launcher == "single" and world.world_size > 1
    if launched_alone and world.spawn:
        check_local_ranks(world.world_size, f"world={world.name} with world.procs_per_node={world.procs_per_node}")
    if launched_alone and not world.spawn:
        torchrun = f"torchrun --nproc-per-node {world.procs_per_node}"
        if world.nodes > 1:
            torchrun = (
                f"torchrun --nnodes {world.nodes} --nproc-per-node {world.procs_per_node} --rdzv-backend c10d "
                "--rdzv-endpoint <first node>:29500"
            )
        raise ConfigError(
            f"world={world.name} expects {world.world_size} processes ({world.nodes} node(s) × "
            f"{world.procs_per_node}) but this process was started alone. Launch it with "
            f"`{torchrun} train.py world={world.name}`{' on every node' if world.nodes > 1 else ''} or srun "
            "(see slurm/), or pick world=local / cpu2 / cpu4"
        )
    if not launched_alone and env.world_size != world.world_size:
        raise ConfigError(
            f"world={world.name} expects {world.world_size} processes ({world.nodes} node(s) × "
            f"{world.procs_per_node}), but {env.launcher} started {env.world_size}. Pick the preset that "
            f"matches the launch, or override world.nodes / world.procs_per_node"
        )
    if not launched_alone and env.nodes is not None and env.nodes != world.nodes:
        raise ConfigError(
            f"world={world.name} expects {world.nodes} node(s) × {world.procs_per_node}, but {env.launcher} started "
            f"{env.nodes} node(s) × {env.world_size // env.nodes}. Pick the preset that matches the launch, or "
            f"override world.nodes={env.nodes} world.procs_per_node={env.world_size // env.nodes}"
        )
    address = loopback_rendezvous(env)
    if address:
        raise ConfigError(
            f"MASTER_ADDR={address} is set in the job's environment, but it reaches only one node and the job "
            f"spans {env.nodes}: unset MASTER_ADDR and MASTER_PORT before sbatch/srun (clipdist then meets at the "
            "job's first node) or set MASTER_ADDR to an address every node reaches"
        )
