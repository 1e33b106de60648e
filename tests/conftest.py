import os

# Spawned gloo ranks share two cores in CI: one thread each keeps them from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
