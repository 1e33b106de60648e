"""What a step minimises: a weighted sum of terms, each over the global batch, exact at any world size, with
unequal local batches and under gradient caching:

    L = Σ_k w_k · T_k       contrastive (any backend) · CoCa's caption (caption.py) · distillation (distillation.py)
                            · self-distillation on local views (self_distill.py)

Each term (base.Term) takes from a forward what it needs, merges the chunks of gradient caching, gives this rank's
share ℓ_r (mean over ranks: T; DDP's average of its gradient: ∂T/∂θ), and its single-process reference, which
`clipdist gradcheck` compares against. A term with options is a config section `loss.<name>`: one file here and its
entry in `registry.terms.TERMS`. Importing this package imports no torch (the config schema reads the registry).
"""

from __future__ import annotations

import importlib

_LAZY = {  # name -> the module that defines it, imported on first use
    "Objective": "clipdist.objective.weighted_sum",
    "build_objective": "clipdist.objective.weighted_sum",
    "run_objective": "clipdist.objective.weighted_sum",
    "as_objective": "clipdist.objective.weighted_sum",
    "attach_parts": "clipdist.objective.weighted_sum",
    "Outputs": "clipdist.objective.base",
    "Term": "clipdist.objective.base",
    "TermContext": "clipdist.objective.base",
    "caption_cross_entropy": "clipdist.objective.caption",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
