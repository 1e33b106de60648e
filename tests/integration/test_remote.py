"""checkpoint.remote against a real S3 server on loopback (moto's, from its wheel): every checkpoint copied, the
newest kept; a job on a fresh node with an empty run directory continues from the remote copy, its logs with it; the
server going
away mid-run costs only warnings — the local checkpoints are intact and the run ends as it would."""

from __future__ import annotations

import shutil

import pytest
from helpers import Run, read_jsonl, train

pytest.importorskip("s3fs", reason="checkpoint.remote=s3:// needs s3fs (pip install -e '.[test]')")
moto_server = pytest.importorskip(
    "moto.server", reason="the S3 server for these tests is moto's (pip install 'moto[server]')"
)

COMMON = [
    "optim.max_steps=9",
    "checkpoint_every=3",
    "keep_checkpoints=2",
    "eval_every=1000",
    "world.batch_per_device=16",
]


@pytest.fixture
def s3(monkeypatch):
    """An S3 server on 127.0.0.1 with an empty bucket; the AWS client settings that reach it, in the environment."""
    import boto3
    import s3fs

    from clipdist.distributed.launch import free_port

    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    settings = {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_MAX_ATTEMPTS": "1",
    }
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()  # a client made for another test's server must not be reused
    boto3.client("s3").create_bucket(Bucket="runs")
    try:
        yield server, settings
    finally:
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()


def remote_steps() -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    try:
        return sorted(path.rsplit("/", 1)[-1] for path in fs.ls("runs/job") if fs.exists(f"{path}/COMPLETE"))
    except FileNotFoundError:
        return []


def test_a_job_on_a_fresh_node_continues_from_the_remote_copy(s3, tmp_path, cache_dir):
    first = train(tmp_path / "node1" / "run", cache_dir, *COMMON, "checkpoint.remote=s3://runs/job")
    assert first.returncode == 0, first.stderr[-3000:]
    assert remote_steps() == ["step_00000006.dcp", "step_00000009.dcp"]  # every one copied, the newest 2 kept
    shutil.rmtree(tmp_path / "node1")  # the node's disk is gone

    again = train(
        tmp_path / "node2" / "run", cache_dir, *COMMON[1:], "optim.max_steps=12", "checkpoint.remote=s3://runs/job"
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        "fetched step_00000009.dcp and the run's logs (train_log.jsonl, metrics.jsonl, train.log) from "
        "s3://runs/job" in again.stdout
    )
    assert f"resumed from {tmp_path / 'node2' / 'run' / 'checkpoints' / 'step_00000009.dcp'} at step 9" in again.stdout
    # the history came back with the checkpoint: every step once, both starts in train.log, the end's evaluation
    run = tmp_path / "node2" / "run"
    assert [row["step"] for row in read_jsonl(run / "train_log.jsonl")] == list(range(1, 13))
    assert [row["step"] for row in read_jsonl(run / "metrics.jsonl")] == [9, 12]
    assert (run / "train.log").read_text().count("model clipdist-tiny: ") == 2
    assert remote_steps() == ["step_00000009.dcp", "step_00000012.dcp"]


def test_the_server_going_away_mid_run_costs_warnings_only(s3, tmp_path, cache_dir):
    server, settings = s3
    run_dir = tmp_path / "run"
    with Run.train(
        run_dir,
        cache_dir,
        "optim.max_steps=300",
        "checkpoint_every=30",
        "keep_checkpoints=2",
        "eval_every=1000",
        "world.batch_per_device=16",
        "checkpoint.remote=s3://runs/job",
        "checkpoint.remote_retries=1",
        env=settings,
    ) as run:
        run.wait_for(lambda: "step_00000030.dcp" in remote_steps(), 240, "the first remote copy")
        server.stop()  # the object store goes away while the run trains on
        code, stdout, stderr = run.finish(timeout=300)
    assert code == 0, stderr[-3000:]
    assert "could not copy step_00000300.dcp to s3://runs/job after 2 attempt(s)" in stderr
    assert "the local checkpoint is intact and training goes on" in stderr
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == [
        "step_00000270.dcp",
        "step_00000300.dcp",
    ]
    assert [row["step"] for row in read_jsonl(run_dir / "train_log.jsonl")][-1] == 300
    server.start()  # for the fixture's stop
