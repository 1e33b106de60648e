"""The config owns validation: typed choices and every check before any rank starts, one line each."""

from __future__ import annotations

import time

import pytest
from helpers import refusal, train
from omegaconf import OmegaConf, open_dict

from clipdist.config import LOSS_SCHEMAS, ConfigError, TrainConfig, to_train_config, validate
from clipdist.preflight import check_config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["world=cpu2", "precision=fp8"],
            "Invalid value 'fp8', expected one of [auto, fp32, bf16, fp16, pure_bf16, pure_fp16, amp",
        ),
        (["world=cpu2", "world.device=tpu"], "Invalid value 'tpu', expected one of [auto, cpu, cuda]"),
        (["world=cpu2", "logging.wandb=foo"], "Invalid value 'foo', expected one of [offline, online, disabled]"),
        (["world=cpu2", "data.split=bar"], "Invalid value 'bar', expected one of [node, replicated]"),
        (["world=cpu2", "world.backend=mpi"], "Invalid value 'mpi', expected one of [auto, gloo, nccl]"),
    ],
)
def test_a_misspelt_key_or_choice_is_refused_when_the_config_is_composed(
    tmp_path, capsys, monkeypatch, overrides, message
):
    code, lines = refusal(capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", *overrides)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines  # one line, before Hydra composes
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.max_steps=0"], "optim.max_steps=0: must be at least 1"),
        (["world.batch_per_device=0"], "world.batch_per_device=0: must be at least 1"),
        (["optim.eps=0"], "optim.eps=0.0: must be above 0"),  # Adam's 0/0 where no gradient reached: nan weights
        # a setting the chosen path never reads: a locked tower's option with the tower unlocked, an optimizer's
        # momentum or eps where it takes none (create_optimizer passed only what it takes)
        (["model.lock_image_unlocked_groups=2"], "model.lock_image_unlocked_groups=2 does nothing without model.lock_"),
        (["model.lock_text_freeze_layer_norm=false"], "model.lock_text_freeze_layer_norm=false does nothing without"),
        (["optim.momentum=0.9"], "optim.momentum=0.9: optim.name=adamw takes no momentum; drop it"),
        (["optim.name=lion", "optim.eps=1e-8"], "optim.eps=1e-08: optim.name=lion takes no eps; drop it"),
        # a normalisation that divides by 0, a first logit scale exp(1000) = inf (clamped only after the step)
        (["model.image_std=[0,0,0]"], "model.image_std=[0.0, 0.0, 0.0]: every std must be above 0"),
        (["model.image_mean=[0.5,0.5]"], "model.image_mean=[0.5, 0.5]: give one value per RGB channel"),
        (["loss.init_logit_scale=1000"], "loss.init_logit_scale=1000: the log of the scale, which training holds in"),
        # a crop no box fits (torchvision falls back to a centre crop) or a reversed range (it only warns)
        (["data.augmentation.scale=[0,0]"], "data.augmentation.scale=[0.0, 0.0]: give [low, high] with 0 < low"),
        (["data.augmentation.scale=[0.9,0.1]"], "data.augmentation.scale=[0.9, 0.1]: give [low, high]"),
        (["data.augmentation.gray_scale_prob=2"], "data.augmentation.gray_scale_prob=2.0: a probability, from 0 to 1"),
        # shards given without data=webdataset: the default data=digits would train, the shards never read
        (["data.train_shards=/data/x.tar"], "data.train_shards is given, but data.source=digits makes the training"),
        # raw files for a source that reads none: the digits would train, the folder never read
        (["data.source_dir=/data/mnist"], "data.source_dir=/data/mnist is where fashion_mnist's raw files are, but"),
        # an unbounded number, alone or in a list, is finite: nan in a logit bias or a beta trains on nothing
        (["loss=siglip", "loss.init_logit_bias=nan"], "loss.init_logit_bias=nan: must be finite"),
        (["optim.betas=[0.9,inf]"], "optim.betas=[0.9, inf]: must be finite"),
        (["loss.name=nope"], "unknown loss backend 'nope'"),
        (
            ["grad_cache.chunks=100", "world.batch_per_device=8"],
            "grad_cache.chunks=100 is more than world.batch_per_device=8",
        ),
        (["grad_cache.chunks=2", "grad_cache.micro_batch=4"], "give one of them"),
        (["data.pieces=3", "world.batch_per_device=8"], "data.pieces=3 does not divide world.batch_per_device=8"),
        (["data.pieces=0"], "data.pieces=0: must be at least 1"),
        (["world=cpu2", "world.device=cuda"], "world.device=cuda (world=cpu2) but no CUDA device is visible"),
        (
            ["world=8gpu", "world.device=cpu", "world.backend=gloo"],
            "expects 8 processes (1 node(s) × 8) but this process was started alone. "
            "Launch it with `torchrun --nproc-per-node 8",
        ),
        (
            ["world=64gpu", "world.device=cpu", "world.backend=gloo"],
            "Launch it with `torchrun --nnodes 8 --nproc-per-node 8 "
            "--rdzv-backend c10d --rdzv-endpoint <first node>:29500 "
            "train.py world=64gpu` on every node",
        ),
        (["world=cpu2", "data.readers=3"], "data.readers=3 is not a multiple of the world size 2"),
        (["data.readers=0"], "data.readers=0: must be at least 1"),
        (["data.readers=64", "world.batch_per_device=32"], "64 reader(s) cannot share a cycle of 32 sample(s)"),
        (["data=webdataset", "data.train_shards='{tmp}/nope/{{000..003}}.tar'"], "4 of 4 shards not found"),
        (["world=cpu2", "resume=/nope.pt"], "resume='/nope.pt': no such checkpoint file"),
        (["data.weights=[1,2]"], "data.weights needs data.resampled=true"),
        (["data.weights=[1,2]", "data.resampled=true"], "data.weights has 2 weight(s) for 1 source(s)"),
        (["checkpoint_every_minutes=0"], "checkpoint_every_minutes=0.0: must be above 0"),
        (["recipe=siglip2", "loss.masked.head_lr=-1"], "loss.masked.head_lr=-1.0: must be above 0"),
        # nan passes every comparison with a bound; inf is no rate: both refused where every bound is checked
        (["recipe=siglip2", "loss.self_distill.head_lr=nan"], "head_lr=nan: must be a finite number, above 0"),
        (["optim.weight_decay=inf"], "optim.weight_decay=inf: must be a finite number, 0 or more"),
        (["optim.ema.decay=nan"], "optim.ema.decay=nan: must be a finite number, 0 or more"),
        # every generator a seed reaches takes 32 bits (NumPy's): a rank would have failed at its start
        (["seed=-1"], "seed=-1: must be from 0 to 4294967295"),
        (["seed=4294967296"], "seed=4294967296: must be from 0 to 4294967295"),
        # a batch no host holds: refused before the loader's workers decode it (they took minutes, then ran out)
        (["world.batch_per_device=1000000000"], "world.batch_per_device=1000000000 with data.workers=2: this node's"),
        (["world=cpu2", "model.name=ViT-Nope"], "unknown model 'ViT-Nope'"),
        (["model.name=clipdist-maphead-tiny"], "loss=disco: model clipdist-maphead-tiny has a logit bias"),
        (  # SigLIP 2's own architecture: its Gemma tokenizer comes from the hub, and this test's cache is empty
            ["model=siglip2_b16", "loss=siglip", "model.cache_dir={tmp}/hub"],
            "model.name=ViT-B-16-SigLIP2-256: its tokenizer (timm/ViT-B-16-SigLIP2-256) is not in the cache",
        ),
        (["model.name=/nope/my-vit.json"], "model.name='/nope/my-vit.json': no such model config file"),
        (  # NaFlex views larger than any image of the batches (the tower's 8 × 8 grid at 128 px)
            ["model=naflex_tiny", "loss=siglip", "optim.ema.decay=0.9", "loss.self_distill.crops=2"]
            + ["loss.self_distill.crop_size=144"],
            "crop_size=144: local views of 81 patches, more than the longest image's 64 (data.seq_lens); give at most",
        ),
        # a run directory that is no folder of the run's own: the working directory, the folder of every run, above it
        (["run_dir="], "run_dir='' (name="),
        (["run_dir={tmp}/runs/${name}", "name=.."], "runs/..' (name='..') is "),
        (["run_dir={tmp}/runs/${oc.select:name}", "name=."], "runs/.' (name='.') is "),  # name by another spelling
        (["run_dir={tmp}/.."], "run_dir='"),
        (["+optim.lrr=1"], "optim.lrr: no such key; did you mean optim.lr?"),  # `+` adds what the schema would drop
        (["+data.csv=x"], "data.csv: no such key (python train.py --cfg job lists every key)"),
        (["loss=tiled", "+loss.tyle=4"], "loss.tyle: no such key; did you mean loss.tile?"),
        # another backend's option, however it comes: Hydra's "not in LossConfig" (and its `+` advice) said as it is
        (["loss.tile=3"], "loss.tile: an option of loss=tiled, loss=siglip, not of the loss chosen; choose one"),
        (["loss=naive", "+loss.tile=3"], "loss.tile: an option of loss=tiled, loss=siglip, not of the loss chosen"),
        (["loss=disco", "++loss.tile=3"], "loss.tile: an option of loss=tiled, loss=siglip, not of the loss chosen"),
        (["model.name=${oc.env:CLIPDIST_UNSET_VARIABLE}"], "${oc.env:...}: clipdist configs do not read"),
        (["optim.lr=${no.such.key}"], "optim.lr: Interpolation key 'no.such.key' not found"),
        # the optimizer's own checks, whatever they raise, at its construction or its first step on a stand-in
        (["optim.betas=[0.9]"], "optim.betas=[0.9]: optim.name=adamw takes 2 betas; give 2, or optim.betas=null"),
        (["optim.name=adan"], "optim.betas=[0.9, 0.98]: optim.name=adan takes 3 betas"),  # the preset's two
        (["optim.name=adahessian"], "optim.name=adahessian is a second-order optimizer"),
        (["optim.name=fusedadam", "world.device=cpu"], "optim.name=fusedadam with these options: CUDA required"),
        (["optim.name=sgd", "+optim.kwargs.dampening=0.5"], "optim.name=sgd with {'dampening': 0.5}: Nesterov"),
    ],
)
def test_config_errors_are_one_line_before_the_ranks(tmp_path, cache_dir, capsys, monkeypatch, overrides, message):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # no row may reach the network
    monkeypatch.chdir(tmp_path)  # a refusal missed would write here (run_dir=), not into the checkout
    overrides = [override.replace("{tmp}", str(tmp_path)) for override in overrides]
    code, lines = refusal(capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}", *overrides)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "run").exists()  # refused before the run began: nothing left behind


