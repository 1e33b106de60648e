"""Every file clipdist reads weights or checkpoints from, read without running anything in it.

A pickle can run any code while it is read; checkpoints and weights travel between people and machines, so
nothing here unpickles freely:

- `.pt` / `.bin` files: `torch.load(weights_only=True)`, which builds tensors and plain containers only; the
  one other type clipdist itself ever saved (NumPy arrays, in the RNG state of checkpoints written before the
  DCP format) is allowed by name (SAFE_GLOBALS);
- `.safetensors`: safetensors (no code at all);
- torch.distributed.checkpoint folders (`.dcp`): DCP reads its `.metadata` with a plain `pickle.load` and its
  non-tensor items with `torch.load(weights_only=False)`; `SafeReader` reads the metadata through an unpickler
  that builds DCP's own classes only, and `SafeLoadPlanner` / `SafeModelPlanner` read non-tensor items with
  weights_only.

A file that needs anything else is refused (UnsafeFileError, one line naming the file and the type it asked
for). `clipdist trust FILE` converts a file the user trusts, once (docs/checkpoints.md says what that risks).
"""

from __future__ import annotations

import enum
import io
import math
import os
import pickle
import pickletools
import re
import stat
import warnings
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from clipdist.errors import ClipdistError, printable
from clipdist.files import (
    UnboundedFileError,
    json_of,
    load_safetensors,
    load_torch,
    open_user,
    read_bounded,
    read_whole,
)
from clipdist.registry.terms import training_only

PROGRESS = "progress.pt"  # in a .dcp folder: step, schedule, RNG, the stream's position, the config (plain types)
LEGACY_PROGRESS = PROGRESS  # the name was the same before the one format; its RNG state held NumPy arrays

# NumPy arrays: what np.random.get_state() put into checkpoints before the one format (reading only).
SAFE_GLOBALS = [
    np._core.multiarray._reconstruct,  # type: ignore[attr-defined]  # NumPy 2's, private
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
]


class UnsafeFileError(ClipdistError, ValueError):
    """A file that cannot be read without running code that came with it."""


JSON_FILE_BYTES = 16 << 20  # a JSON file a model carries (its model config, a tokenizer config) is far smaller


def read_small_json(path: Path, limit: int = JSON_FILE_BYTES):
    """JSON from a regular file of at most `limit` bytes. A FIFO, a device (`/dev/zero`) or a larger file is refused
    (UnsafeFileError) before anything is read from it, so a path a file names can neither hang nor exhaust the
    reader; OSError and ValueError as reading and json.loads raise them."""
    try:
        return json_of(read_bounded(path, limit))
    except UnboundedFileError as error:
        raise UnsafeFileError(f"{str(path)!r}: refused: {error.strerror}") from None


def refusal(path, wanted: str) -> UnsafeFileError:
    wanted = printable(wanted)  # the file chose it
    return UnsafeFileError(
        f"{path}: refused: reading it would build {wanted}, which clipdist never saves (unpickling it could run "
        f"code that came with the file). If you trust where it came from, convert it once with "
        f"`clipdist trust {path}` (see docs/checkpoints.md), and use the converted copy"
    )


def _wanted(error: Exception) -> str | None:
    """What torch's weights-only unpickler refused to build ('Unsupported global: GLOBAL x.y was not an allowed
    global', an opcode that builds objects), or None where the file is merely damaged (not a pickle at all)."""
    message = str(error)
    found = re.search(r"GLOBAL ([\w.]+)", message)
    if found:
        return found.group(1)
    found = re.search(r"Unsupported operand (\d+)", message)
    if found and int(found.group(1)) in _BUILDING_OPCODES:
        return f"an object by pickle's {_BUILDING_OPCODES[int(found.group(1))]} instruction"
    return None


def _pickles_in(source) -> list[bytes]:
    """The pickle streams of a file as torch.load reads it: the `*.pkl` members of a zip file (torch's format;
    at most PICKLE_BYTES each, else none), or the bytes themselves."""
    data = source.getvalue() if isinstance(source, io.BytesIO) else read_whole(source)
    if not zipfile.is_zipfile(io.BytesIO(data)):
        return [data]
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = [info for info in archive.infolist() if info.filename.endswith(".pkl")]
            return [archive.read(info) for info in members if info.file_size <= PICKLE_BYTES]
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError):
        return []


