"""Where docs/migrating.md says "same", the two programs do the same: open_clip_train 3.3 (`python -m
open_clip_train.main`, from the wheel) and clipdist (`train.py`, `clipdist export`, `clipdist eval`) started from
the same weights on the same rows, compared step by step — the lr each step applied, the loss, the optimizer's
parameter groups (which tensors decay, with what betas and eps), every weight after every step, and the
validation metrics — and one exported model evaluated by both.

The rows: 16 flat-coloured 32-px PNGs with distinct captions in a TSV table (open_clip's csv layout). A flat
image is the same after any random resized crop, so open_clip_train's augmentation draws do not matter; each
step is the whole table (one batch an epoch), so neither does the order of its rows. The model is clipdist-tiny's
config in a `local-dir:` folder named `vit-tiny` (open_clip_train picks its AdamW betas/eps by "vit" in the name).

RECIPES names the rows of the migration table each recipe covers; docs/migrating.md's "same" rows that say
"[tested](#tested-end-to-end)" are exactly these (test_the_table_names_the_rows_this_module_runs)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, python, read_jsonl, train

ROWS, VAL_ROWS = 16, 24
# clipdist's weights may differ from open_clip_train's by NOISE_TIMES the gap between two runs of open_clip_train
# itself (rows reordered), and by MIN_GAP of the update where that floor is ~0. Measured (update_gaps, all recipes):
# see the note in test_a_recipe_trains_as_open_clip_train_trains_it's report.
NOISE_TIMES, WORST_TIMES, MIN_GAP = 10.0, 30.0, 1e-6
COLOURS = [
    "red",
    "green",
    "blue",
    "yellow",
    "purple",
    "orange",
    "black",
    "white",
    "grey",
    "pink",
    "brown",
    "cyan",
    "teal",
    "navy",
    "olive",
    "maroon",
    "gold",
    "silver",
    "lime",
    "beige",
    "coral",
    "plum",
    "khaki",
    "azure",
]

METRICS = {
    "i2t_r1": "image_to_text_R@1",
    "i2t_r5": "image_to_text_R@5",
    "i2t_r10": "image_to_text_R@10",
    "i2t_mean_rank": "image_to_text_mean_rank",
    "i2t_median_rank": "image_to_text_median_rank",
    "t2i_r1": "text_to_image_R@1",
    "t2i_r5": "text_to_image_R@5",
    "t2i_r10": "text_to_image_R@10",
    "t2i_mean_rank": "text_to_image_mean_rank",
    "t2i_median_rank": "text_to_image_median_rank",
}  # ours: theirs

# name: (open_clip_train flags, clipdist overrides, steps, the migration table's rows it runs)
RECIPES = {
    "cosine": (
        ["--lr-scheduler", "cosine", "--warmup", "1", "--lr", "1e-3", "--wd", "0.2"],
        [
            "optim.schedule=cosine",
            "optim.warmup_steps=1",
            "optim.lr=1e-3",
            "optim.weight_decay=0.2",
            "optim.grad_clip=0",
        ],
        3,
        [
            "--train-data",
            "--dataset-type",
            "--csv-separator",
            "--csv-img-key",
            "--csv-caption-key",
            "--val-data",
            "--batch-size",
            "--epochs",
            "--lr",
            "--wd",
            "--warmup",
            "--lr-scheduler",
            "--model",
            "--precision",
        ],
    ),
    "cooldown": (
        [
            "--lr-scheduler",
            "const-cooldown",
            "--epochs-cooldown",
            "2",
            "--lr-cooldown-end",
            "1e-5",
            "--lr-cooldown-power",
            "2",
            "--warmup",
            "1",
            "--lr",
            "2e-3",
            "--wd",
            "0.5",
            "--beta1",
            "0.8",
            "--beta2",
            "0.95",
            "--eps",
            "1e-7",
            "--grad-clip-norm",
            "0.5",
            "--lock-image",
            "--lock-image-unlocked-groups",
            "1",
        ],
        [
            "optim.schedule=const_cooldown",
            "optim.const_cooldown.steps=2",
            "optim.const_cooldown.end_lr=1e-5",
            "optim.const_cooldown.power=2",
            "optim.warmup_steps=1",
            "optim.lr=2e-3",
            "optim.weight_decay=0.5",
            "optim.betas=[0.8,0.95]",
            "optim.eps=1e-7",
            "optim.grad_clip=0.5",
            "model.lock_image=true",
            "model.lock_image_unlocked_groups=1",
        ],
        4,
        [
            "--epochs-cooldown",
            "--lr-cooldown-end",
            "--lr-cooldown-power",
            "--beta1",
            "--beta2",
            "--eps",
            "--grad-clip-norm",
            "--lock-image",
            "--lock-image-unlocked-groups",
        ],
    ),
    "skip_scheduler": (
        [
            "--skip-scheduler",
            "--lr",
            "1e-3",
            "--wd",
            "0.1",
            "--lock-text",
            "--lock-text-unlocked-layers",
            "1",
            "--lock-text-freeze-layer-norm",
            "--image-mean",
            "0.5",
            "0.4",
            "0.3",
            "--image-std",
            "0.2",
            "0.3",
            "0.4",
            "--force-quick-gelu",
        ],
        [
            "optim.schedule=const",
            "optim.warmup_steps=0",
            "optim.lr=1e-3",
            "optim.weight_decay=0.1",
            "optim.grad_clip=0",
            "model.lock_text=true",
            "model.lock_text_unlocked_layers=1",
            "model.lock_text_freeze_layer_norm=true",
            "model.image_mean=[0.5,0.4,0.3]",
            "model.image_std=[0.2,0.3,0.4]",
            "model.force_quick_gelu=true",
        ],
        2,
        [
            "--skip-scheduler",
            "--lock-text",
            "--lock-text-unlocked-layers",
            "--lock-text-freeze-layer-norm",
            "--image-mean",
            "--image-std",
            "--force-quick-gelu",
        ],
    ),
    "model_options": (
        [
            "--lr-scheduler",
            "const",
            "--warmup",
            "1",
            "--lr",
            "1e-3",
            "--wd",
            "0.2",
            "--force-context-length",
            "12",
            "--force-image-size",
            "48",
            "--force-custom-text",
            "--grad-checkpointing",
            "--val-frequency",
            "1",
        ],
        [
            "optim.schedule=const",
            "optim.warmup_steps=1",
            "optim.lr=1e-3",
            "optim.weight_decay=0.2",
            "optim.grad_clip=0",
            "model.force_context_length=12",
            "model.force_image_size=48",
            "model.force_custom_text=true",
            "model.grad_checkpointing=true",
            "eval_every=1",
        ],
        2,
        [
            "--force-context-length",
            "--force-image-size",
            "--force-custom-text",
            "--grad-checkpointing",
            "--val-frequency",
        ],
    ),
    # timm's optimizer factory (its decay groups: model.no_weight_decay() undecayed, the positional embeddings too)
    "timm_optimizer": (
        # (open_clip_train hands --eps, --beta1 and --beta2 to timm as given: no eps is a crash, no betas timm's own)
        ["--opt", "timm/adamw", "--lr", "1e-3", "--warmup", "1", "--wd", "0.2", "--eps", "1e-6"]
        + ["--beta1", "0.9", "--beta2", "0.98"],
        [
            "optim.name=timm/adamw",
            "optim.lr=1e-3",
            "optim.warmup_steps=1",
            "optim.weight_decay=0.2",
            "optim.grad_clip=0",
        ],
        1,  # the groups show at the first step (one step of three programs: the suite's time)
        ["--opt"],
    ),
    "siglip": (
        ["--siglip", "--lr", "1e-3", "--warmup", "1", "--wd", "0.2"],
        ["loss=siglip", "optim.lr=1e-3", "optim.warmup_steps=1", "optim.weight_decay=0.2", "optim.grad_clip=0"],
        2,
        ["--siglip"],
    ),
}


def flat_png(path: Path, index: int) -> None:
    from PIL import Image

    Image.new("RGB", (32, 32), (index * 10 % 256, 255 - index * 10 % 256, index * 37 % 256)).save(path)


def table(path: Path, images: Path, rows: range) -> Path:
    lines = ["filepath\ttitle"]
    for index in rows:
        flat_png(images / f"{index}.png", index)
        lines.append(f"{images / f'{index}.png'}\ta {COLOURS[index]} square")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """The tables and the initial weights both programs start from."""
    import open_clip
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("parity")
    (root / "images").mkdir()
    train_table = table(root / "train.tsv", root / "images", range(ROWS))
    table(root / "train_reversed.tsv", root / "images", range(ROWS - 1, -1, -1))  # the noise floor's rows
    val_table = table(root / "val.tsv", root / "images", range(VAL_ROWS))
    config = json.loads((REPO / "clipdist" / "model_configs" / "clipdist-tiny.json").read_text())
    torch.manual_seed(0)
    model = open_clip.CLIP(**config)
    folder = root / "vit-tiny"
    folder.mkdir()
    save_file(
        {name: value.contiguous() for name, value in model.state_dict().items()}, folder / "open_clip_model.safetensors"
    )
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": config, "preprocess_cfg": {}}))
    siglip = root / "vit-tiny-siglip"  # with SigLIP's scalars: open_clip_train gives a file without a bias 0, we −10
    siglip.mkdir()
    save_file(
        {
            **{name: value.contiguous() for name, value in model.state_dict().items()},
            "logit_scale": torch.tensor(math.log(10.0)),
            "logit_bias": torch.tensor(-10.0),
        },
        siglip / "open_clip_model.safetensors",
    )
    (siglip / "open_clip_config.json").write_text(json.dumps({"model_cfg": config, "preprocess_cfg": {}}))
    return root, train_table, val_table, folder


def open_clip_train(out: Path, *flags: str) -> subprocess.CompletedProcess:
    """open_clip_train's own entry point, as `python -m open_clip_train.main` runs it, on the CPU (a process forked
    from one that has imported torch and open_clip: helpers.python)."""
    command = [
        "-m",
        "open_clip_train.main",
        "--logs",
        str(out.parent),
        "--name",
        out.name,
        "--workers",
        "0",
        "--precision",
        "fp32",
        "--seed",
        "0",
        "--report-to",
        "tensorboard",
        "--log-every-n-steps",
        "1",
        "--save-frequency",
        "1",
        *flags,
    ]
    result = python(command, out.parent, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def run_clipdist(run: Path, cache_dir: Path, table: Path, model_folder: Path, batch: int, steps: int, *overrides):
    """clipdist's train.py on `table` from the model folder both programs start from, in fp32, reading in the rank;
    CLIPDIST_PARITY_SHIFT's overrides last (a deliberate difference: the tests fail)."""
    result = train(
        run,
        cache_dir,
        "data=webdataset",
        f"data.train_shards={table}",
        f"model.name=local-dir:{model_folder}",
        f"world.batch_per_device={batch}",
        f"optim.max_steps={steps}",
        "precision=fp32",
        "data.workers=0",
        *overrides,
        *os.environ.get("CLIPDIST_PARITY_SHIFT", "").split(),
    )
    assert result.returncode == 0, result.stderr[-3000:]