def test_the_hosts_memory_bounds_what_its_loaders_hold_at_once(monkeypatch):
    """Every local rank's batch, and what each of its workers reads ahead (two batches, or two in data.pieces), as
    the loader hands them over (3,200 bytes a clipdist-tiny sample), and the workers themselves (16 MiB each at the
    least), within the machine's free memory."""
    from types import SimpleNamespace

    from clipdist.config import TrainConfig
    from clipdist.data.workers import LoaderPlan
    from clipdist.model.factory import create_model
    from clipdist.preflight.data import check_host_memory

    monkeypatch.setattr("psutil.virtual_memory", lambda: SimpleNamespace(available=2**30))
    tower, plan, cfg = create_model("clipdist-tiny", device="meta"), LoaderPlan(2, 2, ""), TrainConfig(name="x")
    cfg.world.batch_per_device, cfg.world.procs_per_node = 20000, 2
    check_host_memory(cfg, tower, plan)  # 2 ranks × 20,000 × 3,200 bytes × (1 + 2·2): 0.6 GiB
    cfg.world.batch_per_device = 40000  # 1.2 GiB
    with pytest.raises(
        ConfigError,
        match=r"need 1\.3 GiB, .* 1\.0 GiB free\. Inputs held at once: 1\.2 GiB \(2 rank\(s\) × 40000 samples × 3200 b",
    ):
        check_host_memory(cfg, tower, plan)
    cfg.data.pieces = 4  # each worker reads ahead two quarters of a batch: × 2, 0.5 GiB
    check_host_memory(cfg, tower, plan)
    cfg.world.procs_per_node = 5  # 1.2 GiB
    with pytest.raises(ConfigError, match=r"data.pieces=4 piece\(s\) a batch\); worker processes: 10 at 16 MiB"):
        check_host_memory(cfg, tower, plan)
    cfg.world.batch_per_device, cfg.world.procs_per_node = 1, 1
    with pytest.raises(ConfigError, match=r"data.workers=100: .*worker processes: 100 at 16 MiB or more each"):
        check_host_memory(cfg, tower, LoaderPlan(100, 100, ""))  # 1.6 GiB of processes


