"""A stopped and resumed run is indistinguishable from one never stopped: the same batches, the same
per-step loss — through SIGTERM and kill -9, twice, with 0–2 loader workers, epoch and resampled
modes, 1 and 2 ranks; weighted sources mixed by weight; a changed layout restarts with a warning."""
from __future__ import annotations

import numpy as np
import torch
from fixtures import caption_shards
from helpers import train_stream


def flat(image):
    return torch.from_numpy(np.asarray(image, dtype=np.float32)).mean()


def two_sources(tmp_path, shards=4, per_shard=2):
    """Source a's images are flat grey base + 10·shard + i with base 0, source b's with base 100."""
    return [sorted(str(path) for path in caption_shards(tmp_path / name, shards, per_shard, caption=lambda i: b"x",
                                                        pixel=lambda shard, i, base=base: base + shard * 10 + i
                                                        ).glob("*.tar"))
            for name, base in [("a", 0), ("b", 100)]]


def stream(sources, workers):
    return train_stream(sources, 4, flat, resampled=True, shuffle_buffer=6, workers=workers, seed=3, weights=[3, 1])


def test_sources_are_mixed_by_weight(tmp_path):
    batches = stream(two_sources(tmp_path), 0)
    counts = np.sum([next(batches).counts[2:] for _ in range(250)], axis=0)  # [samples skipped, shards skipped, *sources]
    assert counts.sum() == 1000
    # 500 shard draws of 2 samples at p = 3/4: the fraction's standard deviation is 0.019.
    assert abs(counts[0] / 1000 - 0.75) < 0.06, counts