def scalars(tensorboard: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard), size_guidance={"scalars": 0})
    events.Reload()
    return [event.value for event in sorted(events.Scalars(tag), key=lambda event: event.step)]


def their_model(model_folder: Path, flags: list[str]):
    """The model open_clip_train builds and trains from `model_folder` with these flags (main.py), before step 1."""
    import open_clip

    def value(flag):
        return int(flags[flags.index(flag) + 1]) if flag in flags else None

    model = open_clip.create_model(
        f"local-dir:{model_folder}",
        force_custom_text="--force-custom-text" in flags,
        force_quick_gelu="--force-quick-gelu" in flags,
        force_image_size=value("--force-image-size"),
        force_context_length=value("--force-context-length"),
        **({"init_logit_bias": -10.0} if "--siglip" in flags else {}),
    )
    if "--lock-image" in flags:
        model.lock_image_tower(unlocked_groups=value("--lock-image-unlocked-groups"))
    if "--lock-text" in flags:
        model.lock_text_tower(unlocked_layers=value("--lock-text-unlocked-layers"), freeze_layer_norm=True)
    return model


def their_groups(checkpoint: dict, model_folder: Path, flags: list[str]) -> list[dict]:
    """open_clip_train's parameter groups by name: its optimizer holds [no-decay, decay] groups of the trainable
    parameters in named_parameters order (main.py), saved as indices."""
    model = their_model(model_folder, flags)
    trainable = [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]
    if "--opt" in flags:  # handed to timm's factory (main.py): its own groups, asked of timm itself
        from timm.optim import create_optimizer_v2

        names = {id(parameter): name for name, parameter in trainable}
        built = create_optimizer_v2(model, flags[flags.index("--opt") + 1].removeprefix("timm/"), weight_decay=0.1)
        ordered = [names[id(parameter)] for group in built.param_groups for parameter in group["params"]]
    else:
        undecayed = [
            name
            for name, parameter in trainable
            if parameter.ndim < 2 or any(part in name for part in ("bn", "ln", "bias", "logit_scale"))
        ]
        ordered = undecayed + [name for name, _ in trainable if name not in undecayed]
    groups = []
    for group in checkpoint["optimizer"]["param_groups"]:
        groups.append(
            {
                "names": sorted(ordered[index] for index in group["params"]),
                "weight_decay": group["weight_decay"],
                "betas": tuple(group["betas"]),
                "eps": group["eps"],
            }
        )
    return sorted(groups, key=lambda group: group["weight_decay"])