PICKLE_BYTES = 256 << 20  # the pickled structure of a checkpoint (its tensors live beside it) is far smaller


def _asks_for(source) -> str | None:
    """What a pickle that torch's weights-only reader refused asks to build: the first class or function it names
    (GLOBAL, INST, STACK_GLOBAL, read with pickletools, which runs nothing) outside what checkpoints hold, or an
    object-building opcode. Looked for in the pickles inside a zip (torch's format) too. None where there is no
    complete pickle at all: a damaged file, not a hostile one."""
    for data in _pickles_in(source):
        strings: list[str] = []
        memo: dict[int, str] = {}
        named: list[str] = []
        building = None
        try:
            for opcode, argument, _ in pickletools.genops(data):
                if opcode.name in ("GLOBAL", "INST"):
                    named.append(str(argument).replace(" ", "."))
                elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                    named.append(".".join(strings[-2:]))
                elif opcode.name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT") and strings:
                    memo[len(memo) if opcode.name == "MEMOIZE" else cast(int, argument)] = strings[-1]
                elif opcode.name in ("GET", "BINGET", "LONG_BINGET") and argument in memo:
                    strings.append(memo[argument])
                elif isinstance(argument, str):
                    strings.append(argument)
                if ord(opcode.code) in _BUILDING_OPCODES and building is None:
                    building = f"an object by pickle's {_BUILDING_OPCODES[ord(opcode.code)]} instruction"
        except Exception:  # noqa: BLE001 -- not a whole pickle: damaged, not dangerous
            continue
        unusual = [name for name in named if not name.startswith(_CHECKPOINT_GLOBALS)]
        if unusual or building:
            return unusual[0] if unusual else building
    return None


# What the pickles of checkpoints and weights files name (torch's rebuild functions and storages, OrderedDict, the
# NumPy arrays of old RNG states): a refused pickle that names only these asks for something else, said generically.
_CHECKPOINT_GLOBALS = (
    "torch.",
    "collections.OrderedDict",
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.ndarray",
    "numpy.dtype",
    "numpy.dtypes.",
    "builtins.set",
    "builtins.frozenset",
    "_codecs.encode",
)


# Opcodes that name a class or a registered callable to build (refused by torch as "Unsupported operand N"); any
# other unsupported byte is a file that is not a pickle at all.
_BUILDING_OPCODES = {ord("i"): "INST", ord("o"): "OBJ", 0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4", 0x92: "NEWOBJ_EX"}


def _is_whole_pickle(source) -> bool:
    """Whether a file's pickles (a zip's `*.pkl` members, or its bytes) parse to the end (pickletools, nothing run)."""
    pickles = _pickles_in(source)
    try:
        for data in pickles:
            for _ in pickletools.genops(data):
                pass
    except Exception:  # noqa: BLE001 -- not a whole pickle
        return False
    return bool(pickles)


ZIP_RATIO = 100  # a member that inflates more than this is a decompression bomb, not tensors (torch stores them)


def _check_zip(source, path) -> None:
    """A zip file (torch's format) whose members inflate more than ZIP_RATIO times is refused before it is read:
    torch decompresses a deflated member into memory whole (a 2 MB file became 2 GiB)."""
    if isinstance(source, io.BytesIO) or not zipfile.is_zipfile(source):
        return
    try:
        with zipfile.ZipFile(source) as archive:
            for info in archive.infolist():
                if info.compress_type != zipfile.ZIP_STORED and info.file_size > ZIP_RATIO * max(
                    info.compress_size, 1 << 16
                ):
                    raise UnsafeFileError(
                        f"{printable(str(path))}: refused: {printable(info.filename)} inflates "
                        f"{info.compress_size} bytes to {info.file_size} (a decompression bomb; "
                        "torch stores tensors uncompressed)"
                    )
    except zipfile.BadZipFile:
        return  # torch.load says how it is damaged


def load_pickle(source, map_location="cpu", mmap: bool = False, path=None):
    """torch.load(`source`) with weights_only=True (and SAFE_GLOBALS); UnsafeFileError for anything else."""
    path = path if path is not None else source
    _check_zip(source, path)
    with torch.serialization.safe_globals(SAFE_GLOBALS), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol")  # said of every file of protocol > 2
        try:
            return load_torch(source, map_location=map_location, weights_only=True, mmap=mmap)
        except RuntimeError as error:  # torch's zip reader: a truncated or damaged archive
            raise ValueError(f"{path} cannot be read: {printable(str(error).splitlines()[0])[:200]}") from None
        except pickle.UnpicklingError as error:
            wanted = _wanted(error) or _asks_for(source)
            if wanted is None and _is_whole_pickle(source):  # a weights-only refusal of a valid pickle: never damage
                wanted = "an object torch's weights-only reader refuses"
            if wanted is None:  # damaged, not dangerous: the caller's "unreadable"
                said = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(error))
                reason = said.group(1) if said else str(error).splitlines()[0]
                raise ValueError(f"{path} cannot be read: not a whole pickle ({printable(reason[:200])})") from None
            raise refusal(path, wanted) from None