def test_a_world_that_does_not_match_the_launcher_is_refused(tmp_path, cache_dir, capsys, monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)  # torchrun started 3 processes
    code, lines = refusal(
        capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}", "world=cpu2"
    )
    assert code == 2 and "world=cpu2 expects 2 processes (1 node(s) × 2), but torchrun started 3" in lines[0], lines


@pytest.mark.parametrize(
    "launch",
    [
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"},  # torchrun --nnodes 2
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_LOCALID": "0",
            "SLURM_STEP_NUM_NODES": "2",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_JOB_ID": "7",
        },  # srun over 2 nodes, one task each
    ],
)
def test_a_world_whose_nodes_do_not_match_the_launch_is_refused(tmp_path, cache_dir, capsys, monkeypatch, launch):
    """The same process count on another node layout is refused too: 2 nodes × 1 is not world=cpu2's 1 × 2."""
    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    without_rendezvous(monkeypatch)
    code, lines = refusal(
        capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}", "world=cpu2"
    )
    assert code == 2 and len(lines) == 1, lines
    assert "world=cpu2 expects 1 node(s) × 2, but" in lines[0] and "started 2 node(s) × 1" in lines[0], lines
    assert "world.nodes=2 world.procs_per_node=1" in lines[0]


def without_rendezvous(monkeypatch) -> None:
    """No MASTER_ADDR / MASTER_PORT now, and none after the test: detect_env sets them under srun, and a
    leftover would follow later tests into their jobs (monkeypatch restores only what it set or deleted)."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.mark.parametrize("address", ["localhost", "127.0.0.1", "::1"])
def test_a_loopback_rendezvous_on_several_nodes_is_refused(tmp_path, cache_dir, capsys, monkeypatch, address):
    """An srun job over 2 nodes that inherited MASTER_ADDR=localhost would leave the second node's ranks waiting
    out the rendezvous timeout; it is one line instead."""
    for name, value in {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "gpu[1-2]",
        "SLURM_JOB_ID": "7",
    }.items():
        monkeypatch.setenv(name, value)
    without_rendezvous(monkeypatch)
    monkeypatch.setenv("MASTER_ADDR", address)
    code, lines = refusal(
        capsys,
        monkeypatch,
        f"run_dir={tmp_path / 'run'}",
        f"data.cache_dir={cache_dir}",
        "world=cpu2",
        "world.nodes=2",
        "world.procs_per_node=1",
    )
    assert code == 2 and len(lines) == 1, lines
    assert f"MASTER_ADDR={address} is set in the job's environment, but it reaches only one node" in lines[0]


@pytest.mark.parametrize(
    "overrides, code, message",
    [
        (
            ["precision=fp8"],
            2,
            "error: precision=fp8: Invalid value 'fp8', expected one of [auto, fp32, bf16, fp16",
        ),
        (["world.batch_per_device=0"], 2, "error: world.batch_per_device=0: must be at least 1"),
    ],
)
def test_train_py_refuses_spawned_ranks_before_they_start(tmp_path, overrides, code, message):
    """The same checks through the real entry point, under a world that spawns ranks: no rank, no traceback."""
    started = time.monotonic()
    result = train(tmp_path / "run", tmp_path / "cache", "world=cpu2", *overrides, timeout=60)
    assert result.returncode == code and message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
    assert time.monotonic() - started < 30


def test_a_model_config_file_is_a_model_name(tmp_path):
    import json

    from clipdist.model.factory import CONFIG_DIR, create_model, get_tokenizer

    config = json.loads((CONFIG_DIR / "clipdist-tiny.json").read_text())
    config["vision_cfg"]["patch_size"] = 4
    (tmp_path / "tiny-p4.json").write_text(json.dumps(config))
    model = create_model(str(tmp_path / "tiny-p4.json"))
    assert model.visual.conv1.kernel_size == (4, 4)
    assert get_tokenizer(str(tmp_path / "tiny-p4.json")).context_length == 16


def test_loss_options_are_typed_per_backend():
    cfg = to_train_config({"name": "x", "loss": {"name": "tiled", "tile": 16}})
    assert isinstance(cfg.loss, LOSS_SCHEMAS["tiled"]) and cfg.loss.options() == {"tile": 16}
    assert to_train_config({"name": "x"}).loss.options() == {}
    with pytest.raises(Exception, match="tile"):
        to_train_config({"name": "x", "loss": {"name": "tiled", "tile": "many"}})


def test_validate_names_the_key():
    cfg = TrainConfig(name="x")
    cfg.grad_cache.chunks = 0
    with pytest.raises(ConfigError, match=r"grad_cache.chunks=0: must be at least 1"):
        validate(cfg)
    cfg = TrainConfig(name="x")
    cfg.loss.name = "nope"
    validate(cfg)  # the schema's own checks pass; the backend's registry refuses the name
    with pytest.raises(ConfigError, match="unknown loss backend 'nope'"):
        check_config(cfg)


def test_micro_batch_sets_the_number_of_chunks():
    from clipdist.config import GradCacheConfig

    assert GradCacheConfig(micro_batch=3).chunks_for(8) == 3
    assert GradCacheConfig(micro_batch=8).chunks_for(8) == 1
    assert GradCacheConfig(chunks=4).chunks_for(8) == 4


@pytest.mark.parametrize(
    "key, message",
    [
        (
            None,
            "logging.wandb=online but no W&B API key is set (WANDB_API_KEY, or `wandb login`): log offline with "
            "logging.wandb=offline and upload later with `wandb sync",
        ),
        (
            "0123456789abcdef",
            "logging.wandb=online but http://127.0.0.1:{port} cannot be reached from here (Connection "
            "refused): log offline with logging.wandb=offline",
        ),
    ],
)
def test_wandb_online_without_a_key_or_a_server_is_one_line_before_the_ranks(
    tmp_path, cache_dir, capsys, monkeypatch, key, message
):
    from clipdist.distributed.launch import free_port

    port = free_port()  # nothing listens there
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no `wandb login` entry
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    if key:
        monkeypatch.setenv("WANDB_API_KEY", key)
    started = time.monotonic()
    code, lines = refusal(
        capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}", "logging=online"
    )
    assert code == 2 and len(lines) == 1 and message.format(port=port) in lines[0], lines
    assert time.monotonic() - started < 30 and not (tmp_path / "run").exists()


def test_the_loss_menu_offers_backends_only(tmp_path, capsys, monkeypatch):
    code, lines = refusal(capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", "loss=nope")
    assert code == 2 and lines == [
        "error: loss=nope: no such option; choose one of disco, gather_layer, naive, siglip, tiled"
    ]
    (tmp_path / "mine").mkdir()  # a user's config folder may add options: then Hydra's own menu says them
    code, lines = refusal(
        capsys, monkeypatch, "--config-dir", str(tmp_path / "mine"), f"run_dir={tmp_path / 'run'}", "loss=nope"
    )
    assert code == 2 and len(lines) == 1, lines
    assert "Available options in 'loss': disco, gather_layer, naive, siglip, tiled" in lines[0], lines


def test_another_backends_option_in_a_config_file_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    (tmp_path / "mine" / "loss").mkdir(parents=True)
    (tmp_path / "mine" / "loss" / "mine.yaml").write_text("defaults:\n  - disco\n  - _self_\ntile: 3\n")
    code, lines = refusal(
        capsys, monkeypatch, "--config-dir", str(tmp_path / "mine"), f"run_dir={tmp_path / 'run'}", "loss=mine"
    )
    assert code == 2 and lines == [
        "error: In 'loss/mine': loss.tile: an option of loss=tiled, loss=siglip, not of the loss chosen; choose one "
        "of those backends or leave the option out"
    ], lines


def test_open_clips_precision_names_are_read_as_ours():
    """open_clip_train's --precision amp / amp_bf16 / amp_bfloat16 mean our fp16 / bf16 (autocast)."""
    from clipdist.config import to_train_config

    for given, meant in (("amp", "fp16"), ("amp_bf16", "bf16"), ("amp_bfloat16", "bf16"), ("pure_bf16", "pure_bf16")):
        assert str(to_train_config({"name": "x", "precision": given}).precision) == meant


