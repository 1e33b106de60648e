"""optim.ema (clipdist/optim/ema.py): the weights themselves until start_step, then ema ← d·ema + (1 − d)·θ every
`every` steps, in fp32 whatever the weights' precision."""

from __future__ import annotations

import pytest
import torch

from clipdist.config import EmaConfig
from clipdist.optim.ema import WeightAverage


def test_the_average_follows_its_rule_step_by_step():
    model = torch.nn.Linear(3, 2)
    average = WeightAverage(model, EmaConfig(decay=0.5, start_step=3, every=2))
    expected = {name: value.detach().clone() for name, value in model.named_parameters()}
    for step in range(1, 10):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(step)
        average.update(step)
        for name, parameter in model.named_parameters():
            if step < 3:
                expected[name] = parameter.detach().clone()
            elif (step - 3) % 2 == 0:
                expected[name] = 0.5 * expected[name] + 0.5 * parameter.detach()
        state = average.state_dict()
        assert all(torch.allclose(state[name], expected[name]) for name in expected), step
    assert not torch.allclose(state["weight"], model.weight)


def test_the_average_is_fp32_for_low_precision_weights():
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    average = WeightAverage(model, EmaConfig(decay=0.999))
    with torch.no_grad():
        model.weight.add_(1e-3)  # below bf16's resolution at 1.0 for an average's step, not for fp32's
    average.update(1)
    assert average.state_dict()["weight"].dtype == torch.float32


@pytest.mark.parametrize("decay", [1.0, 1.5])
def test_a_decay_that_never_moves_is_refused(decay):
    from clipdist.config import TrainConfig, validate
    from clipdist.errors import ConfigError

    cfg = TrainConfig()
    cfg.optim.ema.decay = decay
    with pytest.raises(ConfigError, match=r"optim.ema.decay=.*must be below 1"):
        validate(cfg)
