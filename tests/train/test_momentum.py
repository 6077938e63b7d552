"""DeCL's momentum towers: the EMA copy is fp32 and moves by exactly ``(1 - decay)`` of its
distance to the live weights each step, also when the live towers train in bf16 (a bf16 copy
rounds such an update to nothing)."""

from __future__ import annotations

import pytest
import torch

from vlcontrast.train.momentum import MomentumTowers


def _live_bf16():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).to(torch.bfloat16)


def test_ema_moves_by_the_expected_amount_under_bf16():
    live = _live_bf16()
    towers = MomentumTowers(live, decay=0.999)
    assert all(p.dtype == torch.float32 for p in towers.model.parameters())
    start = [p.detach().clone() for p in towers.model.parameters()]
    with torch.no_grad():  # the live weights move away by a step that bf16 can represent
        for param in live.parameters():
            param.add_(0.01 * torch.sign(torch.randn_like(param)))
    steps = 5
    for _ in range(steps):
        towers.update(live)
    for before, ema, target in zip(start, towers.model.parameters(), live.parameters()):
        target = target.detach().float()
        # closed form of `steps` updates toward a fixed target
        expected = target + (before - target) * 0.999 ** steps
        moved, wanted = (ema - before).abs().mean(), (expected - before).abs().mean()
        assert wanted > 0
        torch.testing.assert_close(ema, expected, rtol=0, atol=1e-7)
        assert float(moved / wanted) == pytest.approx(1.0, abs=1e-3)


def test_a_bf16_copy_would_not_have_moved():
    """The failure the fp32 copy avoids: the same update applied to a bf16 tensor is lost."""
    live = _live_bf16()
    ema = [p.detach().clone() for p in live.parameters()]
    with torch.no_grad():
        for param in live.parameters():
            param.add_(0.01 * torch.sign(torch.randn_like(param)))
    before = [e.clone() for e in ema]
    torch._foreach_lerp_(ema, [p.detach() for p in live.parameters()], 0.001)
    moved = sum(float((e.float() - b.float()).abs().sum()) for e, b in zip(ema, before))
    wanted = sum(float((p.detach().float() - b.float()).abs().sum()) * 0.001
                 for p, b in zip(live.parameters(), before))
    assert moved < 0.1 * wanted


def test_state_round_trip_and_zero3_refusal():
    from vlcontrast.config import ConfigError

    live = _live_bf16()
    towers = MomentumTowers(live, decay=0.99)
    towers.update(live)
    other = MomentumTowers(_live_bf16(), decay=0.99)
    other.load_state_dict(towers.state_dict())
    for a, b in zip(towers.model.parameters(), other.model.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ConfigError, match="zero_stage <= 2"):
        MomentumTowers(live, decay=0.99, zero_stage=3)


def test_the_momentum_copy_drops_the_live_engines_hooks_and_keeps_ours():
    """A deep copy of engine.module carries DeepSpeed's forward hooks; on the EMA copy they would
    run DeepSpeed's bookkeeping (and its host reads) in every momentum forward."""
    import torch

    from vlcontrast.train.momentum import MomentumTowers

    live = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    calls = []

    def deepspeed_like_hook(module, inputs):  # stands in for DeepSpeed's pre-forward hook
        calls.append("foreign")

    live[0].register_forward_pre_hook(deepspeed_like_hook)
    live.register_forward_hook(lambda module, inputs, output: calls.append("foreign-post"))
    ours = lambda module, inputs: calls.append("ours")  # noqa: E731
    ours.__module__ = "vlcontrast.models"
    live[1].register_forward_pre_hook(ours)
    towers = MomentumTowers(live, 0.9)
    towers.model(torch.ones(1, 2))
    assert calls == ["ours"]
    live(torch.ones(1, 2))  # the live module keeps all of its hooks
    assert calls == ["ours", "foreign", "ours", "foreign-post"]