def test_an_unwritable_run_directory_is_one_line_before_hydra_makes_it(tmp_path, monkeypatch):
    import os

    from clipdist.cli.train import unwritable_run_dir

    assert unwritable_run_dir([f"run_dir={tmp_path / 'a' / 'b'}"]) is None
    (tmp_path / "file").write_text("")
    assert "is not a folder" in unwritable_run_dir([f"run_dir={tmp_path / 'file' / 'run'}"])
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(tmp_path) else real(path, mode))
    for given in (f"run_dir={tmp_path / 'run'}", f"run_dir={tmp_path}/${{name}}", f"+run_dir='{tmp_path}/x/y'"):
        problem = unwritable_run_dir(["loss=disco", given])
        assert problem and f"{tmp_path} cannot be written" in problem and "\n" not in problem, given


def test_a_misspelt_key_is_refused_at_once_with_the_nearest_key():
    from clipdist.config import unknown_override

    assert "did you mean optim.lr?" in unknown_override(["optim.lrr=1e-3"])
    assert "did you mean world.batch_per_device" in unknown_override(["loss=disco", "+world.batch_per_devce=4"])
    for fine in (
        ["optim.lr=1e-3", "loss=tiled", "loss.tile=64"],
        ["data.eval_sets.mine=/x"],
        ["hydra.job.name=x"],
        ["hydra/launcher=slurm", "~logging", "--cfg", "job", "+model.force_image_size=48"],
    ):
        assert unknown_override(fine) is None, fine
    assert "no such key" in unknown_override(["nonsense=1"])


