"""open_clip_train's recipes in clipdist — schedules, locked towers, optimizers, augmentation, model overrides,
fp16 with a gradient scaler — each compared with open_clip's own code from the installed wheel."""

from __future__ import annotations

import json
import math
import random

import open_clip
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from clipdist.config import DataConfig, ModelConfig, OptimConfig, check_schedule, model_config, to_train_config
from clipdist.data.batch import Batch
from clipdist.data.transforms import augmentation_cfg, image_transforms
from clipdist.errors import ConfigError
from clipdist.model.factory import built_model_config, create_model, lock_towers, model_overrides
from clipdist.model.precision import gradient_scaler
from clipdist.optim.optimizer import build_optimizer, check_optim, layer_scales
from clipdist.train.step import build_step


def _optim(**values) -> OptimConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(OptimConfig), values))


def _model_cfg(**values) -> ModelConfig:
    return model_config(values)


@pytest.mark.parametrize(
    "schedule, extra, open_clip_schedule",
    [
        ("cosine", {}, lambda o, lr, w, s: __import__("open_clip_train.scheduler").scheduler.cosine_lr(o, lr, w, s)),
        ("const", {}, lambda o, lr, w, s: __import__("open_clip_train.scheduler").scheduler.const_lr(o, lr, w, s)),
        (
            "const_cooldown",
            {"const_cooldown": {"steps": 30}},
            lambda o, lr, w, s: __import__("open_clip_train.scheduler").scheduler.const_lr_cooldown(o, lr, w, s, 30),
        ),
        (
            "const_cooldown",
            {"const_cooldown": {"steps": 25, "power": 2.0, "end_lr": 1e-5}},
            lambda o, lr, w, s: __import__("open_clip_train.scheduler").scheduler.const_lr_cooldown(
                o, lr, w, s, 25, cooldown_power=2.0, cooldown_end_lr=1e-5
            ),
        ),
    ],
)
def test_lr_at_every_step_equals_open_clip_trains_scheduler(schedule, extra, open_clip_schedule):
    optim = _optim(schedule=schedule, lr=5e-4, warmup_steps=10, max_steps=100, **extra)
    model = torch.nn.Linear(3, 2)
    optimizer, scheduler = build_optimizer(model, optim)
    theirs_optimizer = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=1.0)
    adjust = open_clip_schedule(theirs_optimizer, optim.lr, optim.warmup_steps, optim.max_steps)
    for step in range(optim.max_steps):
        used = [group["lr"] for group in optimizer.param_groups]  # what optimizer step `step` uses
        assert used == pytest.approx([adjust(step)] * len(used), rel=1e-12, abs=1e-15), step
        optimizer.step()
        scheduler.step()


def _trainable(model) -> set[str]:
    return {name for name, param in model.named_parameters() if param.requires_grad}


@pytest.mark.parametrize("model_name", ["clipdist-tiny", "clipdist-timm-tiny"])
@pytest.mark.parametrize(
    "lock",
    [
        {"lock_image": True},
        {"lock_image": True, "lock_image_unlocked_groups": 2},
        {"lock_text": True},
        {"lock_text": True, "lock_text_unlocked_layers": 1},
        {"lock_image": True, "lock_image_unlocked_groups": 1, "lock_text": True, "lock_text_unlocked_layers": 2},
    ],
)
def test_locked_towers_train_what_open_clips_lock_functions_leave_trainable(model_name, lock):
    model_cfg = _model_cfg(name=model_name, **lock)
    ours = create_model(model_name)
    lock_towers(ours, model_cfg)
    optimizer, _ = build_optimizer(ours, _optim())
    in_optimizer = {id(param) for group in optimizer.param_groups for param in group["params"]}
    names = {name for name, param in ours.named_parameters() if id(param) in in_optimizer}

    theirs = open_clip.create_model(model_name)  # as open_clip_train's main.py locks
    if model_cfg.lock_image:
        theirs.lock_image_tower(unlocked_groups=model_cfg.lock_image_unlocked_groups, freeze_bn_stats=False)
    if model_cfg.lock_text:
        theirs.lock_text_tower(unlocked_layers=model_cfg.lock_text_unlocked_layers, freeze_layer_norm=True)
    assert names == _trainable(theirs) == _trainable(ours)
    assert len(names) < len(list(ours.parameters()))


