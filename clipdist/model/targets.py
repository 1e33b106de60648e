"""What a user names as a model, resolved once: a run directory or checkpoint, an export folder, a weights file
(with its model named), or an open_clip name (`ViT-B-32` with a pretrained tag, `hf-hub:ORG/REPO`,
`local-dir:PATH`, a config file). Used by `clipdist eval`, `clipdist plan --distill`, `loss.distill.model` and
every check of them before the ranks start.

    target = resolve("runs/x")          # Target(kind="checkpoint", ...): what it is, no tensor read
    check(target)                       # what load would refuse, in one line (a ValueError), no tensor read
    structure(target)                   # the model on the meta device: its shapes, nothing allocated
    model, name = load(target)          # the model with its weights, and the name its tokenizer goes by
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import try_to_load_from_cache

from clipdist.checkpoint.weights import CHECKPOINT, find_checkpoint, read_run_checkpoint, verify
from clipdist.config import ModelConfig, model_config
from clipdist.distributed.parallel import node_leaders_first
from clipdist.errors import printable
from clipdist.model.factory import (
    EXPORT_CONFIG,
    create_model,
    fetches_weights,
    hub_offline,
    model_overrides,
    pretrained_cfg,
    resolve_model_name,
    weights_for,
)


@dataclass(frozen=True)
class Target:
    """A resolved target. kind: "export" (a folder open_clip reads as `local-dir:`), "checkpoint" (a run
    directory's newest or a named `.dcp` / `.pt`), "weights" (a file of weights; `name` is the model it fits) or
    "name" (an open_clip model name with `pretrained`)."""

    kind: str
    spec: str  # as the user gave it
    name: str | None  # the open_clip model name to build (None for a checkpoint: its saved config says)
    path: Path | None = None  # the export folder, the checkpoint, the weights file
    pretrained: str | None = None
    ema: bool = False  # a checkpoint's weight average (optim.ema) in place of its weights

    @property
    def model(self) -> str:
        """The open_clip name to build (an export, a weights file, a name; a checkpoint's is in its config)."""
        if self.name is None:
            raise ValueError(f"{self.spec}: a {self.kind} names no model of its own")
        return self.name

    @property
    def file(self) -> Path:
        """The export folder, the checkpoint or the weights file."""
        if self.path is None:
            raise ValueError(f"{self.spec}: a {self.kind} is no file")
        return self.path


def resolve(spec: str, pretrained: str | None = None, model_name: str | None = None, ema: bool = False) -> Target:
    """What `spec` names (the module docstring); a ValueError where a weights file names no model, or where `ema`
    asks for a weight average of anything but a run or a checkpoint."""
    path = Path(spec).expanduser()
    export = path.is_dir() and (path / EXPORT_CONFIG).is_file()
    checkpoint = not export and path.exists() and (path.is_dir() or bool(CHECKPOINT.search(path.name)))
    if ema and not checkpoint:
        raise ValueError(f"--ema takes a run directory or a checkpoint (its optim.ema average); {spec} is neither")
    if export:
        return Target("export", spec, f"local-dir:{path}", path)
    if checkpoint:
        return Target("checkpoint", spec, None, path, ema=ema)
    if path.is_file():
        if not model_name:
            raise ValueError(f"{spec} is a weights file: name its model too (--model ViT-B-32)")
        return Target("weights", spec, model_name, path)
    return Target("name", spec, spec, None, pretrained)


def check(target: Target) -> None:
    """What `load` would refuse, found without reading any tensor (so no parallel op runs in this process before
    it forks ranks: libgomp is not fork-safe)."""
    if target.kind == "checkpoint":
        config = verify(find_checkpoint(target.file)).get("config", {})
        saved_name(model_config(config.get("model", {})).name, target.spec)  # a file it names is checked too
    elif target.kind in ("export", "weights"):
        resolve_model_name(target.model)
    elif target.kind == "name":
        pretrained_cfg(resolve_model_name(target.model), target.pretrained)


def saved_name(name: str, where: str) -> str:
    """A model name a saved file holds (a run's config), resolved without the network: an `hf-hub:` model only
    where its config is already in this machine's cache (a file does not choose what is fetched); a ValueError in
    one line otherwise."""
    if name.startswith("hf-hub:"):
        found = try_to_load_from_cache(name.removeprefix("hf-hub:"), EXPORT_CONFIG)
        if not isinstance(found, str):
            shown = printable(name)[:80]
            raise ValueError(
                f"{where}: its saved model.name={shown} is a hub model not in this machine's cache, and a saved "
                f"run does not reach the network: fetch it once on purpose (clipdist eval {shown}), then use the run"
            )
    return resolve_model_name(name)


def _saved_model(config: dict, where: str, **options) -> tuple[ModelConfig, torch.nn.Module]:
    """(the ModelConfig a run saved in its `config`, the model built from it with `options`): its name checked
    (saved_name) and built with huggingface_hub answering from its cache alone."""
    model_cfg = model_config(config.get("model", {}))
    saved_name(model_cfg.name, where)
    with hub_offline():
        return model_cfg, create_model(model_cfg.name, overrides=model_overrides(model_cfg, fetch=False), **options)


def structure(target: Target) -> torch.nn.Module:
    """The model `target` names on the meta device: its structure, no tensor read (a checkpoint is verified once
    and its saved config read)."""
    if target.kind == "checkpoint":
        return _saved_model(verify(find_checkpoint(target.file)).get("config", {}), target.spec, device="meta")[1]
    if target.kind == "name":
        check(target)  # its pretrained tag; create_model resolves (and checks) every kind's name itself
    return create_model(target.model, device="meta")


def load(target: Target, cache_dir: str | None = None, device: str = "cpu") -> tuple[torch.nn.Module, str]:
    """(the model with its weights, the model name its tokenizer goes by); a ValueError in one line where it
    cannot. device="meta": the structure alone, the weights only checked to fit."""
    if target.kind == "export":
        return create_model(target.model, cache_dir=cache_dir, device=device), target.model
    if target.kind == "checkpoint":
        checkpoint = find_checkpoint(target.file)
        weights, config = read_run_checkpoint(checkpoint, ema=target.ema)
        bias = 0.0 if "logit_bias" in weights else None
        model_cfg, model = _saved_model(config, target.spec, init_logit_bias=bias, device=device)
        fitting = weights_for(model, weights, checkpoint)
        if device != "meta":
            model.load_state_dict(fitting)
        return model, model_cfg.name
    if target.kind == "weights":
        return create_model(target.model, checkpoint=str(target.file), cache_dir=cache_dir, device=device), target.model
    return create_model(target.model, pretrained=target.pretrained, cache_dir=cache_dir, device=device), target.model


def load_teacher(
    distill, cache_dir: str | None, device: torch.device, dtype: torch.dtype | None, local_rank: int = 0
) -> torch.nn.Module | None:
    """loss.distill's teacher (registry.terms.DistillOptions; None where it names none): frozen, in eval mode, in
    `dtype`, on `device`, whole on every rank, fetched by one rank a node first. That it can take the student's
    inputs was checked before the ranks started (preflight)."""
    if not distill.model:
        return None
    with node_leaders_first(local_rank, needed=fetches_weights(distill.model, distill.pretrained)):
        teacher, _ = load(resolve(distill.model, distill.pretrained), cache_dir=cache_dir)
    return teacher.to(device, dtype).eval().requires_grad_(False)