# --- torch.distributed.checkpoint, read safely ------------------------------------------------------------------

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata`: its own dataclasses, torch dtypes and sizes, paths; nothing else is built."""

    def __init__(self, file, path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):  # how some Pythons pickle an enum member (3.11.2: Debian's)
            return self._member_of
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise refusal(self.path, f"{module}.{name}")

    def _member_of(self, owner, name):
        """getattr as an enum member's pickle uses it, and nothing more: `owner` one of the allowed enums, `name`
        one of its members (a free getattr would reach any attribute of anything)."""
        if (
            isinstance(owner, type)
            and issubclass(owner, enum.Enum)
            and isinstance(name, str)
            and name in owner.__members__
        ):
            return owner[name]
        raise refusal(self.path, f"builtins.getattr({getattr(owner, '__name__', type(owner).__name__)}, {name!r})")


def regular_file(path: Path, what: str = "") -> int:
    """The size of `path`, a regular file that is not a link: a link, FIFO, device or folder is refused
    (UnsafeFileError, before anything is read: a link can point outside the checkpoint, a FIFO hangs the reader,
    /dev/zero never ends); a missing file is damage (FileNotFoundError)."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file"
        raise UnsafeFileError(
            f"{printable(str(path))}{what}: refused: {kind} (a checkpoint's files are its own, "
            "regular files inside its folder)"
        )
    return info.st_size


def check_storage(folder: Path, metadata) -> None:
    """Every file a DCP folder's metadata points into: a relative path inside the folder (not absolute, no `..`),
    a regular file there (regular_file), each item's bytes within its size. A path that leaves the folder, a link
    or a special file: refused (UnsafeFileError); a missing file or an item past its end: damaged (ValueError)."""
    sizes: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        relative = str(info.relative_path)
        if Path(relative).is_absolute() or ".." in Path(relative).parts or not relative:
            raise UnsafeFileError(
                f"{printable(str(folder))}: refused: its .metadata points to "
                f"{printable(relative)!r}, outside the checkpoint folder"
            )
        if relative not in sizes:
            try:
                sizes[relative] = regular_file(folder / relative)
            except FileNotFoundError:
                raise ValueError(f"{folder} is damaged: {relative}, which its .metadata names, is missing") from None
        if not (0 <= info.offset and 0 <= info.length and info.offset + info.length <= sizes[relative]):
            raise ValueError(
                f"{folder} is damaged: an item of {relative} lies past its end "
                f"(bytes {info.offset}..{info.offset + info.length} of {sizes[relative]})"
            )


def first_non_finite(tensors, where: str = "") -> str | None:
    """The dotted name of the first floating tensor in a nested mapping that holds NaN or Inf (a DTensor: this
    rank's shard), or None."""
    items = tensors.items() if isinstance(tensors, dict) else ()
    for key, value in items:
        name = f"{where}.{key}" if where else str(key)
        if isinstance(value, dict):
            found = first_non_finite(value, name)
            if found is not None:
                return found
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            local = value.to_local() if hasattr(value, "to_local") else value
            if local.numel() and not bool(torch.isfinite(local).all()):
                return name
    return None


def check_shapes(state_dict: dict, metadata, path: Path) -> None:
    """Every tensor a load fills has the shape the checkpoint declares for it (a DTensor: its global shape), before
    any is read: a wrong-shaped average or decoder is damage (ValueError, one line naming the file and the key)."""
    declared = metadata.state_dict_metadata
    flat = {}

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, dict):
                walk(value, name)
            else:
                flat[name] = value

    walk(state_dict, "")
    for name, value in flat.items():
        saved = getattr(declared.get(name), "size", None)
        if isinstance(value, torch.Tensor) and saved is not None and tuple(saved) != tuple(value.shape):
            raise ValueError(
                f"{path} is damaged: it declares {printable(name)[:80]} as {list(saved)[:8]}, the run's is "
                f"{list(value.shape)[:8]} (another model, or an edited file)"
            )


def check_declared_sizes(folder: Path, metadata) -> None:
    """Every tensor's declared size and dtype (DCP's .metadata) fit the bytes the folder holds, before anything is
    allocated for them: a declared 2^51 elements is damage (ValueError, one line), not an allocation."""
    stored = sum(info.length for info in (getattr(metadata, "storage_data", None) or {}).values())
    for key, item in (getattr(metadata, "state_dict_metadata", None) or {}).items():
        size = getattr(item, "size", None)
        if size is None:
            continue
        dtype = getattr(getattr(item, "properties", None), "dtype", None)
        if not isinstance(dtype, torch.dtype) or not all(type(dim) is int and dim >= 0 for dim in size):
            raise ValueError(f"{folder} is damaged: its .metadata declares {printable(key)[:80]} as {_shown(size)}")
        declared = math.prod(size) * dtype.itemsize
        chunks = getattr(item, "chunks", None) or []
        inside = all(
            len(chunk.offsets) == len(size) == len(chunk.sizes)
            and all(0 <= at and at + n <= dim for at, n, dim in zip(chunk.offsets, chunk.sizes, size))
            for chunk in chunks
        )
        if declared > stored or not inside:
            raise ValueError(
                f"{folder} is damaged: its .metadata declares {printable(key)[:80]} of {list(size)[:8]} {dtype} "
                f"({declared} bytes), more than its {stored} bytes of data hold"
            )


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata read builds DCP's own classes only, and whose items are regular files
    inside the checkpoint folder (check_storage)."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        named = getattr(self, "_get_metadata_path", None)  # torch 2.6-2.7: the folder's .metadata, one for all ranks
        path = named(rank) if named is not None else self.fs.concat_path(self.path, ".metadata")
        try:
            regular_file(Path(path), "")
        except FileNotFoundError:
            raise ValueError(f"{self.path} is not a checkpoint folder: it has no .metadata") from None
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = _MetadataUnpickler(metadata_file, Path(self.path)).load()
        check_storage(Path(self.path), metadata)
        check_declared_sizes(Path(self.path), metadata)
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeBytes:
    """load_bytes for a DCP planner: non-tensor items with weights_only."""

    checkpoint: Path
    flatten_state_dict: bool  # DCP's planner holds these: the state it loads into
    original_state_dict: dict
    mappings: dict
    state_dict: dict

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = load_pickle(value, path=self.checkpoint)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """DCP's default load planner (into a state dict of the right structure) with non-tensor items read safely."""

    def __init__(self, checkpoint: Path, **options):
        super().__init__(**options)
        self.checkpoint = checkpoint


class SafeModelPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """Loads the items under `keys` into an empty state dict, built from the metadata (no model needed)."""

    def __init__(self, checkpoint: Path, keys: set[str]):
        super().__init__(keys=keys)
        self.checkpoint = checkpoint


SINGLE_PROCESS_WARNING = "torch.distributed is (disabled, )?unavailable or uninitialized"


@contextmanager
def single_process_quietly():
    """DCP warns on every save and load without a process group that it assumes one process: it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        yield


def read_failure(error: BaseException) -> str:
    """A read failure in one line: DCP's CheckpointException by its first rank's cause."""
    if isinstance(error, CheckpointException) and error.failures:
        cause = next(iter(error.failures.values()))
        error = cause[0] if isinstance(cause, tuple) else cause
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


@contextmanager
def _refusals_unwrapped():
    """DCP wraps what its steps raise in a CheckpointException (per rank): a refusal comes out as itself."""
    try:
        yield
    except CheckpointException as failure:
        for cause in failure.failures.values():
            cause = cause[0] if isinstance(cause, tuple) else cause
            if isinstance(cause, UnsafeFileError):
                raise cause from None
        raise


def load_dcp(state_dict: dict, path: Path) -> None:
    """Collective where a process group exists: `state_dict`'s tensors (and items) read from the folder `path`
    in place, resharded to whatever this state dict's layout is (any world size, DDP or FSDP)."""
    metadata = SafeReader(str(path)).read_metadata()  # a refusal as itself (DCP would fold it into an assertion)
    check_shapes(state_dict, metadata, path)
    with single_process_quietly(), _refusals_unwrapped():
        dcp.load(state_dict, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(path))


def dcp_sizes(path: Path) -> dict[str, torch.Size]:
    """The size of every tensor in a DCP folder, by flattened key ("model.visual.proj"), from its metadata alone."""
    metadata = SafeReader(str(path)).read_metadata()
    return {key: item.size for key, item in metadata.state_dict_metadata.items() if hasattr(item, "size")}


def read_dcp(path: Path, keys: set[str]) -> dict:
    """The items under `keys` of a DCP folder, whole, on this process alone (no process group). As torch's own
    `_load_state_dict_from_keys` (the public load fills only keys the state dict already has), safely planned."""
    state: dict = {}
    SafeReader(str(path)).read_metadata()  # a refusal as itself (DCP would fold it into an AssertionError's text)
    with single_process_quietly(), _refusals_unwrapped():
        _load_state_dict(
            state, storage_reader=SafeReader(str(path)), planner=SafeModelPlanner(path, keys), no_dist=True
        )
    return state


# --- clipdist checkpoints and weights files ----------------------------------------------------------------------

CHECKPOINT = re.compile(r"step_(\d{8})\.(pt|dcp)$")  # .dcp: a folder (the format); .pt: one file (before it)


def checkpoints_in(directory: Path) -> list[Path]:
    """Complete checkpoints in a run's checkpoints/ folder, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(match.group(1)), path) for path in directory.iterdir() if (match := CHECKPOINT.search(path.name))]
    return [path for _, path in sorted(found, key=lambda pair: pair[0], reverse=True)]


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is laid out as a checkpoint (a .pt file, or a folder with a progress file — whatever kind of
    file: reading it checks that, and refuses a link or a FIFO in one line)."""
    return path.suffix == ".pt" and os.path.lexists(path) and not path.is_dir() or os.path.lexists(path / PROGRESS)


def find_checkpoint(source: str | Path) -> Path:
    """The checkpoint `source` names: itself (a .dcp folder, a .pt file), or a run directory's newest."""
    path = Path(source).expanduser()
    if is_checkpoint(path):
        return path
    if path.is_dir():
        found = checkpoints_in(path / "checkpoints")
        if found:
            return found[0]
        raise FileNotFoundError(
            f"{path} holds no checkpoint (looked for {path / 'checkpoints'}/step_*.dcp or .pt); a model folder is "
            "named local-dir:PATH (open_clip's layout, as `clipdist export` writes it)"
        )
    raise FileNotFoundError(f"{path}: no such run directory, checkpoint folder or file")


def read_progress(path: Path, map_location="cpu") -> dict:
    """A checkpoint's progress: everything but the model and optimizer tensors of a .dcp folder (step, samples,
    schedule, RNG, stream, world size, config); a legacy .pt file whole (its model and optimizer included).
    Regular files only (regular_file)."""
    file = path / PROGRESS if path.is_dir() else path
    regular_file(file)
    return load_pickle(file, map_location=map_location, mmap=not path.is_dir())


SAVED_CONFIG_VALUES = 100_000  # a saved config holds a few hundred
SAVED_CONFIG_DEPTH = 32


def check_saved_config(config, path) -> None:
    """A checkpoint's saved config is plain data as clipdist writes it, or it is refused (UnsafeFileError): no
    container shared by two parents (a few KB of pickle memo can stand for 2^60 values to whoever walks them), at
    most SAVED_CONFIG_DEPTH deep and SAVED_CONFIG_VALUES values, and no `${...}` anywhere (read back through
    OmegaConf, `${oc.env:AWS_SECRET_ACCESS_KEY}` would be resolved: clipdist saves configs resolved)."""
    seen: set[int] = set()
    stack, count = [(config, 0, "config")], 0
    while stack:
        value, depth, where = stack.pop()
        count += 1
        if count > SAVED_CONFIG_VALUES or depth > SAVED_CONFIG_DEPTH:
            raise UnsafeFileError(f"{path}: refused: its saved config is larger or deeper than any clipdist writes")
        if isinstance(value, str) and "${" in value:
            raise UnsafeFileError(
                f"{path}: refused: its saved config holds an interpolation at {printable(where)} "
                "(clipdist saves configs resolved; reading it back would resolve it here)"
            )
        if isinstance(value, (dict, list, tuple)) and value:
            if id(value) in seen:
                raise UnsafeFileError(
                    f"{path}: refused: its saved config shares {printable(where)} between two "
                    "places (clipdist never writes that; walked, it can stand for billions of values)"
                )
            seen.add(id(value))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend((item, depth + 1, f"{where}.{key}"[:200]) for key, item in items)
            if isinstance(value, dict):
                stack.extend((key, depth + 1, where) for key in value if isinstance(key, str))


MAX_WORLD_SIZE = 1 << 20
MAX_STEP = 1 << 40  # 10^12 steps: beyond any run
MAX_GLOBAL_BATCH = 1 << 24  # samples a step, at most: samples_seen ≤ step × this
POSITION_SLACK = 1 << 24  # the stream's position runs ahead of samples_seen by the samples it skipped, no more


def check_counters(progress: dict, path) -> None:
    """What a resume continues from is what clipdist writes, or the checkpoint is damaged (ValueError, one line
    naming the file and the field): `step` 0 to 2^40, `samples_seen` 0 to step × 2^24, `world_size` 1 to 2^20, the
    saved config a mapping, the schedule's state a mapping with a `last_epoch` within the steps and finite rates,
    the stream's position within the samples seen (plus those it skipped) and its batches within the steps. An
    edited `step=-5` would rewind the logs past the run's start, a string or a position of 10^15 fail deep in the
    loop."""
    step = progress.get("step", 0)
    bounds = {
        "step": (0, MAX_STEP),
        "samples_seen": (0, (step if type(step) is int else 0) * MAX_GLOBAL_BATCH),
        "world_size": (1, MAX_WORLD_SIZE),
    }
    for key, (low, high) in bounds.items():
        if key in progress:
            _check_count(progress[key], low, high, path, key)
    if "config" in progress and not isinstance(progress["config"], dict):
        raise ValueError(f"{path}: its config is {_shown(progress['config'])}, not a mapping (damaged or edited)")
    if "scheduler" in progress or Path(path).is_dir():  # a .dcp's progress always has one (a .pt's of old: maybe)
        scheduler = progress.get("scheduler")
        if not isinstance(scheduler, dict):
            raise ValueError(f"{path}: its scheduler state is {_shown(scheduler)}, not a mapping (damaged or edited)")
        _check_count(scheduler.get("last_epoch"), -1, MAX_STEP, path, "scheduler.last_epoch")
        for key in ("base_lrs", "_last_lr"):
            rates = scheduler.get(key, [])
            if not isinstance(rates, list) or not all(_finite_number(rate) for rate in rates):
                raise ValueError(f"{path}: its scheduler.{key} is {_shown(rates)}, not a list of finite learning rates")
    stream = progress.get("stream")
    if stream is None:
        return
    if not isinstance(stream, dict):
        raise ValueError(f"{path}: its stream position is {_shown(stream)}, not a mapping (damaged or edited)")
    skipped = stream.get("skipped_samples", 0)
    _check_count(skipped, 0, MAX_STEP * MAX_GLOBAL_BATCH, path, "stream.skipped_samples")
    _check_count(stream.get("skipped_shards", 0), 0, MAX_STEP * MAX_GLOBAL_BATCH, path, "stream.skipped_shards")
    seen = progress.get("samples_seen", 0)
    _check_count(stream.get("position", 0), 0, seen + skipped + POSITION_SLACK, path, "stream.position")
    _check_count(stream.get("batches", 0), 0, (step or 0) + POSITION_SLACK, path, "stream.batches")
    _check_layout(stream.get("layout"), path)


MAX_READERS = 1 << 26  # a layout's readers at most (2^20 ranks × 64 workers, the most an earlier layout could have)


def _check_layout(layout, path) -> None:
    """The stream's layout as a resume builds its order and readers from it: V readers (the order's offsets are
    allocated per reader), a positive cycle, and a reader's shuffle buffer no larger than the layout's
    data.shuffle_buffer (a slot's readers share it: an edited 10^12 would have every reader hold its whole pass)."""
    if not isinstance(layout, dict) or "cycle" not in layout:
        return  # none, or an earlier clipdist's per-rank position: the stream restarts and says so
    _check_count(layout.get("readers"), 1, MAX_READERS, path, "stream.layout.readers")
    _check_count(layout.get("cycle"), 1, MAX_STEP * MAX_GLOBAL_BATCH, path, "stream.layout.cycle")
    if "buffer" in layout:
        _check_count(layout.get("shuffle_buffer"), 0, MAX_STEP, path, "stream.layout.shuffle_buffer")
        _check_count(layout["buffer"], 0, layout["shuffle_buffer"], path, "stream.layout.buffer")


def _check_count(value, low: int, high: int, path, key: str) -> None:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{path}: its {key} is {_shown(value)}, not a count clipdist writes (damaged or edited)")


def _finite_number(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _shown(value) -> str:
    return printable(repr(value))[:40] if isinstance(value, (int, str, float, type(None))) else type(value).__name__


def verify(path: Path) -> dict:
    """Read every pickled part of checkpoint `path` the safe way, tensors left out where they can be: nothing in
    it may build more than clipdist saves (UnsafeFileError names the first thing that would). Before any rank
    starts, so that a refused file stops the run at once. Returns its progress (read_progress), read once."""
    progress = read_progress(path)  # a .pt file whole: every pickled part there is
    if isinstance(progress, dict):
        check_saved_config(progress.get("config"), path)
        check_counters(progress, path)
    if not path.is_dir():
        return progress
    metadata = SafeReader(str(path)).read_metadata()
    items = {key for key, item in metadata.state_dict_metadata.items() if isinstance(item, BytesStorageMetadata)}
    if items:
        read_dcp(path, items)
    return progress


def read_run_checkpoint(
    path: Path, ema: bool = False, training_parts: bool = False
) -> tuple[dict[str, torch.Tensor], dict]:
    """(the model's weights, the run's resolved config) of a clipdist checkpoint, on this process alone; with `ema`,
    its weight average (optim.ema) in place of the parameters (the buffers are the model's); the modules only a loss
    term trains (registry.terms.training_only_parts: a head, the caption decoder) left out unless `training_parts`.
    Every pickled part is checked first, the parts the model does not need included: a checkpoint that carries code
    anywhere is refused, whatever is read of it."""
    progress = verify(path)
    if "config" not in progress:
        raise ValueError(f"{path} is not a clipdist checkpoint (no config in it)")
    if path.is_dir():
        parts = read_dcp(path, {"model", "ema"} if ema else {"model"})
        weights, average = parts["model"], parts.get("ema")
    elif "model" not in progress:
        raise ValueError(f"{path} is not a clipdist checkpoint (no model in it)")
    else:
        weights, average = progress["model"], progress.get("ema")
    weights = {name: tensor for name, tensor in weights.items() if training_parts or not training_only(name)}
    bad = first_non_finite({"model": weights, **({"ema": average} if ema and average else {})})
    if bad is not None:
        raise ValueError(f"{path} is damaged: its {printable(bad)[:80]} holds NaN or Inf (nothing is read from it)")
    if not ema:
        return weights, progress["config"]
    if not average:
        raise ValueError(f"{path} holds no weight average: its run trained without optim.ema.decay; leave out --ema")
    shaped = (name for name, tensor in average.items() if name in weights and tensor.shape != weights[name].shape)
    wrong = next(shaped, None)
    if wrong is not None:
        raise ValueError(
            f"{path} is damaged: its weight average's {printable(wrong)[:80]} is {list(average[wrong].shape)}, "
            f"the model's {list(weights[wrong].shape)}"
        )
    averaged = {name: tensor.to(weights[name].dtype) for name, tensor in average.items() if name in weights}
    return {**weights, **averaged}, progress["config"]


SAFETENSORS_HEADER_BYTES = 8 << 20  # a model's tensor index: ~100 bytes a tensor, a few thousand tensors (~1 MB)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A .safetensors file, its header bounded first (a million entries is a memory and time bomb, not a model);
    a malformed file is a ValueError in one line."""
    with open_user(path) as file:
        prefix = file.read(8)
    header = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if not 0 < header <= SAFETENSORS_HEADER_BYTES:
        what = "no header" if header <= 0 else f"a header of {header >> 20} MiB, more tensors than any model has"
        raise ValueError(f"{path} is not a safetensors file clipdist reads: {what}")
    try:
        return load_safetensors(path)
    except Exception as error:  # noqa: BLE001 -- SafetensorError and friends: damaged
        raise ValueError(f"{path} cannot be read as safetensors: {printable(str(error))[:200]}") from None


def own_file(folder: Path, path: Path) -> Path:
    """`path`, a file of `folder`, where it is the folder's own: a symbolic link is followed only to a file inside
    the folder, or into its Hugging Face cache's blobs (snapshots/<rev>/x -> ../../blobs/<hash>, the cache's own
    layout); a link anywhere else is refused (UnsafeFileError) — an export folder cannot read /etc or ~/.ssh."""
    if not path.is_symlink():
        return path
    target, home = path.resolve(), folder.resolve()
    blobs = home.parent.parent / "blobs" if home.parent.name == "snapshots" else None
    if target.is_relative_to(home) or (blobs is not None and target.is_relative_to(blobs)):
        return path
    raise UnsafeFileError(
        f"{printable(str(path))}: refused: a symbolic link to a file outside its folder (a model folder's files "
        "are its own; copy the file in)"
    )


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The model weights in `path`, whichever way they were saved: an open_clip checkpoint file (a state dict,
    or {"state_dict": ...}, .pt/.bin/.safetensors), a folder in open_clip's hub layout (`clipdist export`,
    `local-dir:`), or a clipdist run or checkpoint (its model alone). A ValueError says what is wrong with a path
    that holds none of these; UnsafeFileError, a file that would run code."""
    path = Path(path).expanduser()
    if path.is_dir() and (is_checkpoint(path) or (path / "checkpoints").is_dir()):
        return read_run_checkpoint(find_checkpoint(path))[0]
    if path.is_dir():  # an export, or any folder of weights in open_clip's hub layout
        found = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")) + sorted(path.glob("*.pt"))
        if not found:
            raise ValueError(f"{path} holds no weights (*.safetensors, *.bin, *.pt)")
        path = own_file(path, found[0])
    if not path.exists():
        raise ValueError(f"{path}: no such file or folder")
    if not stat.S_ISREG(path.stat().st_mode):  # through links (a hub cache's files are links), never to a FIFO
        raise UnsafeFileError(f"{printable(str(path))}: refused: not a regular file")
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    try:
        saved = load_pickle(path)
    except UnsafeFileError:
        raise
    except Exception as error:  # noqa: BLE001 -- whatever reading raised is the reason
        raise ValueError(f"{path} holds no model weights that can be read ({type(error).__name__}: {error})") from None
    if isinstance(saved, dict) and isinstance(saved.get("model"), dict) and "config" in saved:
        saved = saved["model"]  # a clipdist checkpoint of the .pt days
    elif isinstance(saved, dict) and isinstance(saved.get("state_dict"), dict):
        saved = saved["state_dict"]
    if not isinstance(saved, dict) or not all(isinstance(value, torch.Tensor) for value in saved.values()):
        raise ValueError(f"{path} holds no state dict of tensors")
    return {key.removeprefix("module."): value for key, value in saved.items()}