def test_a_locked_image_tower_gets_no_gradient_and_no_update(tmp_path):
    torch.manual_seed(0)
    model = create_model("clipdist-tiny")
    lock_towers(model, _model_cfg(lock_image=True))
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer, scheduler = build_optimizer(model, _optim())
    from clipdist.losses import build
    from clipdist.model.factory import random_tokens

    step = build_step(model, build("disco"), optimizer, scheduler, chunks=2)
    step(Batch.of(torch.randn(4, 3, 32, 32), random_tokens(4, model.context_length)))
    for name, param in model.named_parameters():
        if name.startswith("visual."):
            assert param.grad is None and torch.equal(param, before[name]), name
        elif name != "logit_scale":
            assert not torch.equal(param, before[name]), name


def test_optimizer_names_go_to_timms_factory_with_the_options_they_take():
    from timm.optim import Lion

    model = torch.nn.Linear(3, 2)
    lion, _ = build_optimizer(model, _optim(name="timm/lion", betas=[0.95, 0.98], eps=1e-6))  # eps: Lion has none
    assert isinstance(lion, Lion) and lion.defaults["betas"] == (0.95, 0.98)
    sgd, _ = build_optimizer(model, _optim(name="sgd", momentum=0.5, kwargs={"nesterov": False}))
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.5 and not sgd.defaults["nesterov"]
    adamw, _ = build_optimizer(model, _optim())
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["betas"] == (0.9, 0.98)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"name": "adamq"}, "optim.name=adamq: no such optimizer; adamw (torch's) or one of timm's: "),
        ({"name": "lion", "kwargs": {"bogus": 1}}, "optim.name=lion with {'bogus': 1}:"),
        ({"image_layer_decay": 1.5}, "optim.image_layer_decay=1.5: must be in (0, 1]"),
    ],
)
def test_optimizer_settings_that_cannot_run_are_refused_before_any_rank(values, message):
    with pytest.raises(ValueError) as raised:
        check_optim(_optim(**values))
    assert message in str(raised.value)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"schedule": "const_cooldown"}, "optim.schedule=const_cooldown needs optim.const_cooldown.steps"),
        ({"schedule": "const_cooldown", "const_cooldown": {"steps": 580}}, "steps after warmup: 550 (optim"),
        ({"schedule": "cosine", "const_cooldown": {"power": 2.0}}, "optim.const_cooldown.power is for optim.sch"),
        ({"schedule": "cosin"}, "optim.schedule=cosin: no such schedule; choose one of cosine, const, const_cooldown"),
    ],
)
def test_a_schedule_that_cannot_run_or_an_option_of_another_schedule_is_refused(values, message):
    with pytest.raises(ConfigError) as raised:
        check_schedule(_optim(**values))
    assert message in str(raised.value)


def _open_clip_trains_decay_rule():
    """open_clip_train's own rule for which parameters get no weight decay, read from the installed program's
    source (main.py builds its groups inline, so there is no function to import)."""
    import inspect

    import open_clip_train.main

    line = next(line for line in inspect.getsource(open_clip_train.main).splitlines() if "exclude = lambda" in line)
    return eval(line.split("=", 1)[1].strip())  # noqa: S307 -- the installed peer's source, a one-line lambda


@pytest.mark.parametrize("model_name", ["ViT-B-32", "RN50", "coca_ViT-B-32", "clipdist-tiny"])
def test_weight_decay_groups_are_open_clip_trains_by_default(model_name):
    """The default optim.no_decay leaves undecayed exactly what open_clip_train leaves undecayed (positional
    embeddings are decayed there, so here too)."""
    exclude = _open_clip_trains_decay_rule()
    model = create_model(model_name, device="meta")
    optimizer, _ = build_optimizer(model, _optim())
    decayed = {id(param) for group in optimizer.param_groups if group["weight_decay"] > 0 for param in group["params"]}
    theirs = {name for name, param in model.named_parameters() if param.requires_grad and not exclude(name, param)}
    ours = {name for name, param in model.named_parameters() if id(param) in decayed}
    assert ours == theirs
    assert model_name == "RN50" or any("positional_embedding" in name for name in ours)


