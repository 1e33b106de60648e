"""A corpus of hostile files, built here (the attacker's set stays held out): pickles of every shape that would
run `touch <marker>` (or build what no checkpoint holds), in the containers clipdist reads them from, and
checkpoint folders whose files point outside themselves, are links or special files, or are damaged.

    pickles(marker)                     shape -> bytes of a pickle stream
    pickle_files(folder, marker)        "<shape>.pt" weights files: torch's zip with the shape as data.pkl, and
                                        the raw stream (what torch.load also reads)
    hostile_checkpoints(real, folder)   copies of a real .dcp checkpoint, each with one hostile part
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import zipfile
from pathlib import Path

ESCAPES = "\x1b[2J\x1b[1;1Hok: checkpoint verified\x1b[8m"  # clears the screen, forges a line, hides what follows


def pickles(marker: Path) -> dict[str, bytes]:
    """Pickle streams of each shape; every one, if unpickled freely, touches `marker` or builds a callable."""
    command = f"touch {marker}"

    class Runs:
        def __reduce__(self):
            return os.system, (command,)

    import functools

    import numpy as np

    made = {
        "global": pickle.dumps({"x": Runs()}, protocol=2),
        "stack_global": pickle.dumps({"x": Runs()}, protocol=4),
        "protocol_5": pickle.dumps({"x": Runs()}, protocol=5),
        "inst": f"(S'{command}'\nios\nsystem\n.".encode(),
        "obj": f"\x80\x02(cos\nsystem\nX{len(command).to_bytes(4, 'little').decode('latin1')}{command}o.".encode(
            "latin1"
        ),
        "numpy_object": pickle.dumps({"x": np.array([Runs()], dtype=object)}, protocol=2),
        "partial": pickle.dumps({"x": functools.partial(os.system, command)}, protocol=2),
        "getattr_chain": (
            b"\x80\x02cbuiltins\ngetattr\ncbuiltins\n__import__\nX\x02\x00\x00\x00os\x85R"
            b"X\x06\x00\x00\x00system\x86RX" + len(command).to_bytes(4, "little") + command.encode() + b"\x85R."
        ),
        "ext1": b"\x80\x02\x82\x01.",
        "escapes": f"\x80\x02c{ESCAPES}\nsystem\n)R.".encode("latin1"),
    }
    return made


def torch_zip(stream: bytes) -> bytes:
    """A torch.save zip file whose data.pkl is `stream` (its other records those of a real one-tensor file)."""
    import torch

    real = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, real)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(real.getvalue())) as source, zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            target.writestr(info, stream if info.filename.endswith("data.pkl") else source.read(info.filename))
    return out.getvalue()


def pickle_files(folder: Path, marker: Path) -> dict[str, Path]:
    """Weights files, one per shape and container: '<shape>-zip' (torch's format) and '<shape>-raw'."""
    folder.mkdir(parents=True, exist_ok=True)
    made = {}
    for shape, stream in pickles(marker).items():
        for container, data in (("zip", torch_zip(stream)), ("raw", stream)):
            path = folder / f"{shape}-{container}.pt"
            path.write_bytes(data)
            made[f"{shape}-{container}"] = path
    return made


def _copy(real: Path, folder: Path, name: str) -> Path:
    path = folder / name / "checkpoints" / real.name
    shutil.copytree(real, path)
    return path


def _rewrite_metadata(checkpoint: Path, change) -> None:
    with open(checkpoint / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)  # ours, just copied: trusted
    change(metadata)
    with open(checkpoint / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)


def _save_progress(checkpoint: Path, progress: dict) -> None:
    import torch

    torch.save(progress, checkpoint / "progress.pt")


def _first_storage(metadata):
    return next(iter(metadata.storage_data.values()))


def hostile_checkpoints(real: Path, folder: Path, marker: Path) -> dict[str, tuple[Path, str]]:
    """Copies of the real checkpoint `real` (a .dcp folder), each `name -> (checkpoint, verdict)` with verdict
    "refused" (hostile: never skipped) or "damaged" (resume=auto falls back to an older checkpoint)."""
    made: dict[str, tuple[Path, str]] = {}
    folder.mkdir(parents=True, exist_ok=True)
    outside = folder / "outside.distcp"
    shard = next(path for path in sorted(real.iterdir()) if path.suffix == ".distcp")
    shutil.copy(shard, outside)  # a real shard, outside the checkpoint

    for shape, stream in pickles(marker).items():
        path = _copy(real, folder, f"progress-{shape}")
        (path / "progress.pt").write_bytes(torch_zip(stream))
        made[f"progress-{shape}"] = (path, "refused")

    path = _copy(real, folder, "path-parent")
    _rewrite_metadata(path, lambda m: setattr(_first_storage(m), "relative_path", f"../../../{outside.name}"))
    made["path-parent"] = (path, "refused")
    path = _copy(real, folder, "path-absolute")
    _rewrite_metadata(path, lambda m: setattr(_first_storage(m), "relative_path", str(outside)))
    made["path-absolute"] = (path, "refused")
    path = _copy(real, folder, "shard-symlink")
    (path / shard.name).unlink()
    (path / shard.name).symlink_to(outside)
    made["shard-symlink"] = (path, "refused")
    path = _copy(real, folder, "shard-dev-zero")
    (path / shard.name).unlink()
    (path / shard.name).symlink_to("/dev/zero")
    made["shard-dev-zero"] = (path, "refused")
    path = _copy(real, folder, "progress-fifo")
    (path / "progress.pt").unlink()
    os.mkfifo(path / "progress.pt")
    made["progress-fifo"] = (path, "refused")
    path = _copy(real, folder, "metadata-symlink")
    (path / ".metadata").rename(folder / "metadata-elsewhere")
    (path / ".metadata").symlink_to(folder / "metadata-elsewhere")
    made["metadata-symlink"] = (path, "refused")

    from clipdist.checkpoint.weights import read_progress

    progress = read_progress(real)
    path = _copy(real, folder, "config-interpolation")
    config = {**progress["config"], "model": {**progress["config"]["model"], "name": "${oc.env:CLIPDIST_SECRET}"}}
    _save_progress(path, {**progress, "config": config})
    made["config-interpolation"] = (path, "refused")
    path = _copy(real, folder, "config-hf-hub")
    config = {**progress["config"], "model": {**progress["config"]["model"], "name": "hf-hub:clipdist-test/uncached"}}
    _save_progress(path, {**progress, "config": config})
    made["config-hf-hub"] = (path, "refused")
    path = _copy(real, folder, "config-bomb")
    bomb: dict = {}
    for _ in range(60):
        bomb = {"a": bomb, "b": bomb}  # 2^60 leaves to a walk that does not notice the sharing; a few KB of pickle
    _save_progress(path, {**progress, "config": {**progress["config"], "extra": bomb}})
    made["config-bomb"] = (path, "refused")

    path = _copy(real, folder, "shard-missing")
    (path / shard.name).unlink()
    made["shard-missing"] = (path, "damaged")
    path = _copy(real, folder, "item-past-end")
    _rewrite_metadata(path, lambda m: setattr(_first_storage(m), "offset", 1 << 40))
    made["item-past-end"] = (path, "damaged")
    path = _copy(real, folder, "progress-truncated")
    (path / "progress.pt").write_bytes((real / "progress.pt").read_bytes()[:100])
    made["progress-truncated"] = (path, "damaged")
    return made


def place(checkpoint: Path, target: Path) -> Path:
    """A copy of a corpus checkpoint at `target` (links kept as links, a FIFO made anew: copytree cannot copy one)."""
    fifos = [path.name for path in checkpoint.iterdir() if path.is_fifo()]
    shutil.copytree(checkpoint, target, symlinks=True, ignore=lambda _, names: [n for n in names if n in fifos])
    for name in fifos:
        os.mkfifo(target / name)
    return target


def bombs(folder: Path) -> dict[str, Path]:
    """Files that take memory or time without carrying code: a torch zip whose member inflates 100 MB from
    ~100 KB, a safetensors header claiming 100 MiB, a malformed safetensors header, a tar whose header claims a
    300 MiB member, a FIFO (reading it waits for a writer forever)."""
    import json
    import tarfile

    folder.mkdir(parents=True, exist_ok=True)
    made = {}
    made["zip-bomb"] = folder / "zip-bomb.pt"
    with (
        zipfile.ZipFile(io.BytesIO(torch_zip(pickle.dumps({}, protocol=2)))) as source,
        zipfile.ZipFile(made["zip-bomb"], "w") as target,
    ):
        for info in source.infolist():
            target.writestr(info, source.read(info.filename))
        target.writestr("archive/data/bomb", bytes(100 << 20), compress_type=zipfile.ZIP_DEFLATED)
    made["safetensors-huge-header"] = folder / "huge-header.safetensors"
    made["safetensors-huge-header"].write_bytes((100 << 20).to_bytes(8, "little") + b"{" * 64)
    made["safetensors-malformed"] = folder / "malformed.safetensors"
    header = b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 99]}}'
    made["safetensors-malformed"].write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    made["tar-huge-member"] = folder / "huge-member.tar"
    info = tarfile.TarInfo("0.png")
    info.size = 300 << 20
    made["tar-huge-member"].write_bytes(info.tobuf(format=tarfile.USTAR_FORMAT))  # the header alone: what is checked
    made["fifo"] = folder / "fifo"
    os.mkfifo(made["fifo"])
    made["json"] = folder / "odd.json"
    made["json"].write_text(json.dumps({}))
    return made
