"""A stopped and resumed run is indistinguishable from one never stopped: the same batches, the same
per-step loss — through SIGTERM and kill -9, twice, with 0–2 loader workers, epoch and resampled
modes, 1 and 2 ranks; weighted sources mixed by weight; a changed layout restarts with a warning."""

from __future__ import annotations

import numpy as np
from fixtures import two_sources, weighted_stream


def test_sources_are_mixed_by_weight(tmp_path):
    batches = weighted_stream(two_sources(tmp_path), 0)
    counts = np.sum(
        [next(batches).counts[2:] for _ in range(250)], axis=0
    )  # [samples skipped, shards skipped, *sources]
    assert counts.sum() == 1000
    # 500 shard draws of 2 samples at p = 3/4: the fraction's standard deviation is 0.019.
    assert abs(counts[0] / 1000 - 0.75) < 0.06, counts


def test_every_key_of_the_state_sections_says_what_a_resume_may_do_with_it():
    """model, optim and loss make the run's state: each field says refuse / warn / free, so a new key cannot change
    on resume without anyone having decided it may (the rules were a hand-kept list of strings)."""
    from dataclasses import fields

    from clipdist.config import (
        FREE,
        LOSS_SCHEMAS,
        REFUSE,
        WARN,
        LossConfig,
        ModelConfig,
        OptimConfig,
        resume_rule,
    )
    from clipdist.registry.terms import TERMS

    terms = [spec.options for spec in TERMS.values()]
    for section in (ModelConfig, OptimConfig, LossConfig, *terms, *LOSS_SCHEMAS.values()):
        missing = [f.name for f in fields(section) if f.name not in section.RESUME]
        assert not missing, f"{section.__name__} fields without a resume rule: {missing}"
        assert set(section.RESUME.values()) <= {REFUSE, WARN, FREE}
        assert not set(section.RESUME) - {f.name for f in fields(section)}, section.__name__
    assert resume_rule("model.name") == REFUSE and resume_rule("loss.distill.model") == REFUSE
    assert resume_rule("loss.tile") == FREE and resume_rule("loss.init_logit_scale") == FREE
    assert resume_rule("optim.max_steps") == WARN and resume_rule("precision") == WARN
    assert resume_rule("world.batch_per_device") == FREE and resume_rule("model.no_such_key") == FREE


def test_a_resume_refuses_another_model_and_warns_of_a_reshaped_schedule(trained_run, tmp_path):
    import shutil

    import pytest
    from omegaconf import OmegaConf

    from clipdist.checkpoint.manager import Checkpointer
    from clipdist.config import ConfigError, to_train_config

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)

    def check(**changes):
        config = OmegaConf.merge(OmegaConf.load(run / "hydra" / "config.yaml"), {"run_dir": str(run), **changes})
        return Checkpointer.check_resume(to_train_config(config), 1)

    assert check() == []  # the run as trained
    with pytest.raises(ConfigError, match="was trained with model.lock_text=False, not model.lock_text=True"):
        check(model={"lock_text": True})
    assert check(optim={"max_steps": 60, "lr": 1e-4}) == ["changed since step_00000030.dcp: optim.max_steps 30 -> 60"]


def test_a_resume_trains_with_the_optimizer_settings_it_was_given(trained_run, cache_dir, tmp_path):
    """optim.lr and the layer decays are free on resume: the resumed steps train at the new lr (not the
    checkpoint's groups and base rates, as they once silently did), and regrouping the parameters (a layer decay
    the run did not have) resumes instead of failing on the checkpoint's group count."""
    import shutil

    import pytest
    from helpers import read_jsonl, train

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    resumed = train(run, cache_dir, "optim.max_steps=32", "optim.lr=1e-4", "optim.image_layer_decay=0.7")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-2000:]
    rows = {row["step"]: row for row in read_jsonl(run / "train_log.jsonl")}
    assert rows[31]["lr"] == pytest.approx(1e-4 * 31 / 50)  # the 31st of optim=tiny's 50 warmup steps, at the new lr
    assert rows[30]["lr"] == pytest.approx(2e-3 * 30 / 50)  # the trained run's last step, at its own lr
