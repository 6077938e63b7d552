"""DeCL ``u_mode=sample``: the count of forwards without ``step=`` is in ``state_dict``.

Those forwards (Python API use) seed their draws by the count; it was not saved, so a restored
loss repeated the draws of a fresh one. State dicts written before it was saved still load.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlcontrast.losses import build_loss

OPTIONS = {"estimator": "batch", "u_mode": "sample", "schedule": "loss1"}


def pairs():
    x = F.normalize(torch.randn(6, 8, generator=torch.Generator().manual_seed(0)), dim=1)
    y = F.normalize(torch.randn(6, 8, generator=torch.Generator().manual_seed(1)), dim=1)
    return x, y


def draw(loss_fn):
    x, y = pairs()
    return float(loss_fn(x, y, torch.tensor(10.0))["U"])


def test_a_restored_loss_continues_the_draws():
    original = build_loss("decl", **OPTIONS)
    first = [draw(original) for _ in range(3)]
    state = original.state_dict()
    assert int(state["unstepped_draws"]) == 3
    restored = build_loss("decl", **OPTIONS)
    restored.load_state_dict(state)
    assert draw(restored) == draw(original) != first[0]
    assert draw(restored) == draw(original)


def test_a_state_dict_without_the_count_still_loads():
    """Written before the count was saved: it loads (strictly) and the count starts at 0."""
    original = build_loss("decl", gamma=0.5, u_mode="sample", schedule="loss1", id_space=12)
    x, y = pairs()
    original(x, y, torch.tensor(10.0), sample_ids=torch.arange(6), step=1)
    state = original.state_dict()
    assert set(state) == {"log_u", "visited", "unstepped_draws"}
    del state["unstepped_draws"]
    restored = build_loss("decl", gamma=0.5, u_mode="sample", schedule="loss1", id_space=12)
    restored.load_state_dict(state)
    torch.testing.assert_close(restored.log_u, original.log_u)
    fresh = build_loss("decl", gamma=0.5, u_mode="sample", schedule="loss1", id_space=12)
    fresh.load_state_dict(state)
    assert draw(restored.eval()) == draw(fresh.eval())


def test_other_configurations_keep_their_keys():
    assert set(build_loss("decl", id_space=4).state_dict()) == {"log_u", "visited"}
    assert set(build_loss("decl", estimator="batch").state_dict()) == set()
    assert set(build_loss("sogclr", id_space=4).state_dict()) == {"log_u", "visited"}


def test_a_bad_count_is_refused():
    state = {"unstepped_draws": torch.tensor(-1)}
    with pytest.raises(RuntimeError, match="unstepped_draws: expected a non-negative integer"):
        build_loss("decl", **OPTIONS).load_state_dict(state)
