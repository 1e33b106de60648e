import torch

from clipdist.checkpoint import CheckpointFiles


def test_newest_complete_checkpoint_wins_and_partial_writes_are_ignored(tmp_path):
    manager = CheckpointFiles(tmp_path, keep=2)
    for step in (10, 20, 30):
        manager.save({"step": step, "weights": torch.full((3,), float(step))}, step)
    assert [p.name for p in manager.checkpoints()] == ["step_00000030.pt", "step_00000020.pt"]  # keep=2
    # A process killed mid-write leaves only a hidden partial file: never picked.
    (manager.directory / ".step_00000040.pt.partial").write_bytes(b"\x80truncated")
    state, path = manager.load_latest()
    assert state["step"] == 30 and path.name == "step_00000030.pt"
    assert torch.equal(state["weights"], torch.full((3,), 30.0))


def test_unreadable_newest_checkpoint_falls_back_to_the_one_before(tmp_path):
    manager = CheckpointFiles(tmp_path, keep=3)
    manager.save({"step": 10}, 10)
    (manager.directory / "step_00000020.pt").write_bytes(b"not a checkpoint")
    state, path = manager.load_latest()
    assert state["step"] == 10


def test_no_checkpoint_is_none(tmp_path):
    assert CheckpointFiles(tmp_path).load_latest() is None
