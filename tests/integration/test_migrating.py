"""Every clipdist override docs/migrating.md gives for an open_clip_train flag composes with Hydra (as
`python train.py <overrides>` parses it) and passes the checks a run makes before any rank starts."""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_migrating import rows


def test_every_override_in_the_migration_table_passes_the_checks_before_the_ranks():
    from hydra import compose, initialize_config_dir

    from clipdist.config import register, to_train_config
    from clipdist.data.transforms import augmentation_cfg
    from clipdist.model.factory import check_model_options, resolve_model_name
    from clipdist.optim.optimizer import check_optim
    from clipdist.preflight import check_config

    register()
    failures, checked = {}, 0
    with initialize_config_dir(
        config_dir=str(Path(__file__).resolve().parents[2] / "clipdist" / "conf"), version_base=None
    ):
        for flag, (overrides, _, _) in rows().items():
            if not overrides:
                continue
            try:
                cfg = to_train_config(compose("config", overrides=["name=migrating", *overrides]))
                check_config(cfg)
                resolve_model_name(cfg.model.name)
                check_model_options(cfg.model)
                check_optim(cfg.optim)
                augmentation_cfg(cfg.data)
                checked += 1
            except Exception as error:  # noqa: BLE001 -- every failing row is reported at once
                failures[flag] = f"{type(error).__name__}: {error}"
    assert not failures, failures
    assert checked >= 75