@pytest.mark.parametrize("model_name", ["ViT-B-32", "clipdist-tiny"])
def test_a_timm_optimizers_decay_groups_are_timms_as_open_clip_train_hands_it_the_model(model_name):
    """open_clip_train --opt timm/lion gives timm the model: timm leaves undecayed 1-d tensors, biases and what
    model.no_weight_decay() names (the positional embeddings); so do we, and AdamW keeps open_clip_train's rule."""
    from timm.optim import param_groups_weight_decay

    model = create_model(model_name, device="meta")
    nowd = model.no_weight_decay()
    theirs = {
        id(param)
        for group in param_groups_weight_decay(model, 0.1, no_weight_decay_list=nowd)
        if group["weight_decay"] > 0
        for param in group["params"]
    }
    optimizer, _ = build_optimizer(model, _optim(name="lion"))
    ours = {id(param) for group in optimizer.param_groups if group["weight_decay"] > 0 for param in group["params"]}
    names = {id(param): name for name, param in model.named_parameters()}
    assert {names[i] for i in ours} == {names[i] for i in theirs}
    assert not any("positional_embedding" in names[i] for i in ours)


def test_layer_decay_scales_each_tower_by_depth():
    model = create_model("clipdist-tiny")
    depth = len(model.visual.transformer.resblocks)
    scales = layer_scales(model, {"image": 0.5, "text": None})
    assert scales["visual.conv1.weight"] == 0.5 ** (depth + 1)  # embeddings: layer 0
    assert scales[f"visual.transformer.resblocks.{depth - 1}.mlp.c_fc.weight"] == 0.5  # last block: layer L
    assert scales["visual.proj"] == 1.0 and scales["logit_scale"] == 1.0  # after the blocks: layer L + 1
    assert all(scale == 1.0 for name, scale in scales.items() if not name.startswith("visual."))
    optimizer, _ = build_optimizer(model, _optim(image_layer_decay=0.5, lr=1e-3))
    lrs = {id(param): group["initial_lr"] for group in optimizer.param_groups for param in group["params"]}
    assert lrs[id(model.visual.conv1.weight)] == pytest.approx(1e-3 * 0.5 ** (depth + 1))


def _data(**augmentation) -> DataConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), {"augmentation": augmentation}))


@pytest.mark.parametrize("interpolation", [None, "bilinear"])
@pytest.mark.parametrize(
    "augmentation",
    [
        {},
        {"scale": [0.4, 1.0]},
        {"use_timm": True, "scale": [0.4, 1.0], "ratio": [0.5, 2.0]},
        {"color_jitter": [0.4, 0.4, 0.4, 0.1], "color_jitter_prob": 0.8, "gray_scale_prob": 0.2},
        {"use_timm": True, "scale": [0.5, 1.0], "color_jitter": [0.4], "re_prob": 0.5, "re_count": 2},
    ],
)
def test_train_transform_equals_open_clips_for_the_same_aug_config_and_seed(augmentation, interpolation):
    theirs_aug = {
        key: tuple(value)
        if isinstance(value, list) and len(value) > 1
        else value[0]
        if isinstance(value, list)
        else value
        for key, value in augmentation.items()
    }
    _, theirs, _ = open_clip.create_model_and_transforms(
        "clipdist-tiny", aug_cfg=theirs_aug, image_interpolation=interpolation
    )
    model = create_model("clipdist-tiny", overrides=model_overrides(_model_cfg(image_interpolation=interpolation)))
    ours, _ = image_transforms(model, _data(**augmentation))
    pixels = torch.Generator().manual_seed(1)
    image = Image.fromarray(torch.randint(0, 256, (64, 96, 3), generator=pixels, dtype=torch.uint8).numpy())
    for seed in range(4):
        outputs = []
        for transform in (ours, theirs):
            torch.manual_seed(seed)
            random.seed(seed)
            outputs.append(transform(image))
        assert torch.equal(*outputs), seed


@pytest.mark.parametrize(
    "augmentation, message",
    [
        ({"color_jitter": [0.4, 0.4, 0.4]}, "data.augmentation.color_jitter: open_clip's own pipeline does not use it"),
        ({"ratio": [0.5, 2.0]}, "data.augmentation.ratio: open_clip's own pipeline does not use it"),
        ({"color_jitter": [0.4], "color_jitter_prob": 0.5}, "color_jitter_prob needs color_jitter as four values"),
    ],
)
def test_an_augmentation_open_clip_would_ignore_or_crash_on_is_refused(augmentation, message):
    with pytest.raises(ValueError, match=message):
        augmentation_cfg(_data(**augmentation))


