"""The registry: names, option defaults from docs/losses.md, errors, attributes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vlcontrast.losses import LOSSES, build_loss, loss_option_defaults

EXPECTED_DEFAULTS = {
    "infonce": {}, "dcl": {}, "siglip": {},
    "dclw": {"sigma": 0.5},
    "debiased": {"tau_plus": 0.1},
    "hcl": {"tau_plus": 0.1, "beta": 1.0},
    "bcl": {"tau_plus": 0.1, "alpha": 0.5, "beta": 1.0},
    "balanced": {"alpha": 4.0, "lam": 2.0, "include_positive": False},
}


def test_names():
    assert sorted(LOSSES) == sorted(
        ["infonce", "dcl", "dclw", "decl", "debiased", "hcl", "bcl", "balanced", "siglip"])


@pytest.mark.parametrize("name", sorted(EXPECTED_DEFAULTS))
def test_option_defaults_follow_the_contract(name):
    assert loss_option_defaults(name) == EXPECTED_DEFAULTS[name]


def test_decl_options():
    defaults = loss_option_defaults("decl")
    assert defaults["estimator"] == "buffer" and defaults["u_mode"] == "mean"
    assert defaults["gamma"] == 0.9 and defaults["schedule"] == "alternate"
    assert {"lambda_c", "ema_decay", "shard_buffer", "seed"} <= set(defaults)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_build_every_loss_with_defaults_and_options(name):
    loss_fn = build_loss(name, chunk_size=4, id_space=10, **loss_option_defaults(name))
    assert isinstance(loss_fn, nn.Module) and loss_fn.chunk_size == 4
    assert loss_fn.uses_logit_bias == (name == "siglip")
    assert loss_fn.needs_sample_ids == (name == "decl")
    assert not loss_fn.needs_momentum_features


def test_unknown_names_and_options_are_value_errors():
    with pytest.raises(ValueError, match="'triplet'.*infonce"):
        build_loss("triplet")
    with pytest.raises(ValueError, match="'tau'.*tau_plus"):
        build_loss("debiased", tau=0.1)
    with pytest.raises(ValueError, match="none"):
        build_loss("infonce", sigma=1.0)
    with pytest.raises(ValueError, match="triplet"):
        loss_option_defaults("triplet")
    with pytest.raises(ValueError, match="chunk_size"):
        build_loss("dcl", chunk_size=-1)


def test_rejects_mismatched_shapes_and_single_pair():
    loss_fn = build_loss("infonce")
    with pytest.raises(ValueError, match="features"):
        loss_fn(torch.zeros(4, 3), torch.zeros(5, 3), 10.0)
    with pytest.raises(ValueError, match="at least 2"):
        loss_fn(torch.ones(1, 3), torch.ones(1, 3), 10.0)