def test_a_value_its_keys_type_refuses_is_one_line_before_hydra_composes(tmp_path, capsys, monkeypatch):
    from clipdist.config import invalid_value

    assert invalid_value(["optim.lr=abc"]) == "optim.lr=abc: Value 'abc' of type 'str' could not be converted to Float"
    assert invalid_value(["world.parallel=fsdp2"]).startswith("world.parallel=fsdp2: Invalid value 'fsdp2', expected")
    assert "is not Optional" in invalid_value(["optim.max_steps=null"])
    for loose in ("world.reshard_after_forward=2", "model.compile=-1", "data.resampled='2'"):  # OmegaConf: all true
        assert invalid_value([loose]) == f"{loose}: takes true or false (a number other than 0 or 1 means neither)"
    for fine in (
        ["world.reshard_after_forward=0", "model.compile=1", "data.resampled=yes", "world.sync_batchnorm=off"],
        ["optim.lr=1e-3", "world=cpu2", "loss=tiled", "loss.tile=64", "+model.force_image_size=48"],
        ["--multirun", "optim.lr=1e-3,1e-4", "hydra/launcher=slurm", "~logging", "name=${now:%H}"],
        ["data.eval_sets.mine=/x", "precision=amp_bf16", "optim.betas=[0.9,0.95]", "loss.tile=abc"],  # the last: Hydra
        ["optim.lr=[unclosed"],  # the grammar's error is Hydra's
    ):
        assert invalid_value(fine) is None, fine
    code, lines = refusal(capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", "seed=x")
    assert code == 2 and lines == ["error: seed=x: Value 'x' of type 'str' could not be converted to Integer"], lines
    assert not (tmp_path / "run").exists()


def test_a_bool_given_another_number_in_a_config_file_is_refused():
    """Where a config file (or a saved run's) reaches the schema: a bool given 2 is no bool, as on the command line."""
    for section, key in (("world", "reshard_after_forward"), ("data", "resampled")):
        with pytest.raises(ConfigError, match=rf"^{section}.{key}=2: takes true or false"):
            to_train_config({"name": "x", section: {key: 2}})
        assert getattr(getattr(to_train_config({"name": "x", section: {key: 0}}), section), key) is False


def test_a_group_choice_that_names_no_option_is_refused_with_the_options():
    from clipdist.config import BACKENDS, group_options, unknown_override

    assert unknown_override(["loss=dsico"]) == (
        f"loss=dsico: no such option; did you mean loss=disco? choose one of {', '.join(sorted(BACKENDS))}"
    )
    assert "choose one of" in unknown_override(["world=cpu3"]) and "cpu2" in unknown_override(["world=cpu3"])
    assert "goes in model.name=" in unknown_override(["model=ViT-B-32"])
    assert "choose one of siglip2" in unknown_override(["+recipe=nope"])
    assert "did you mean hydra/launcher=submitit_slurm?" in unknown_override(["hydra/launcher=submitit_slrum"])
    assert unknown_override(["--multirun", "loss=disco,tild"]).startswith("loss=tild: no such option; did you mean")
    assert set(BACKENDS) <= set(group_options("loss")) and group_options("optim.lr") == group_options("nope") == []
    for fine in (
        ["loss=siglip", "world=cpu2", "model=naflex_tiny", "recipe=siglip2", "logging=null"],
        ["--config-dir", "/somewhere", "world=mycluster"],  # a user's config folder may add options: Hydra says
        ["hydra/launcher=submitit_slurm", "hydra/job_logging=none"],  # Hydra's and its plugins' groups: theirs
        ["hydra.searchpath=[file:///x]", "model=mine"],
        ["--multirun", "loss=disco,tiled,siglip", "world=choice(cpu2,cpu4)", "loss='naive'"],  # sweeps, quotes
    ):
        assert unknown_override(fine) is None, fine


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.lrr=0.1"], "optim.lrr: no such key; did you mean optim.lr?"),
        (["loss=disko"], "loss=disko: no such option; did you mean loss=disco?"),
        (["loss=tiled", "loss.tyle=4"], "loss.tyle: no such key; did you mean loss.tile"),
        # a group every run chooses from, added with + (Hydra: "Multiple values ... use 'override recipe: siglip2'")
        (["+recipe=siglip2"], "+recipe=siglip2: recipe is a group every run's config chooses from already; give rec"),
        (["+loss=tiled"], "+loss=tiled: loss is a group every run's config chooses from already; give loss=tiled"),
    ],
)
def test_a_misspelt_key_is_one_line_before_hydra_composes(tmp_path, capsys, monkeypatch, overrides, message):
    code, lines = refusal(capsys, monkeypatch, f"run_dir={tmp_path / 'run'}", *overrides)
    assert code == 2 and lines == [f"error: {lines[0][7:]}"] and message in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_hydras_node_is_held_to_clipdists_allowlist():
    """clipdist.hydra_policy reads the composed hydra node (unresolved): what Hydra would build, the environment a
    job gets and where it writes; and Hydra's own parser reads the flags, so an abbreviation is the flag. The corpus
    of routes to these is tests/integration/test_hydra_policy.py."""
    from hydra import compose, initialize_config_module

    from clipdist import hydra_policy
    from clipdist.config import register

    register()
    with initialize_config_module("clipdist.conf", version_base=None):
        cfg = compose("config", return_hydra_config=True)
    assert hydra_policy.hydra_problem(cfg) is None
    for dotted, value, said in [
        ("hydra.callbacks", {"x": {"_target_": "subprocess.call"}}, "callbacks"),
        ("hydra.launcher._target_", "os.system", "hydra.launcher._target_"),
        ("hydra.job_logging", {"handlers": {"h": {"()": "os.getcwd"}}}, "logging may build only"),
        ("hydra.hydra_logging", {"handlers": {"h": {"class": "logging.handlers.HTTPHandler"}}}, "logging may build"),
        ("hydra.job.env_set", {"LD_PRELOAD": "x.so"}, "env_set.LD_PRELOAD"),
        ("hydra.run.dir", "/elsewhere", "hydra.run.dir"),
        ("hydra.job.name", "../x", "hydra.job.name"),
    ]:
        changed = cfg.copy()
        with open_dict(changed):
            OmegaConf.update(changed, dotted, value, merge=False, force_add=True)
        assert said in (hydra_policy.hydra_problem(changed) or ""), dotted
    for flag in (["--experimental-rerun", "x"], ["--exp", "x"], ["--experimental-r=x"]):
        assert "unpickles" in (hydra_policy.argument_problem(flag) or ""), flag
    assert hydra_policy.argument_problem(["--config-d", "x", "loss=disco"]) is None
    assert hydra_policy.searches_user_folders(["--config-d", "x"], [])


