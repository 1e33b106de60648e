"""Checkpoint files: one format (a DCP folder + progress.pt), atomic, retained, the newest readable resumed;
checkpoints of the .pt days still resume."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch

from clipdist.checkpoint.manager import Checkpointer, CheckpointFiles
from clipdist.checkpoint.state import TrainState, seed_everything
from clipdist.checkpoint.weights import read_progress
from clipdist.config import TrainConfig
from clipdist.distributed.launch import detect_env
from clipdist.errors import CheckpointError, ConfigError


class LiveStream:
    """A stream whose state dict hands out its live reader positions, as TrainStream's does on one rank."""

    def __init__(self):
        self.totals = {0: 5}

    def state_dict(self) -> dict:
        return {"totals": self.totals}

    def load_state_dict(self, saved) -> None:
        pass

    def reader_tensors(self) -> dict:
        return {}

    def reader_keys(self) -> list:
        return []


def tiny_state(value: float) -> TrainState:
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(value)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # AdamW moments exist
    return TrainState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))


def save(files: CheckpointFiles, state: TrainState, step: int):
    state.step = step
    return files.save(state.sharded_state_dict(), {**state.progress(), "config": {}}, step, is_main=True)


def restore(run_dir) -> tuple[TrainState, object]:
    state = tiny_state(0.0)
    return state, Checkpointer(TrainConfig(name="x", run_dir=str(run_dir)), run_dir, detect_env()).restore(state)


def test_newest_complete_checkpoint_wins_and_partial_writes_are_ignored(tmp_path):
    files = CheckpointFiles(tmp_path, keep=2)
    for step in (10, 20, 30):
        save(files, tiny_state(float(step)), step)
    assert [p.name for p in files.checkpoints()] == ["step_00000030.dcp", "step_00000020.dcp"]  # keep=2
    # A process killed mid-write leaves only a hidden partial folder: never picked.
    (files.directory / ".step_00000040.dcp.partial").mkdir()
    state, path = restore(tmp_path)
    assert path.name == "step_00000030.dcp" and state.step == 30
    saved = tiny_state(30.0)
    assert torch.equal(state.model.weight.detach(), saved.model.weight.detach())
    assert torch.equal(
        state.optimizer.state_dict()["state"][0]["exp_avg"], saved.optimizer.state_dict()["state"][0]["exp_avg"]
    )


def test_an_unreadable_newest_checkpoint_is_refused_naming_the_ways_on_never_skipped(tmp_path):
    """resume=auto with a damaged published checkpoint: a one-line refusal naming it, the older one by name and a new
    run — not a quiet fall back (nor, with no older one, a fresh start that would lose the run)."""
    files = CheckpointFiles(tmp_path, keep=3)
    older = save(files, tiny_state(1.0), 10)
    newest = save(files, tiny_state(2.0), 20)
    (newest / "progress.pt").write_bytes(b"not a checkpoint")
    before = sorted(p.name for p in files.directory.iterdir())
    with pytest.raises(CheckpointError) as raised:
        restore(tmp_path)
    message = str(raised.value)
    assert "step_00000020.dcp cannot be read" in message and f"resume={older}" in message and "\n" not in message
    cfg = TrainConfig(name="x", run_dir=str(tmp_path), resume="auto")
    with pytest.raises(ConfigError, match="step_00000020.dcp cannot be read.*resume=.*step_00000010.dcp"):
        Checkpointer.resume_point(cfg)  # before any rank starts
    shutil.rmtree(older)
    with pytest.raises(ConfigError, match="name=<new name>") as raised:
        Checkpointer.resume_point(cfg)
    assert "go on from" not in str(raised.value)
    assert sorted(p.name for p in files.directory.iterdir()) == [n for n in before if n != older.name]


def test_the_largest_seed_seeds_every_rank():
    """A rank seeds with the run's seed + its rank: past NumPy's 32 bits at the largest seed the config takes."""
    from clipdist.defaults import MAX_SEED

    seed_everything(MAX_SEED + 3)
    drawn = np.random.rand()
    seed_everything(2)  # the same 32 bits
    assert np.random.rand() == drawn


def test_no_checkpoint_is_none(tmp_path):
    assert restore(tmp_path)[1] is None


