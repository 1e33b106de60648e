"""The recipe said back: one-line warnings for settings that run but do not do what they seem to."""

from __future__ import annotations

from clipdist.config import to_train_config
from clipdist.data.sources import Shards
from clipdist.data.tables import table_parts
from clipdist.registry.kinds import TableOptions
from clipdist.train.recipe import table_rows, traps


def config(**sections):
    return to_train_config({"name": "x", **sections})


def test_a_warmup_as_long_as_the_run_is_warned():
    shards = Shards([["a.tar"]])
    assert traps(config(optim={"max_steps": 600, "warmup_steps": 50}), shards) == []
    (warning,) = traps(config(optim={"max_steps": 40, "warmup_steps": 50}), shards)
    assert warning.startswith("optim.warmup_steps=50 is not below optim.max_steps=40: the lr never reaches")


def test_a_global_batch_larger_than_the_table_is_warned(tmp_path):
    table = tmp_path / "pairs.tsv"
    table.write_text("filepath\ttitle\n" + "".join(f"{index}.png\tcaption {index}\n" for index in range(216)))
    shards = Shards([table_parts(str(table), TableOptions(rows_per_part=100), "data.train_shards")])
    assert table_rows(shards) == 216 and len(shards.train) == 3
    (warning,) = traps(config(world={"batch_per_device": 256}), shards)
    assert warning.startswith("the global batch 256 is larger than the 216 rows of data.train_shards")
    assert traps(config(world={"batch_per_device": 216}), shards) == []
    assert table_rows(Shards([["a.tar"]])) is None  # a tar shard's size is not known before reading it


def test_half_precision_on_a_cpu_rank_is_warned(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    shards = Shards([["a.tar"]])
    for precision in ("bf16", "fp16", "pure_bf16"):
        (warning,) = traps(config(precision=precision), shards)
        assert warning.startswith(f"precision={precision} on a CPU rank:") and "use precision=fp32" in warning
    assert traps(config(precision="fp32"), shards) == []
    assert traps(config(precision="bf16", world={"device": "cuda"}), shards) == []  # a GPU rank: what it is for


def test_a_compile_mode_with_compile_off_is_warned():
    shards = Shards([["a.tar"]])
    (warning,) = traps(config(model={"compile": False, "compile_mode": "reduce_overhead"}), shards)
    assert warning == "model.compile_mode=reduce_overhead with model.compile=false: nothing is compiled"
    for compile in (None, True):  # automatic or on: the mode is used where it compiles
        assert traps(config(model={"compile": compile, "compile_mode": "reduce_overhead"}), shards) == []


def test_fsdp2s_reshard_setting_under_ddp_is_warned():
    shards = Shards([["a.tar"]])
    (warning,) = traps(config(world={"reshard_after_forward": False}), shards)
    assert warning.startswith("world.reshard_after_forward=false with world.parallel=ddp: it is FSDP2's setting")
    assert traps(config(world={"reshard_after_forward": False, "parallel": "fsdp"}), shards) == []


def test_a_global_batch_of_one_pair_under_a_softmax_loss_is_warned():
    """CLIP's softmax over one pair is log 1 = 0 for any weights: the run trained nothing (its loss read -0.000)."""
    shards = Shards([["a.tar"]])
    for loss in ("disco", "tiled", "naive"):
        (warning,) = traps(config(loss={"name": loss}, world={"batch_per_device": 1}), shards)
        assert warning.startswith(f"a global batch of 1 with loss={loss}: CLIP's softmax over one pair is log 1 = 0")
    # the sigmoid loss of one positive pair still trains; two pairs make a softmax
    assert traps(config(loss={"name": "siglip"}, world={"batch_per_device": 1}), shards) == []
    assert traps(config(world={"batch_per_device": 2}), shards) == []


def test_the_teacher_terms_on_a_naflex_tower_are_said_to_be_an_extension():
    """SigLIP 2 trains its NaFlex variant with the sigmoid loss and the decoder alone (recipe=siglip2_naflex): the
    teacher terms on a NaFlex tower run, and a line says they are ours, not the paper's."""
    shards = Shards([["a.tar"]])
    teacher = {"self_distill": {"crops": 8}, "masked": {"ratio": 0.5}}
    (warning,) = traps(
        config(model={"name": "clipdist-naflex-tiny"}, loss=teacher, optim={"ema": {"decay": 0.9}}), shards
    )
    assert warning.startswith("loss.self_distill and loss.masked on a NaFlex tower: an extension, not SigLIP 2's")
    assert traps(config(model={"name": "clipdist-naflex-tiny"}, loss={"decoder": {"layers": 1}}), shards) == []
    assert traps(config(loss=teacher, optim={"ema": {"decay": 0.9}}), shards) == []  # a fixed-size tower: the paper's


def test_the_banner_says_the_compile_mode_and_what_was_removed_from_the_cache(monkeypatch):
    """train.startup.compile_lines: whether and why it compiles, in which mode, where its caches are, and the unsigned
    files admitting the cache removed (a warning)."""
    import logging
    from types import SimpleNamespace

    import torch

    from clipdist.train.startup import compile_lines

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/runs/x/compile_cache")
    cfg = config(model={"compile": True, "compile_mode": "reduce_overhead"})
    trainer = SimpleNamespace(cfg=cfg, compiled=(True, "model.compile=true"), device=torch.device("cpu"))
    trainer.cache_admitted = "compile cache: 3 file(s) not signed by this user's clipdist removed"
    assert compile_lines(trainer) == [
        (
            "torch.compile on (model.compile=true, model.compile_mode=reduce_overhead); its caches in "
            "/runs/x/compile_cache",
            logging.INFO,
        ),
        (trainer.cache_admitted, logging.WARNING),
    ]
    trainer.cfg, trainer.compiled, trainer.cache_admitted = config(), (False, "model.compile=auto: off on a CPU"), None
    assert compile_lines(trainer) == []  # decided off on a CPU: nothing to say