@pytest.mark.parametrize(
    "overrides",
    [
        {"force_image_size": 48},
        {"force_context_length": 32},
        {"force_patch_dropout": 0.5},
        {"force_patch_dropout": 0.0},
        {"force_quick_gelu": True},
        {"force_custom_text": True},
    ],
)
def test_model_overrides_build_what_open_clip_builds(tmp_path, overrides):
    torch.manual_seed(0)
    ours = create_model("clipdist-tiny", overrides=model_overrides(_model_cfg(**overrides)))
    torch.manual_seed(0)
    theirs = open_clip.create_model("clipdist-tiny", **overrides)
    assert type(ours) is type(theirs)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    assert repr(ours) == repr(theirs)  # activations, patch dropout: the modules as open_clip builds them
    path = tmp_path / "built.json"  # the config an export carries builds the same model with no overrides
    path.write_text(json.dumps(built_model_config("clipdist-tiny", model_overrides(_model_cfg(**overrides)))))
    rebuilt = create_model(str(path))
    assert type(rebuilt) is type(theirs) and repr(rebuilt) == repr(theirs)


@pytest.mark.parametrize(
    "overrides",
    [
        {"force_image_size": 48},
        {"force_context_length": 12},
        {"force_custom_text": True},
        {"force_image_size": 16, "force_context_length": 20, "force_custom_text": True},
    ],
)
def test_starting_weights_load_into_forced_sizes_as_open_clip_loads_them(tmp_path, overrides):
    """A file's weights into a model with another image grid, context length or text tower layout: position
    embeddings resized and keys moved by open_clip's own functions, as its load_checkpoint does (refused before)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    save_file(create_model("clipdist-tiny").state_dict(), tmp_path / "open_clip_model.safetensors")
    (tmp_path / "open_clip_config.json").write_text(json.dumps({"model_cfg": built_model_config("clipdist-tiny")}))
    ours = create_model(f"local-dir:{tmp_path}", overrides=model_overrides(_model_cfg(**overrides))).state_dict()
    theirs = open_clip.create_model(f"local-dir:{tmp_path}", **overrides).state_dict()
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)


@pytest.mark.parametrize("layout", ["model_cfg", "hub"])
def test_a_model_config_file_carrying_preprocess_cfg_builds_with_that_preprocessing(tmp_path, layout):
    config = dict(open_clip.get_model_config("clipdist-tiny"))
    preprocess = {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25], "interpolation": "bilinear"}
    content = (
        {**config, "preprocess_cfg": preprocess}
        if layout == "model_cfg"
        else {"model_cfg": config, "preprocess_cfg": preprocess}
    )
    path = tmp_path / f"my-tiny-{layout}.json"
    path.write_text(json.dumps(content))
    model = create_model(str(path))
    assert tuple(model.visual.preprocess_cfg["mean"]) == (0.5, 0.5, 0.5)
    assert model.visual.preprocess_cfg["interpolation"] == "bilinear"
    forced = create_model(str(path), overrides=model_overrides(_model_cfg(image_mean=[0.1, 0.2, 0.3])))
    assert tuple(forced.visual.preprocess_cfg["mean"]) == (0.1, 0.2, 0.3)  # the run's setting wins


def _tiny_step(precision: str, chunks: int = 1):
    from clipdist.losses import build
    from clipdist.model.precision import autocast

    torch.manual_seed(0)
    model = create_model("clipdist-tiny")
    optimizer, scheduler = build_optimizer(model, _optim(warmup_steps=1, lr=2e-4))
    device = torch.device("cpu")
    scaler = gradient_scaler(precision, device)
    step = build_step(
        model, build("disco"), optimizer, scheduler, chunks=chunks, scaler=scaler, autocast=autocast(precision, device)
    )
    return model, step, scaler, scheduler


@pytest.mark.parametrize("chunks", [1, 2])
def test_an_fp16_overflow_skips_the_update_halves_the_scale_and_still_counts_the_step(chunks):
    from clipdist.model.factory import random_tokens

    model, step, scaler, scheduler = _tiny_step("fp16", chunks)
    images, tokens = torch.randn(4, 3, 32, 32), random_tokens(4, model.context_length)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    poison = model.text_projection.register_hook(lambda grad: torch.full_like(grad, math.inf))
    agreed, grad_norm = step(Batch.of(images, tokens))
    poison.remove()
    assert step.overflowed and not math.isfinite(grad_norm) and math.isfinite(agreed.loss)
    assert all(torch.equal(param, before[name]) for name, param in model.named_parameters())
    assert scaler.get_scale() == 2.0**15 and scheduler.last_epoch == 1  # the schedule advanced
    step(Batch.of(images, tokens))
    assert not step.overflowed
    assert not torch.equal(model.text_projection, before["text_projection"])


def test_fp16_steps_follow_fp32_steps():
    """Scaling by a power of two is exact: fp16 autocast + scaler and fp32 take nearly the same first steps."""
    from clipdist.model.factory import random_tokens

    images, tokens = torch.randn(8, 3, 32, 32), random_tokens(8, 16, torch.Generator().manual_seed(0))
    losses = {}
    for precision in ("fp32", "fp16"):
        _, step, _, _ = _tiny_step(precision)
        losses[precision] = [step(Batch.of(images, tokens))[0].loss for _ in range(4)]
    assert losses["fp16"] == pytest.approx(losses["fp32"], rel=2e-2)
    assert losses["fp16"] != losses["fp32"]  # it did compute in fp16


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.pretrained_image=true"], "model.pretrained_image=true starts a timm image tower"),
        (["loss.caption_weight=1.0"], "loss.caption_weight=1.0, but model.name=clipdist-tiny has no text decoder"),
        (["model.name=RN50", "world.sync_batchnorm=true", "world.device=cpu"], "SyncBatchNorm runs on CUDA ranks only"),
        (
            ["model.lock_text=true", "model.lock_text_freeze_layer_norm=false"],
            "model.lock_text_freeze_layer_norm=false",
        ),
        (["model.force_patch_dropout=1.5"], "model.force_patch_dropout=1.5: must be in [0, 1)"),
        (["optim.name=adamq"], "optim.name=adamq: no such optimizer"),
        (["optim.schedule=const_cooldown"], "optim.schedule=const_cooldown needs optim.const_cooldown.steps"),
        (["data.augmentation.re_prob=0.5"], "data.augmentation.re_prob: open_clip's own pipeline does not use it"),
    ],
)
def test_recipe_settings_that_cannot_run_are_one_line_before_any_rank(
    tmp_path, capsys, monkeypatch, overrides, message
):
    from tests.helpers import refusal

    code, lines = refusal(capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", *overrides)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_a_resume_that_changes_the_structure_is_refused_and_one_that_changes_numerics_is_warned(tmp_path):
    from clipdist.checkpoint.manager import _compare
    from clipdist.config import as_dict
    from clipdist.errors import ConfigError

    saved_cfg = to_train_config({"name": "x"})
    saved = {"config": as_dict(saved_cfg), "world_size": 1, "step": 10}
    for change in ({"model": {"lock_image": True}}, {"optim": {"name": "lion"}}, {"model": {"force_image_size": 64}}):
        with pytest.raises(ConfigError, match="was trained with"):
            _compare(saved, as_dict(to_train_config({"name": "x", **change})), 1, tmp_path / "step_00000010.dcp")
    (warning,) = _compare(
        saved,
        as_dict(to_train_config({"name": "x", "precision": "fp16", "model": {"force_patch_dropout": 0.0}})),
        1,
        tmp_path / "step_00000010.dcp",
    )
    assert "precision auto -> fp16" in warning and "model.force_patch_dropout None -> 0.0" in warning
    old = {**saved, "config": {k: v for k, v in as_dict(saved_cfg).items() if k != "optim"}}  # before these keys
    assert _compare(old, as_dict(saved_cfg), 1, tmp_path / "step_00000010.dcp") == []


def test_force_patch_dropout_zero_switches_off_a_configs_patch_dropout(tmp_path):
    """FLIP's last steps: model.force_patch_dropout=0 on a model whose config drops patches."""
    config = dict(open_clip.get_model_config("clipdist-tiny"))
    config["vision_cfg"] = {**config["vision_cfg"], "patch_dropout": 0.5}
    path = tmp_path / "tiny-flip.json"
    path.write_text(json.dumps(config))
    assert type(create_model(str(path)).visual.patch_dropout).__name__ == "PatchDropout"
    off = create_model(str(path), overrides=model_overrides(_model_cfg(force_patch_dropout=0.0)))
    assert isinstance(off.visual.patch_dropout, torch.nn.Identity)