def test_a_resume_takes_the_optimizer_settings_of_its_config_and_the_state_of_its_checkpoint(tmp_path):
    """optim.lr, weight_decay, betas and the layer decays may change on resume (config.resume_rule: free): the run
    goes on with the new ones — the lr its schedule gives at the step reached, other parameter groups too — and the
    checkpoint's Adam moments. Before, the checkpoint's groups and base rates came back and the change was ignored."""
    files = CheckpointFiles(tmp_path, keep=1)
    old = tiny_state(4.0)
    old.optimizer.step()
    old.scheduler.step()
    save(files, old, 10)
    model = torch.nn.Linear(2, 2)
    groups = [
        {"params": [model.weight], "lr": 0.5, "weight_decay": 0.2},
        {"params": [model.bias], "lr": 0.05, "weight_decay": 0.0},  # another grouping than the saved run's one group
    ]
    optimizer = torch.optim.AdamW(groups, lr=0.5, betas=(0.8, 0.9))
    state = TrainState(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step)))
    Checkpointer(TrainConfig(name="x", run_dir=str(tmp_path)), tmp_path, detect_env()).restore(state)
    assert state.scheduler.last_epoch == 1  # the schedule's position: the checkpoint's
    assert [group["lr"] for group in optimizer.param_groups] == [0.25, 0.025] == state.scheduler.get_last_lr()
    assert [(group["weight_decay"], group["betas"]) for group in optimizer.param_groups] == [
        (0.2, (0.8, 0.9)),
        (0.0, (0.8, 0.9)),
    ]
    assert torch.equal(optimizer.state[model.weight]["exp_avg"], old.optimizer.state[old.model.weight]["exp_avg"])
    assert torch.equal(optimizer.state[model.bias]["exp_avg_sq"], old.optimizer.state[old.model.bias]["exp_avg_sq"])


def test_a_checkpoint_of_the_pt_days_still_resumes(tmp_path):
    """step_*.pt as DDP runs wrote them before the one format: one torch.save of everything, NumPy's RNG state as
    arrays (read with those allowed by name, nothing else)."""
    old = tiny_state(5.0)
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    torch.save(
        {
            "model": old.model.state_dict(),
            "optimizer": old.optimizer.state_dict(),
            "scheduler": old.scheduler.state_dict(),
            "step": 7,
            "samples_seen": 70,
            "rng": [rng],
            "world_size": 1,
            "stream": None,
            "config": {},
        },
        folder / "step_00000007.pt",
    )
    state, path = restore(tmp_path)
    assert path.name == "step_00000007.pt" and (state.step, state.samples_seen) == (7, 70)
    assert torch.equal(state.model.weight.detach(), old.model.weight.detach())
    saved = torch.load(folder / "step_00000007.pt", weights_only=False)  # the test's own file
    saved["model"]["weight"][0, 0] = float("inf")
    torch.save(saved, folder / "step_00000007.pt")
    with pytest.raises(ConfigError, match="its model.weight holds NaN or Inf"):
        restore(tmp_path)


def test_a_save_in_the_background_holds_the_state_of_its_step(tmp_path, monkeypatch):
    """checkpoint.async_save: the state is copied when the save begins, so what training changes while the write
    runs (made certain here: the writer starts half a second late) is not in it; the checkpoint appears only once
    it is published."""
    import time

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write_data = FileSystemWriter.write_data
    monkeypatch.setattr(
        FileSystemWriter,
        "write_data",
        lambda self, *args, **kwargs: (time.sleep(0.5), write_data(self, *args, **kwargs))[1],
    )
    cfg = TrainConfig(name="x", run_dir=str(tmp_path))
    assert cfg.checkpoint.async_save
    checkpointer = Checkpointer(cfg, tmp_path, detect_env())
    state = tiny_state(3.0)
    state.step = 5
    state.stream = LiveStream()
    at_save = state.model.weight.detach().clone()
    assert checkpointer.save(state)
    state.model(torch.ones(1, 2)).sum().backward()
    state.optimizer.step()  # training goes on while the write runs
    assert not torch.equal(state.model.weight.detach(), at_save)
    state.stream.totals[0] = 99  # and the stream reads on: its state dict holds this very dict
    assert checkpointer.files.checkpoints() == [] and not checkpointer.pending.written
    assert checkpointer.finish() and [path.name for path in checkpointer.files.checkpoints()] == ["step_00000005.dcp"]
    restored, path = restore(tmp_path)
    assert torch.equal(restored.model.weight.detach(), at_save)
    assert read_progress(path)["stream"] == {"totals": {0: 5}}


