import os

import pytest

# Spawned gloo ranks share two cores in CI: one thread each keeps them from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One data cache for the session: the built-in datasets become shards once, not once per module."""
    return tmp_path_factory.mktemp("cache")