def test_no_resolver_that_reads_outside_the_config_survives():
    """Every resolver but those that read the config itself refuses, with one line that says nothing it read."""
    from clipdist import hydra_policy

    OmegaConf.register_new_resolver("clipdist_test_reads", lambda: "outside", replace=True)
    hydra_policy.refuse_outside_resolvers()
    for text in ("${oc.env:HOME}", "${ oc.env:HOME}", "${oc.decode:'1'}", "${clipdist_test_reads:}"):
        with pytest.raises(SystemExit):
            OmegaConf.to_container(OmegaConf.create({"a": text}), resolve=True)
    assert OmegaConf.to_container(OmegaConf.create({"a": 1, "b": "${oc.select:a}"}), resolve=True)["b"] == 1


def test_train_help_describes_every_key_and_lists_every_group_option(capsys):
    """`python train.py --help`: every key of the schema with its default and a description, at once."""
    from clipdist.cli.train import train_help
    from clipdist.config import schema_keys

    text = train_help()
    described = {line.split(" = ")[0].strip(): line for line in text.splitlines() if " = " in line}
    keys, free = schema_keys()
    leaves = {key for key in keys if not any(other.startswith(key + ".") for other in keys)}
    assert leaves <= set(described), sorted(leaves - set(described))
    assert all("  — " in described[key] for key in leaves), [key for key in leaves if "  — " not in described[key]]
    assert "loss=: disco (default), gather_layer, naive, siglip, tiled" in text