def test_the_next_update_waits_for_a_copy_made_beside_the_step(tmp_path, monkeypatch):
    """A background save copies the state in a thread while the loop goes on (the next step's forward and backward);
    the next optimizer step, the first thing that changes the state, waits for the copy (made slow here), and the
    wait counts as the save's hold on the loop. A model whose forward changes its state (BatchNorm) is copied first."""
    import time

    from clipdist.checkpoint import manager

    copy = manager._HostCopy._copy
    monkeypatch.setattr(manager._HostCopy, "_copy", staticmethod(lambda tree: (time.sleep(0.4), copy(tree))[1]))
    checkpointer = Checkpointer(TrainConfig(name="x", run_dir=str(tmp_path)), tmp_path, detect_env())
    state = tiny_state(3.0)
    state.step = 5
    at_save = state.model.weight.detach().clone()
    started = time.perf_counter()
    assert checkpointer.save(state)
    returned = time.perf_counter() - started
    assert returned < 0.3 and checkpointer.pending.staged is not None
    state.model(torch.ones(1, 2)).sum().backward()
    state.optimizer.step()
    pending = checkpointer.pending
    assert pending.staged.done() and pending.held_s >= 0.35, (returned, pending.held_s)
    assert checkpointer.finish()
    restored, _ = restore(tmp_path)
    assert torch.equal(restored.model.weight.detach(), at_save)
    assert "copied to host memory beside the next step" in manager.saved_line(tmp_path, pending, True)
    assert manager.updates_in_forward(torch.nn.BatchNorm1d(2)) and not manager.updates_in_forward(state.model)


def test_each_ranks_generators_go_with_the_tensors_and_come_back(tmp_path):
    """Python's, NumPy's and torch's generators are saved as this rank's tensors in the DCP folder (progress.pt holds
    nothing per rank) and restored where the world size is the saved one."""
    files = CheckpointFiles(tmp_path)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1)  # a spare gauss in Python's state, and NumPy's cached one
    np.random.standard_normal()
    path = save(files, tiny_state(1.0), 3)
    expected = (random.random(), np.random.standard_normal(), torch.rand(1).item(), random.gauss(0, 1))
    assert set(read_progress(path)) == {"scheduler", "step", "samples_seen", "world_size", "stream", "scaler", "config"}
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore(tmp_path)
    assert (random.random(), np.random.standard_normal(), torch.rand(1).item(), random.gauss(0, 1)) == expected


def test_a_readers_position_survives_packing_into_tensors():
    from clipdist.data.stream import pack_position, unpack_position

    rng = random.Random("reader")
    rng.random()
    position = {
        "reader": {
            "entry": 12,
            "taken": 345,
            "received": 2000,
            "rng": rng.getstate(),
            "buffer": [(11, 9999), (12, 0), (12, 344)],
        },
        "taken": 6789,
    }
    packed = pack_position(position)
    assert all(tensor.dtype == torch.int64 for tensor in packed.values()) and packed["buffer"].shape == (3, 2)
    assert unpack_position(packed) == position
    empty = {**position, "reader": {**position["reader"], "buffer": []}}
    assert unpack_position(pack_position(empty)) == empty


def test_edited_counters_in_progress_are_a_damaged_checkpoint(tmp_path):
    """step=-5, a step stored as text, a world size holding a list: refused in one line by every route (verify),
    never trained on (step -5 would rewind the logs past the run's start)."""
    from clipdist.checkpoint import weights

    files = CheckpointFiles(tmp_path, keep=3)
    path = save(files, tiny_state(1.0), 10)
    progress = weights.verify(path)
    for key, value in (("step", -5), ("step", "10"), ("step", True), ("world_size", [1] * 1000), ("samples_seen", 1.5)):
        edited = {**progress, key: value}
        torch.save(edited, path / "progress.pt")
        with pytest.raises(ValueError, match=f"its {key} is .*not a count clipdist writes") as raised:
            weights.verify(path)
        assert "\n" not in str(raised.value) and len(str(raised.value)) < 300


