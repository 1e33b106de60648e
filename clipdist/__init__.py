"""clipdist: CLIP pretraining with exact distributed contrastive losses.

The package in layers, lowest first: a module imports only from its own layer and the layers below it, never in
a loop (tests/unit/test_layers.py reads LAYERS from here; docs/architecture.md draws them). A name is a package
(every module in it) or one module of a package ("model.precision") placed apart from the rest of its package."""

__version__ = "0.1.0"

LAYERS = (
    # foundations: the schema and its errors, the console, bounded files, who runs where
    (
        *("errors", "defaults", "compat", "losses.specs", "objective.specs", "data.specs", "hydra_policy", "config"),
        *("console", "files", "distributed", "model.precision"),
    ),
    # components built from config: losses, towers, data, checkpoints, optimizer, trackers
    ("losses", "model", "data", "checkpoint", "train.optim", "train.ema", "train.tracking"),
    # what combines components: the loss terms, one step, evaluation, the checks before any rank starts
    ("objective", "train.step", "train.parts", "train.evaluate", "train.recipe", "preflight"),
    # the loop
    ("train", "train.entry", "train.trainer", "train.startup"),
    # the commands
    ("tools", "cli", "__main__", "conf"),
)
