import time

import pytest
from fixtures import image_bytes, write_samples
from helpers import identity_transform, train_stream

from clipdist.data.faults import DataError


def png(value):
    return image_bytes(value)


def stream(urls, workers=0, resampled=False, max_skips_in_a_row=1000, batch=2):
    return train_stream(
        urls, batch, identity_transform, workers=workers, resampled=resampled, max_skips_in_a_row=max_skips_in_a_row
    )


@pytest.mark.parametrize("resampled, workers", [(False, 0), (True, 0), (False, 1)])
def test_when_no_shard_can_be_read_the_stream_says_so_within_seconds(tmp_path, resampled, workers):
    for name in ["a.tar", "b.tar"]:
        (tmp_path / name).write_text("not a tar at all\n" * 50)
    started = time.monotonic()
    batches = stream([tmp_path / "a.tar", tmp_path / "b.tar"], workers=workers, resampled=resampled)
    try:
        with pytest.raises(DataError) as failure:
            next(batches)
    finally:
        batches.close()  # its workers ignore SIGTERM: stopped as the trainer stops them
    message = str(failure.value)
    assert message.startswith("rank 0: ") and "none of the 2 shard(s)" in message
    assert "a.tar" in message and "b.tar" in message
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_skips_are_counted_in_workers_of_every_start_method(tmp_path, start_method):
    for shard in range(2):
        write_samples(
            tmp_path / f"{shard}.tar",
            [{"__key__": "bad", "png": b"nope", "txt": b"x"}]
            + [{"__key__": f"{i:03d}", "png": image_bytes(i), "txt": b"a caption"} for i in range(7)],
        )
    batches = train_stream(
        [tmp_path / "0.tar", tmp_path / "1.tar"], 2, identity_transform, workers=2, start_method=start_method
    )
    try:
        # Two readers (one shard each: 8 rows, an epoch's share of each) on two workers, each making every other
        # batch whole: each worker's first
        # batch carries its shard's bad sample, counted in the worker and passed on to the rank.
        assert [next(batches).counts[0] for _ in range(4)] == [1, 1, 0, 0]
    finally:
        batches.close()


# --- decoding at the size the crop needs; bad images stay bad samples ------------------------------


def test_the_caption_draw_is_the_same_in_another_process():
    import subprocess
    import sys

    """Each caption draw is seeded by a stable hash (Python's str hash differs between processes): resumed runs and
    other ranks draw the same."""
    code = (
        "import json; from clipdist.data.samples import SampleKeys, training_pair; import io; from PIL import Image;"
        "b = io.BytesIO(); Image.new('RGB', (8, 8)).save(b, 'PNG');"
        "print([training_pair({'__key__': str(i), '__url__': 'shard.tar', 'png': b.getvalue(),"
        " 'json': json.dumps({'captions': ['x', 'y', 'z']}).encode()}, SampleKeys(('json:captions',)))[1]"
        " for i in range(20)])"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            env={**__import__("os").environ, "PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in (1, 2)
    }
    assert len(runs) == 1 and "x" in next(iter(runs))
