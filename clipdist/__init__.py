"""clipdist: CLIP pretraining with exact distributed contrastive losses.

The package in layers, lowest first: a package (or a top-level module) imports only from itself and from the
packages on the floors below it, never in a loop (tests/unit/test_layers.py reads LAYERS from here;
docs/architecture.md draws them)."""

__version__ = "0.1.0"

LAYERS = (
    ("files", "defaults", "compat"),  # bounded file reads and writes, the shared defaults, optional APIs
    ("errors",),  # the errors a user can be shown, and the bug report
    ("hydra_policy", "console", "registry"),  # what Hydra may run; what the user reads; every pluggable axis's entries
    ("config",),  # the schema, built from the registry
    ("losses", "distributed", "optim"),  # the loss backends; who runs where; the optimizer, schedule and average
    ("checkpoint",),  # saving, resuming, weights
    ("tracking", "model"),  # logs; the towers
    ("data",),  # shards, readers, batches, image sizes from the towers
    ("objective",),  # the loss terms around the backend
    ("preflight",),  # the checks before any rank starts
    ("train",),  # one step, the loop
    ("tools",),  # what the commands do
    ("cli", "conf"),  # the commands and the configs
    ("__main__",),  # python -m clipdist
)