def our_groups(checkpoint: Path) -> list[dict]:
    from clipdist.checkpoint.weights import read_dcp

    keys = {f"optimizer.param_groups.{i}.{key}" for i in range(4) for key in ("params", "weight_decay", "betas", "eps")}
    groups = read_dcp(checkpoint, keys)["optimizer"]["param_groups"]
    return sorted(
        (
            {
                "names": sorted(group["params"]),
                "weight_decay": group["weight_decay"],
                "betas": tuple(group["betas"]),
                "eps": group["eps"],
            }
            for group in groups
        ),
        key=lambda group: group["weight_decay"],
    )


def update_gaps(ours: dict, theirs: dict, initial: dict) -> tuple[float, float, str]:
    """How far `ours` is from `theirs` as a fraction of how far training moved `theirs`, ‖ours − theirs‖ /
    ‖theirs − initial‖: over all the weights at once, and the worst single tensor (with its name). Norms, not a worst
    element: Adam moves a weight whose gradient is ~0 by lr × noise / (|noise| + eps), so single elements differ by a
    sizeable part of lr between any two summation orders, while a wrong lr, schedule, decay or beta moves every
    element of a tensor. The attention keys' biases are left out (softmax ignores a constant added to every key:
    their exact gradient is zero, their update all noise); so are tensors training did not move (locked)."""
    assert sorted(ours) == sorted(theirs)
    gaps, squares = {}, [0.0, 0.0]
    for name in theirs:
        gap, moved = ours[name].double() - theirs[name].double(), theirs[name].double() - initial[name].double()
        if name.endswith("attn.in_proj_bias"):  # [query, key, value] biases
            third = len(gap) // 3
            gap, moved = torch.cat([gap[:third], gap[2 * third :]]), torch.cat([moved[:third], moved[2 * third :]])
        if moved.norm() > 0:
            gaps[name] = (gap.norm() / moved.norm()).item()
            squares[0] += gap.square().sum().item()
            squares[1] += moved.square().sum().item()
    worst, where = max((gap, name) for name, gap in gaps.items())
    return math.sqrt(squares[0] / squares[1]), worst, where


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_recipe_trains_as_open_clip_train_trains_it(tmp_path, cache_dir, start, recipe):
    """Every weight after every step within NOISE_TIMES of open_clip_train's own noise floor: the same program on
    the same rows in reverse order (each step is the whole table, so only the order of its sums changes)."""
    from clipdist.checkpoint.weights import read_run_checkpoint

    root, train_table, val_table, model_folder = start
    flags, overrides, steps, _rows = RECIPES[recipe]
    if "--siglip" in flags:
        model_folder = model_folder.with_name("vit-tiny-siglip")
    common = [
        "--model",
        f"local-dir:{model_folder}",
        "--dataset-type",
        "csv",
        "--batch-size",
        str(ROWS),
        "--epochs",
        str(steps),
        *flags,
    ]
    theirs, reordered = tmp_path / "open_clip_train", tmp_path / "open_clip_train_reordered"
    open_clip_train(theirs, "--train-data", str(train_table), "--val-data", str(val_table), *common)
    open_clip_train(reordered, "--train-data", str(root / "train_reversed.tsv"), *common)
    ours = tmp_path / "clipdist"
    run_clipdist(
        ours,
        cache_dir,
        train_table,
        model_folder,
        ROWS,
        steps,
        f"data.val_shards={val_table}",
        "eval_every=1",
        "checkpoint_every=1",
        f"keep_checkpoints={steps}",
        *overrides,
    )

    logged = read_jsonl(ours / "train_log.jsonl")
    their_lr = scalars(theirs / "tensorboard", "train/lr")
    assert len(their_lr) == steps
    np.testing.assert_allclose([row["lr"] for row in logged], their_lr, rtol=1e-6)  # TensorBoard keeps float32
    np.testing.assert_allclose(
        [row["loss"] for row in logged], scalars(theirs / "tensorboard", "train/loss"), rtol=1e-5
    )

    their_results = read_jsonl(theirs / "checkpoints" / "results.jsonl")
    our_results = read_jsonl(ours / "metrics.jsonl")
    assert len(their_results) == len(our_results) == steps
    for mine, other in zip(our_results, their_results):
        assert mine["val_samples"] == other["num_samples"] == VAL_ROWS
        assert {key: mine[key] for key in METRICS} == {key: other[name] for key, name in METRICS.items()}, mine["step"]
        assert math.isclose(mine["val_clip_loss"], other["clip_val_loss"], rel_tol=1e-4), mine["step"]

    initial = their_model(model_folder, flags).state_dict()
    report = []
    for step in range(1, steps + 1):
        their_checkpoint = torch.load(
            theirs / "checkpoints" / f"epoch_{step}.pt", map_location="cpu", weights_only=True
        )
        floor_checkpoint = torch.load(
            reordered / "checkpoints" / f"epoch_{step}.pt", map_location="cpu", weights_only=True
        )
        our_weights, _ = read_run_checkpoint(ours / "checkpoints" / f"step_{step:08d}.dcp")
        ours_all, ours_worst, where = update_gaps(our_weights, their_checkpoint["state_dict"], initial)
        floor_all, floor_worst, _ = update_gaps(floor_checkpoint["state_dict"], their_checkpoint["state_dict"], initial)
        report.append(
            f"step {step}: {ours_all:.1e} (floor {floor_all:.1e}), worst tensor {ours_worst:.1e} "
            f"(floor {floor_worst:.1e}; {where})"
        )
        assert ours_all <= NOISE_TIMES * floor_all + MIN_GAP, report
        assert ours_worst <= WORST_TIMES * floor_worst + MIN_GAP, report
    assert our_groups(ours / "checkpoints" / f"step_{steps:08d}.dcp") == their_groups(
        their_checkpoint, model_folder, flags
    )
    print(f"{recipe}: weights' update gaps {'; '.join(report)}")


