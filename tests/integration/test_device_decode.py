"""data.decode_on=device in real runs: web JPEGs decoded by the rank (libjpeg-turbo on the CPU here, nvJPEG on
CUDA), batches assembled from the workers' pieces and cut into gradient-caching chunks, and a run stopped on two
ranks and resumed on one that is the run never stopped."""

from __future__ import annotations

import collections

from helpers import read_jsonl, run_log, train, train_until

STEPS = 6
RANKS = {"cpu2": 2, "local": 1}


def _overrides(world: str, *more: str) -> list[str]:
    return [
        "data=web_photos",
        "data.decode_on=device",
        "data.workers=1",
        "data.pieces=2",  # each worker's rows in two items: the rank's buffer widens to each item's files
        "grad_cache.chunks=2",
        f"world={world}",
        f"world.batch_per_device={16 // RANKS[world]}",  # a global batch of 16 on any world size
        f"optim.max_steps={STEPS}",
        "eval_every=1000",
        "checkpoint_every=1000",
        "logging.sample_keys=true",
        *more,
    ]


def _batches(run_dir) -> dict[int, list[str]]:
    """Each step's global batch, as logging.sample_keys has it (the ranks' rows in rank order)."""
    steps: dict[int, dict[int, list[str]]] = collections.defaultdict(dict)
    for path in (run_dir / "samples").glob("rank_*.jsonl"):
        for row in read_jsonl(path):
            steps[row["step"]][int(path.stem.split("_")[1])] = row["keys"]
    return {step: [key for rank in sorted(rows) for key in rows[rank]] for step, rows in steps.items()}


def test_a_device_decoded_run_stopped_on_two_ranks_and_resumed_on_one_is_the_run_never_stopped(tmp_path, cache_dir):
    """The crops are drawn by the workers from the samples' own seeds, as on the host path, and the rank's decode is
    deterministic: a run stopped on 2 ranks and resumed on 1 logs the uninterrupted run's batches and losses. Every
    web_photos image is an RGB JPEG, so the device decoded them all; the log says where decoding ran."""
    whole = tmp_path / "whole"
    result = train(whole, cache_dir, *_overrides("cpu2"))
    assert result.returncode == 0, result.stderr[-3000:]
    stopped = tmp_path / "stopped"
    assert 3 <= train_until(stopped, cache_dir, _overrides("cpu2"), 3) < STEPS
    resumed = train(stopped, cache_dir, *_overrides("local"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _batches(stopped) == _batches(whole) and len(_batches(whole)) == STEPS
    rows = [read_jsonl(run / "train_log.jsonl") for run in (stopped, whole)]
    assert len(rows[0]) == len(rows[1]) == STEPS
    worst = max(abs(ours["loss"] - theirs["loss"]) / abs(theirs["loss"]) for ours, theirs in zip(*rows))
    print(f"decode_on=device, cpu2 -> local: worst relative loss difference {worst:.2e}")
    assert worst <= 1e-5
    assert all(row["host_decoded_images"] == 0 for row in rows[1])
    from clipdist.data.device_decode import jpeg_decoder

    said = f"resized on cpu ({jpeg_decoder()[0]}'s decode_jpeg, libjpeg-turbo; data.decode_on=device)"
    assert any(said in line for line in run_log(whole)), run_log(whole)


def test_the_device_path_trains_on_the_host_paths_crops(tmp_path, cache_dir):
    """The same run with data.decode_on=host: the same samples, and losses that differ by the resampling alone
    (the first step's within 1%: the crops are the same boxes)."""
    runs = {}
    for where in ("host", "device"):
        run_dir = tmp_path / where
        result = train(run_dir, cache_dir, *_overrides("local", f"data.decode_on={where}", "optim.max_steps=2"))
        assert result.returncode == 0, result.stderr[-3000:]
        runs[where] = (_batches(run_dir), read_jsonl(run_dir / "train_log.jsonl"))
    assert runs["host"][0] == runs["device"][0]
    first = [runs[where][1][0]["loss"] for where in ("host", "device")]
    assert first[0] != first[1] and abs(first[0] - first[1]) / first[0] < 0.01, first