LAYOUT = {"readers": 8, "cycle": 256, "shuffle_buffer": 1000, "buffer": 250}  # a run's layout (order.run_layout)


@pytest.mark.parametrize(
    "edit, said",
    [
        (lambda p: {**p, "config": [1, 2]}, "its config is list, not a mapping"),
        (lambda p: {k: v for k, v in p.items() if k != "scheduler"}, "its scheduler state is None, not a mapping"),
        (lambda p: {**p, "scheduler": "cosine"}, "its scheduler state is 'cosine', not a mapping"),
        (lambda p: {**p, "scheduler": {**p["scheduler"], "last_epoch": "x"}}, "its scheduler.last_epoch is 'x'"),
        (lambda p: {**p, "scheduler": {**p["scheduler"], "base_lrs": [float("nan")]}}, "scheduler.base_lrs"),
        (lambda p: {**p, "samples_seen": 10**15}, "its samples_seen is 1000000000000000"),
        (lambda p: {**p, "stream": {"position": 10**15}}, "its stream.position is 1000000000000000"),
        (lambda p: {**p, "stream": "x"}, "its stream position is 'x', not a mapping"),
        (lambda p: {**p, "stream": {"layout": LAYOUT | {"readers": 10**12}}}, "its stream.layout.readers is 10{12}"),
        (lambda p: {**p, "stream": {"layout": LAYOUT | {"cycle": 0}}}, "its stream.layout.cycle is 0"),
        (lambda p: {**p, "stream": {"layout": LAYOUT | {"buffer": 10**12}}}, "its stream.layout.buffer is 10{12}"),
        (lambda p: {**p, "stream": {"layout": LAYOUT | {"buffer": -1}}}, "its stream.layout.buffer is -1"),
    ],
)
def test_every_field_a_resume_reads_is_typed_and_bounded(tmp_path, edit, said):
    """A saved config that is a list, a scheduler state missing or a string, a data position of 10^15, a layout of
    10^12 readers or with a reader's buffer past data.shuffle_buffer: each was a traceback (or an allocation) deep in
    the resume; now one line naming the file and the field."""
    from clipdist.checkpoint import weights

    path = save(CheckpointFiles(tmp_path, keep=3), tiny_state(1.0), 10)
    torch.save(edit(weights.verify(path)), path / "progress.pt")
    with pytest.raises(ValueError, match=said) as raised:
        weights.verify(path)
    assert str(path) in str(raised.value) and "\n" not in str(raised.value)


def test_declared_sizes_and_shapes_are_checked_before_anything_is_allocated(tmp_path):
    """A .metadata declaring 2^51 elements is damage before any allocation; a tensor of another shape than the run's
    (an edited average or decoder) is refused before it is read."""
    import pickle

    from clipdist.checkpoint import weights

    path = save(CheckpointFiles(tmp_path, keep=3), tiny_state(1.0), 10)
    state = tiny_state(0.0)
    wrong = {"model": {"weight": torch.zeros(3, 2), "bias": torch.zeros(2)}}
    with pytest.raises(ValueError, match="declares model.weight as \\[2, 2\\], the run's is \\[3, 2\\]"):
        weights.load_dcp(wrong, path)
    metadata = pickle.loads((path / ".metadata").read_bytes())  # the test's own file: trusted
    metadata.state_dict_metadata["model.weight"].size = torch.Size([2**51])
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ValueError, match="declares model.weight of \\[2251799813685248\\].*more than its"):
        weights.load_dcp(state.sharded_state_dict(), path)


def test_non_finite_weights_in_a_checkpoint_are_refused_on_resume(tmp_path):
    """NaN in the model (or its average, a decoder: every tensor a resume loads) is damage: refused, not trained on."""
    from clipdist.checkpoint import weights

    state = tiny_state(1.0)
    with torch.no_grad():
        state.model.weight[0, 0] = float("nan")
    save(CheckpointFiles(tmp_path, keep=3), state, 10)
    with pytest.raises(ConfigError, match="model.weight holds NaN or Inf"):
        restore(tmp_path)
    assert weights.first_non_finite({"a": {"b": torch.tensor([1.0, float("inf")])}}) == "a.b"
    assert weights.first_non_finite({"a": torch.ones(2), "n": torch.tensor([1, 2])}) is None
