import os

import pytest

# Spawned gloo ranks share two cores in CI: one thread each keeps them from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The longest files first (their summed test times in a fresh clone on the 2-core CI machine, longest first):
# pytest-xdist's --dist loadfile hands files to its workers in collection order, so a long file collected last
# (alphabetically test_slurm, test_runs) ran alone at the end while the other worker idled.
LONGEST_FIRST = (
    "integration/test_slurm.py",
    "integration/test_parity.py",
    "integration/test_container.py",
    "integration/test_resume.py",
    "integration/test_runs.py",
    "integration/test_elastic.py",
    "integration/test_grad_cache.py",
    "integration/test_naflex.py",
    "integration/test_coca.py",
)


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
