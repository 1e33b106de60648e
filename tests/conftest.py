import os

import pytest

# Spawned gloo ranks share two cores in CI: one thread each keeps them from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The longest files first (their summed test times on the 2-core CI machine; the container's with its image built
# cold, as in a fresh CI): under `--dist loadfile` a long file handed out last runs alone at the end while the other
# worker idles. Each worker is handed two files at the start (the 1st and 3rd to one, the 2nd and 4th to the other),
# so the two that mostly wait on daemons and disks (SLURM; podman building the image) go to one worker and the
# CPU-bound runs to the other. pytest-xdist would reorder the files by their number of tests (--loadscope-reorder, on
# by default: test_slurm's 5 long tests and the container's 2 went last), so the collection order is kept instead
# (pytest_configure).
LONGEST_FIRST = (  # by their summed times in a full run, 2026-11-27
    "integration/test_slurm.py",
    "integration/test_teacher_terms.py",
    "integration/test_container.py",
    "integration/test_resume.py",
    "integration/test_runs.py",
    "integration/test_naflex.py",
    "integration/test_elastic.py",
    "integration/test_fsdp.py",
    "integration/test_coca.py",
    "integration/test_hostile_files.py",
    "integration/test_faults.py",
    "integration/test_install.py",
    "integration/test_train.py",
    "integration/test_data_runs.py",
    "integration/test_recipes.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: hand files out in the order collected
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    """Every file's tests kept together and in their order; the files in LONGEST_FIRST moved to the front."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(f"{item.path.parent.name}/{item.path.name}", len(rank)))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One data cache for the session: the built-in datasets become shards once, not once per module."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, cache_dir):
    """A finished default run (30 steps, its checkpoint at step 30), for tests that only read it or refuse to
    change it."""
    from helpers import train

    run_dir = tmp_path_factory.mktemp("trained") / "run"
    result = train(run_dir, cache_dir, "optim.max_steps=30", "eval_every=30", "checkpoint_every=30")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """A test that runs the CLI in-process installs clipdist's console on the root logger; later tests start
    without it, as a fresh process would."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in [handler for handler in root.handlers if handler not in handlers]:
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)