def test_a_backends_option_keeps_its_bound_in_the_schema():
    """An option declared with a bound (defaults.positive) is held to it like any key: the schema builder kept
    only defaults before, so `loss.<option>=0` ran."""
    from dataclasses import dataclass

    from clipdist.config import ConfigError, TrainConfig, _loss_schema, validate
    from clipdist.defaults import positive
    from clipdist.registry.losses import LossSpec

    @dataclass
    class ChunkOptions:
        chunk: int = positive(512)

    cfg = TrainConfig()
    cfg.loss = _loss_schema(LossSpec("chunked", "nowhere:Nothing", "a test backend", ChunkOptions))(chunk=0)
    with pytest.raises(ConfigError, match="loss.chunk=0: must be at least 1"):
        validate(cfg)


def test_hydras_mode_is_left_to_the_command_line():
    """tests/helpers.hydra_composes_once answers Hydra's get_mode with None instead of composing the config a first
    time: true only while no config file of clipdist's sets hydra.mode. Hydra's own answer, composed as it does."""
    from hydra import compose, initialize_config_module
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from clipdist.config import CONF, register

    register()
    with initialize_config_module("clipdist.conf", version_base=None):
        for overrides in ([], ["world=cpu2", "loss=siglip", "data=web_photos"]):
            assert compose("config", overrides, return_hydra_config=True).hydra.mode is None
        assert compose("config", ["hydra.mode=MULTIRUN"], return_hydra_config=True).hydra.mode == RunMode.MULTIRUN
    for path in CONF.rglob("*.yaml"):  # no option of any group sets it either (hydra/ files are the hydra node)
        loaded = OmegaConf.to_container(OmegaConf.load(path))
        node = loaded if "hydra" in path.relative_to(CONF).parts else (loaded or {}).get("hydra", {})
        assert "mode" not in (node or {}), path


