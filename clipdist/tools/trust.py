"""`clipdist trust SOURCE`: a checkpoint or weights file you trust, converted once into a copy clipdist reads
without running anything.

clipdist refuses any file whose reading would build more than tensors and plain values (clipdist.checkpoint.weights),
since unpickling can run code that came with the file. A file from before (a colleague's checkpoint, weights
pickled by another tool) may hold such things harmlessly. `trust` reads SOURCE the unsafe way — **whatever code
it carries runs now, as you** — and writes a copy of only its tensors and plain values:

- a file (.pt, .bin, .pth): `<stem>.trusted<suffix>` beside it (or --out);
- a checkpoint folder (.dcp): `<name>.trusted.dcp` beside it (or --out), its shards re-saved whole by this process.

Anything that is neither a tensor nor a plain value (int, float, str, bytes, bool, None, and lists, tuples and
dicts of them; NumPy arrays become lists) stops the conversion with its place in the file: no clipdist file holds one.
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from clipdist.checkpoint.weights import PROGRESS, read_failure, single_process_quietly
from clipdist.errors import printable
from clipdist.files import load_torch, publish, save_torch

PLAIN = (int, float, str, bytes, bool, type(None), torch.dtype, torch.device)


def plain_copy(value, where: str = "it"):
    """`value` as tensors and plain values only; a ValueError names the first thing that is neither."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone() if type(value) is torch.Tensor else torch.Tensor(value.detach()).clone()
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, np.ndarray) and value.dtype != object:
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, (dict, OrderedDict)):
        return {plain_copy(key, where): plain_copy(item, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        copied = [plain_copy(item, f"{where}[{index}]") for index, item in enumerate(value)]
        return copied if isinstance(value, list) else tuple(copied)
    raise ValueError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which no checkpoint or "
        "weights file holds: not converted"
    )


def trust(source: str | Path, out: str | Path | None = None) -> Path:
    """Convert `source` (see the module docstring); the path of the safe copy. Runs the code `source` carries."""
    source = Path(source).expanduser()
    if source.is_dir():
        if not (source / PROGRESS).is_file() or not (source / ".metadata").is_file():
            raise ValueError(f"{source} is no checkpoint folder (it needs {PROGRESS} and .metadata)")
        out = Path(out) if out else source.with_name(source.name.removesuffix(".dcp") + ".trusted.dcp")
        return publish(out, lambda staging: _convert_folder(source, staging), hint="give another --out, or remove it")
    if not source.is_file():
        raise ValueError(f"{source}: no such file or checkpoint folder")
    out = Path(out) if out else source.with_name(f"{source.stem}.trusted{source.suffix}")
    with _read(source):
        loaded = load_torch(source, map_location="cpu", weights_only=False)  # the trusted, unsafe read
    copy = plain_copy(loaded, where=str(source))
    return publish(out, lambda staging: save_torch(copy, staging), hint="give another --out, or remove it")


@contextmanager
def _read(source: Path):
    """torch's or DCP's reader on `source`: whatever it raises (a damaged pickle, zip or metadata file, or the code the
    file runs failing; DCP's CheckpointException, a BaseException) is the file's: a ValueError naming it. DCP's own
    traceback of its metadata fallback (a warning of the root logger's) is left unprinted: this line says it."""
    loader_log = logging.getLogger()  # DCP's loader logs to the root logger
    level = loader_log.level
    loader_log.setLevel(logging.ERROR)
    try:
        yield
    except (Exception, CheckpointException) as error:  # noqa: BLE001 -- the file's, said in one line
        raise ValueError(f"{source} cannot be read by torch ({printable(read_failure(error))})") from None
    finally:
        loader_log.setLevel(level)


def _convert_folder(source: Path, staging: Path) -> None:
    state: dict = {}
    with single_process_quietly():  # the trusted, unsafe read: DCP's own reader and planner
        with _read(source):
            _load_state_dict(
                state,
                storage_reader=dcp.FileSystemReader(str(source)),
                planner=_EmptyStateDictLoadPlanner(),
                no_dist=True,
            )
        alone = {"no_dist": True} if "no_dist" in inspect.signature(dcp.save).parameters else {}  # 2.6: no group: alone
        dcp.save(plain_copy(state, where=str(source)), checkpoint_id=str(staging), **alone)
    with _read(source / PROGRESS):
        progress = load_torch(source / PROGRESS, map_location="cpu", weights_only=False)
    save_torch(plain_copy(progress, where=str(source / PROGRESS)), staging / PROGRESS)