def test_one_exported_model_evaluates_the_same_in_both(tmp_path, cache_dir, start):
    """clipdist's trained model exported (`clipdist export`) and evaluated by open_clip_train (a run with
    `--val-data` and no train data) and by `clipdist eval`: every retrieval metric and the validation loss."""
    from clipdist.cli import main

    _root, train_table, val_table, model_folder = start
    run = tmp_path / "run"
    result = train(
        run,
        cache_dir,
        "data=webdataset",
        f"data.train_shards={train_table}",
        f"model.name=local-dir:{model_folder}",
        f"world.batch_per_device={ROWS}",
        "optim.max_steps=4",
        "precision=fp32",
        "data.workers=0",
        "eval_every=1000",
        "checkpoint_every=4",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    export = tmp_path / "vit-export"
    assert main(["export", str(run), "--out", str(export)]) == 0
    theirs = tmp_path / "evaluated"
    open_clip_train(
        theirs,
        "--model",
        f"local-dir:{export}",
        "--val-data",
        str(val_table),
        "--dataset-type",
        "csv",
        "--batch-size",
        str(ROWS),
    )
    their = read_jsonl(theirs / "checkpoints" / "results.jsonl")[-1]
    metrics = tmp_path / "metrics.json"
    assert (
        main(["eval", str(export), "--set", f"val={val_table}", "--batch", str(ROWS), "--json", "--out", str(metrics)])
        == 0
    )
    ours = json.loads(metrics.read_text())
    ours = {key.removeprefix("val_"): value for key, value in ours.get("val", ours).items()}
    assert {key: ours[key] for key in METRICS} == {key: their[name] for key, name in METRICS.items()}
    assert ours["samples"] == their["num_samples"] == VAL_ROWS
    assert math.isclose(ours["clip_loss"], their["clip_val_loss"], rel_tol=1e-5)


def logged_steps(tensorboard: Path, tag: str) -> list[int]:
    """The 1-based steps open_clip_train logged `tag` at (its TensorBoard steps count from 0)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard), size_guidance={"scalars": 0})
    events.Reload()
    return sorted(event.step + 1 for event in events.Scalars(tag))


def test_the_log_cadence_is_open_clip_trains(tmp_path, cache_dir, start):
    """--log-every-n-steps 3 over two 4-step epochs: open_clip_train logs steps 1, 4, 5, 8 (counted within each
    epoch, its last step too); clipdist with logging.epoch_steps=4 the same steps."""
    _root, train_table, _val_table, model_folder = start
    batch, epochs, every = ROWS // 4, 2, 3
    theirs = tmp_path / "open_clip_train"
    open_clip_train(
        theirs,
        *("--train-data", str(train_table), "--model", f"local-dir:{model_folder}", "--dataset-type", "csv"),
        *("--batch-size", str(batch), "--epochs", str(epochs), "--log-every-n-steps", str(every)),
    )
    ours = tmp_path / "clipdist"
    cadence = [f"logging.log_every={every}", "logging.epoch_steps=4"]
    run_clipdist(ours, cache_dir, train_table, model_folder, batch, epochs * 4, *cadence)
    # (with CLIPDIST_PARITY_SHIFT=logging.epoch_steps=null the test fails)
    their_steps = logged_steps(theirs / "tensorboard", "train/loss")
    assert their_steps == [1, 4, 5, 8]
    assert [row["step"] for row in read_jsonl(ours / "train_log.jsonl")] == their_steps


# Rows tested end to end outside RECIPES, with the test that runs them.
OTHER_ROWS = {"--log-every-n-steps": test_the_log_cadence_is_open_clip_trains}


def test_the_table_names_the_rows_this_module_runs():
    """docs/migrating.md marks a row "[tested](#tested-end-to-end)" exactly where a recipe here runs its flag."""
    covered = {flag for *_, rows in RECIPES.values() for flag in rows} | set(OTHER_ROWS)
    text = (REPO / "docs" / "migrating.md").read_text()
    marked = set(re.findall(r"^\| `(--[a-z0-9-]+)` \|[^\n]*\[tested\]\(#tested-end-to-end\)", text, flags=re.M))
    assert marked == covered, (sorted(covered - marked), sorted(marked - covered))
    for flag in covered:
        row = re.search(rf"^\| `{flag}` \|[^|]*\| (\w+)", text, flags=re.M)
        assert row and row.group(1) in ("same", "better"), flag
