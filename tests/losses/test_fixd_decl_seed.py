"""DeCL's ``loss.seed``: its range is checked with one line, and every seed in it draws.

The ``u_mode=sample`` draws of step ``t`` seed a generator with ``seed * 1000003 + t``: above
``2**64 - 1`` torch refused that number with an "Overflow when unpacking long long" traceback at
the first training step. Negative seeds (which earlier runs may have used) stay accepted down to
``-2**43``: torch takes their numbers as ``2**64`` plus them, above every non-negative seed's.
"""

from __future__ import annotations

import pytest
import torch

from tests.losses import references
from vlcontrast.config import load_config
from vlcontrast.errors import ConfigError, LossOptionError
from vlcontrast.losses import build_loss

BASE = ["train.steps=2", "output_dir=runs/fixd", "loss.name=decl", "loss.u_mode=sample"]
SEED_RANGE = (-2**43, 2**43 - 1)  # vlcontrast.losses.decl.SEED_RANGE, written out
REFUSED = [2**63, 2**64, 2**70, -2**43 - 1, -2**63, 2**43, 10**13]


@pytest.mark.parametrize("seed", REFUSED)
def test_a_seed_out_of_range_is_one_config_line(seed):
    with pytest.raises(ConfigError) as caught:
        load_config(None, BASE + [f"loss.seed={seed}"])
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"loss.seed={seed}: must be an integer in [-2**43, 2**43 - 1 = "
                              f"{2**43 - 1}]")
    assert "set loss.seed" in message


@pytest.mark.parametrize("seed", REFUSED)
def test_the_loss_itself_refuses_it(seed):
    with pytest.raises(LossOptionError, match=rf"^decl: seed={seed}: must be an integer in \[-2\*\*43, "):
        build_loss("decl", seed=seed, u_mode="sample", id_space=8)


@pytest.mark.parametrize("seed", [SEED_RANGE[0], -1, 0, 1, SEED_RANGE[1]])
def test_every_seed_in_range_draws_at_any_step(seed):
    assert load_config(None, BASE + [f"loss.seed={seed}"]).loss.options["seed"] == seed
    loss_fn = build_loss("decl", seed=seed, u_mode="sample", id_space=8)
    image, text = references.random_pairs(4, 4)
    for step in (1, 2, 10**17):  # the range leaves room for ~4e17 steps
        loss = loss_fn(image, text, 10.0, sample_ids=torch.arange(4), step=step)["loss"]
        assert torch.isfinite(loss)


def test_seeds_draw_different_noise():
    """Neighbouring seeds at the top of the range still draw their own noise (no wrap)."""
    image, text = references.random_pairs(6, 4)
    losses = []
    for seed in (SEED_RANGE[1] - 1, SEED_RANGE[1]):
        loss_fn = build_loss("decl", seed=seed, u_mode="sample", estimator="batch",
                             schedule="loss1")
        losses.append(loss_fn(image, text, 10.0, step=1)["loss"])
    assert not torch.equal(losses[0], losses[1])


def test_the_written_out_range_is_the_loss_s():
    from vlcontrast.losses import decl

    assert decl.SEED_RANGE == SEED_RANGE


def test_a_negative_seed_draws_noise_of_its_own():
    """-1 (accepted for runs that used it) draws neither seed 0's nor seed 1's noise."""
    image, text = references.random_pairs(6, 4)
    losses = []
    for seed in (-1, 0, 1):
        loss_fn = build_loss("decl", seed=seed, u_mode="sample", estimator="batch",
                             schedule="loss1")
        losses.append(loss_fn(image, text, 10.0, step=1)["loss"])
    assert not torch.equal(losses[0], losses[1]) and not torch.equal(losses[0], losses[2])
