"""The optimizer's parameter groups: weight decay where it belongs, and FastCLIP-v3's own
temperature learning rate (``optim.temperature_lr``) on the shared cosine schedule."""

from __future__ import annotations

import pytest
import torch

from vlcontrast.config import OptimConfig
from vlcontrast.errors import ConfigError
from vlcontrast.train.optimizer import build_optimizer, parameter_groups


class TwoTowers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.ln = torch.nn.LayerNorm(4)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))
        self.logit_bias = torch.nn.Parameter(torch.tensor(-1.0))


def names_of(model, group):
    ids = {id(p) for p in group["params"]}
    return sorted(n for n, p in model.named_parameters() if id(p) in ids)


def test_without_temperature_lr_the_temperature_is_in_the_no_decay_group():
    model = TwoTowers()
    groups = parameter_groups(model, 0.1)
    assert [names_of(model, g) for g in groups] == [
        ["ln.bias", "ln.weight", "logit_bias", "logit_scale", "proj.bias"], ["proj.weight"]]
    assert all("lr" not in g for g in groups)


def test_temperature_lr_gives_the_temperature_its_own_rate_on_the_same_schedule():
    model = TwoTowers()
    optim = OptimConfig(lr=1e-3, warmup_steps=2, temperature_lr=0.1, weight_decay=0.1)
    optimizer, scheduler = build_optimizer(model, optim, total_steps=10, finite_checked=False)
    by_name = {tuple(names_of(model, g)): g for g in optimizer.param_groups}
    temperature = by_name[("logit_bias", "logit_scale")]
    assert temperature["weight_decay"] == 0.0
    assert temperature["lr"] == pytest.approx(0.1 * 0.5)  # warmup step 1 of 2
    assert by_name[("proj.weight",)]["lr"] == pytest.approx(1e-3 * 0.5)
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    assert temperature["lr"] == pytest.approx(0.0, abs=1e-12)


def test_a_negative_temperature_lr_is_a_config_error():
    with pytest.raises(ConfigError, match="optim.temperature_lr"):
        OptimConfig(temperature_lr=-1.0).check()
