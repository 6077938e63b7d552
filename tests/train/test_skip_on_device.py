"""A skipped step decided on the device changes nothing, even before the host learns of it.

``FiniteCheckedAdamW`` flags non-finite gradients on the device and torch's fused kernel skips the
update; the learning rate follows the schedule by *applied* step on the device; the losses' buffers
and the momentum towers' copy are conditioned on the same flag; the loop learns of the skip only at
the next log step and then corrects its counters (vlcontrast/train/loop.py, ``_settle``)."""

from __future__ import annotations

import pytest
import torch

from tests.train.helpers import read_metrics, tiny_config


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))


def test_a_non_finite_gradient_skips_the_fused_update_and_the_schedule_on_the_device():
    from vlcontrast.config import OptimConfig
    from vlcontrast.train.optimizer import build_optimizer, cosine_with_warmup

    optim = OptimConfig(lr=1e-2, warmup_steps=2, weight_decay=0.1)
    checked, checked_schedule = build_optimizer(model := _model(), optim, 8, finite_checked=True)
    reference_model = _model()
    reference, _ = build_optimizer(reference_model, optim, 8, finite_checked=False)
    x = torch.randn(5, 4)
    factor = cosine_with_warmup(2, 8)
    applied = 0
    for attempt in range(5):
        before = [p.detach().clone() for p in model.parameters()]
        model(x).square().sum().backward()
        bad = attempt in (1, 2)
        if bad:
            model[0].weight.grad[0, 0] = float("inf" if attempt == 1 else "nan")
        checked.step()
        checked_schedule.step()  # DeepSpeed steps it on every attempt: the device lr ignores it
        checked.zero_grad()
        assert float(checked.found_inf) == float(bad)
        assert not checked.overflow  # DeepSpeed's host bool is never set
        if bad:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            continue
        # The reference: plain fused AdamW, stepped only on applied steps, at the schedule's lr.
        for group in reference.param_groups:
            group["lr"] = group["initial_lr"] * factor(applied)
        reference_model(x).square().sum().backward()
        reference.step()
        reference.zero_grad()
        applied += 1
        for a, b in zip(model.parameters(), reference_model.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
        assert float(checked.state[model[0].weight]["step"]) == applied
    # The groups' host learning rates stay floats (DeepSpeed's get_lr, checkpoints).
    assert all(isinstance(group["lr"], float) for group in checked.param_groups)
    # A step with no gradient at all checks nothing: no flag left over from the last bad one.
    model(x).square().sum().backward()
    model[0].weight.grad[0, 0] = float("nan")
    checked.step()
    checked.zero_grad()
    assert float(checked.found_inf) == 1.0
    checked.step()
    assert checked.found_inf is None


def test_unstep_schedule_takes_back_the_skipped_advances():
    from vlcontrast.config import OptimConfig
    from vlcontrast.train.optimizer import build_optimizer, cosine_with_warmup, unstep_schedule

    optimizer, schedule = build_optimizer(_model(), OptimConfig(lr=1e-2, warmup_steps=2), 8,
                                          finite_checked=True)
    for _ in range(5):
        optimizer.step()  # no gradients: nothing to update
        schedule.step()
    unstep_schedule(schedule, 2)
    assert schedule.last_epoch == 3
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * cosine_with_warmup(2, 8)(3))
    assert schedule.get_last_lr()[0] == optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("skipped", [0.0, 1.0])
def test_buffer_rows_are_rolled_back_on_the_device_only_when_skipped(skipped):
    from vlcontrast.losses import build_loss

    loss_fn = build_loss("decl", id_space=16)
    torch.manual_seed(0)
    image = torch.nn.functional.normalize(torch.randn(6, 8), dim=-1)
    text = torch.nn.functional.normalize(torch.randn(6, 8), dim=-1)
    ids = torch.tensor([1, 3, 3, 5, 7, 9])
    loss_fn(image, text, torch.tensor(10.0), sample_ids=ids, step=1)
    first = {k: v.clone() for k, v in loss_fn.state_dict().items()}
    loss_fn(image.flip(0), text, torch.tensor(10.0), sample_ids=ids, step=2)
    second = {k: v.clone() for k, v in loss_fn.state_dict().items()}
    assert any(not torch.equal(first[k], second[k]) for k in first)
    loss_fn.rollback_where(torch.tensor(skipped))
    expected = first if skipped else second
    for key, value in loss_fn.state_dict().items():
        assert torch.equal(value, expected[key]), key
    loss_fn.rollback_where(torch.tensor(1.0))  # a second call does nothing
    for key, value in loss_fn.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_momentum_towers_do_not_move_on_a_skipped_step():
    from vlcontrast.train.momentum import MomentumTowers

    live = _model()
    towers = MomentumTowers(live, 0.9)
    with torch.no_grad():
        for p in live.parameters():
            p.add_(1.0)
    before = [p.clone() for p in towers.model.parameters()]
    towers.update(live, torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, towers.model.parameters()))
    towers.update(live, torch.tensor(0.0))
    for a, b, p in zip(before, towers.model.parameters(), live.parameters()):
        torch.testing.assert_close(b, a + 0.1 * (p - a))


def _nan_gradients_at(attempts):
    """Make the loop's losses give NaN gradients (finite loss) at the given attempts."""
    from tests.train.test_faults import _inject

    _inject(lambda attempt: "gradients" if attempt in attempts else None)


@pytest.fixture
def restore_build_loss():
    import vlcontrast.losses as losses
    import vlcontrast.train.loop as loop

    real = losses.build_loss
    yield
    losses.build_loss = loop.build_loss = getattr(losses, "_uninjected_build_loss", real)


def test_the_loop_learns_of_a_skip_at_the_next_log_step_and_counts_it_exactly(
        synthetic_data, tmp_path, restore_build_loss):
    """One rank, ZeRO 0 fp32 (the device-decided path), DeCL (a buffer), log every 3 steps: the
    skip at attempt 2 is logged as step 2, the run still makes 6 applied steps, and lr,
    ``skipped_steps`` and the checkpoint's step are those of 6 applied steps."""
    from vlcontrast.train import train
    from vlcontrast.train.optimizer import cosine_with_warmup

    _nan_gradients_at({2})
    out = tmp_path / "run"
    train(tiny_config(synthetic_data, out, train__steps=6, train__log_every=3,
                      optim__warmup_steps=10, loss__name="decl", checkpoint__every=3))
    skips = read_metrics(out, "skip")
    assert [(r["step"], r["skipped"]) for r in skips] == [(2, "gradients")]
    records = read_metrics(out, "train")
    assert [r["step"] for r in records] == [3, 6]
    assert records[-1]["skipped_steps"] == 1
    assert records[-1]["lr"] == pytest.approx(5e-4 * cosine_with_warmup(10, 6)(5))  # step 6's
    assert records[-1]["samples_seen"] == 6 * 8
    # The loss's similarity diagnostics are computed at log steps (and only there).
    assert all("positive_similarity" in r for r in records)
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [
        "step_00000003", "step_00000006"]


def test_similarity_diagnostics_are_left_out_when_turned_off():
    from vlcontrast.losses import build_loss

    loss_fn = build_loss("infonce")
    image = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)
    text = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)
    full = loss_fn(image, text, torch.tensor(10.0))
    loss_fn.diagnostics = False
    lean = loss_fn(image, text, torch.tensor(10.0))
    assert "positive_similarity" in full and set(lean) == {"loss"}
    assert torch.equal(full["loss"], lean["loss"])