def test_a_refused_launchs_ranks_may_remove_the_empty_run_directory_in_any_order(tmp_path, monkeypatch):
    """Every rank of a launch refused before it began removes the run directory Hydra made, if still empty. Another
    rank may remove it between this rank's two looks (a SLURM test saw FileNotFoundError there): gone is empty."""
    import os

    from clipdist.cli.train import _created_by_hydra

    (tmp_path / "empty").mkdir()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "train.log").write_text("")
    assert _created_by_hydra(str(tmp_path / "empty")) and not _created_by_hydra(str(tmp_path / "used"))
    assert _created_by_hydra(str(tmp_path / "gone"))
    real = os.scandir

    def removed_meanwhile(path):
        if str(path).endswith("raced"):
            raise FileNotFoundError(path)
        return real(path)

    (tmp_path / "raced").mkdir()
    monkeypatch.setattr(os, "scandir", removed_meanwhile)
    monkeypatch.setattr(os.path, "exists", lambda path: False)  # the other rank's rmtree finished
    assert _created_by_hydra(str(tmp_path / "raced"))


def test_the_sources_that_read_raw_files_are_the_loaders_that_take_a_folder():
    import inspect

    from clipdist.config import RAW_FILE_SOURCES
    from clipdist.data.builtin import LOADERS

    takes = {
        name for name, load in LOADERS.items() if not next(iter(inspect.signature(load).parameters)).startswith("_")
    }
    assert takes == set(RAW_FILE_SOURCES)
