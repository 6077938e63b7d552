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


# -- alignment of the flat buffers DeepSpeed builds from the groups -------------------------------


def _offsets(group):
    """(element offset, numel) of each parameter when the group is laid end to end."""
    out, offset = [], 0
    for p in group["params"]:
        out.append((offset, p.numel()))
        offset += p.numel()
    return out


def test_aligned_groups_put_odd_sized_parameters_last_and_keep_every_view_aligned():
    import open_clip

    model = open_clip.create_model("RN50")
    plain = parameter_groups(model, 0.1)
    aligned = parameter_groups(model, 0.1, align=16)
    # Unaligned, the one-element logit_scale opens the no-decay group: every gain after it is off.
    assert plain[0]["params"][0] is model.logit_scale
    assert sum(offset % 16 != 0 for offset, _ in _offsets(plain[0])) > 200
    for before, after in zip(plain, aligned):
        odd = [p for p in before["params"] if p.numel() % 16]
        even = [p for p in before["params"] if not p.numel() % 16]
        assert [id(p) for p in after["params"]] == [id(p) for p in even + odd]  # stable
        offsets = _offsets(after)
        assert all(offset % 16 == 0 for offset, _ in offsets[:len(even)])
    assert aligned[0]["params"][-1] is model.logit_scale


def test_flat_align_only_where_deepspeed_flattens_the_groups():
    from vlcontrast.config import load_config
    from vlcontrast.train.engine import flat_align
    from vlcontrast.train.optimizer import FLAT_ALIGN

    def align(*overrides):
        config = load_config(None, ["data.train=x", "train.steps=1", *overrides])
        return flat_align(config.train, config.deepspeed)

    # ZeRO 0 in fp32 or amp_bf16 hands the model's own parameters to AdamW: order unchanged.
    assert align() == 1 and align("train.precision=amp_bf16") == 1
    assert align("train.precision=bf16") == FLAT_ALIGN
    assert align("train.precision=fp16") == FLAT_ALIGN
    for stage in (1, 2, 3):
        assert align(f"deepspeed.zero_stage={stage}") == FLAT_ALIGN


class _ClipLike(torch.nn.Module):
    """open_clip's layout in small: the root's own ``logit_scale`` comes first among the
    parameters, then towers whose gains and biases are multiples of 16 elements."""

    def __init__(self):
        super().__init__()
        self.logit_scale = torch.nn.Parameter(torch.ones([]))
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64),
                                        torch.nn.Linear(64, 48), torch.nn.LayerNorm(48))

    def forward(self, x):
        return self.body(x) * self.logit_scale.exp()


def _zero1_view_alignment(rank, world_size, aligned):
    from unittest import mock

    from vlcontrast.config import load_config
    from vlcontrast.train import engine as engine_module

    config = load_config(None, ["data.train=x", "train.steps=2", "data.batch_size=2",
                                "optim.warmup_steps=1", "deepspeed.zero_stage=1"])
    with mock.patch.object(engine_module, "flat_align", lambda *_: 16 if aligned else 1):
        engine, _ = engine_module.build_engine(
            _ClipLike(), optim=config.optim, train=config.train, deepspeed=config.deepspeed,
            micro_batch_size=2, total_steps=2, world_size=world_size)
    # Under ZeRO 1 every parameter is now a view into its group's flat fp32 buffer.
    return {n: p.data_ptr() % 64 for n, p in engine.module.named_parameters() if p.numel() % 16 == 0}


@pytest.mark.slow
def test_under_zero_1_every_even_sized_parameter_view_starts_on_a_64_byte_boundary():
    """What the GPU needs from the alignment, seen on the CPU: the addresses of DeepSpeed's views
    (an H200 stopped with "misaligned address" in an RN50's first batch norm before this)."""
    from tests.distributed import run_distributed

    aligned = run_distributed(_zero1_view_alignment, 1, True, timeout=300)[0]
    plain = run_distributed(_zero1_view_alignment, 1, False, timeout=300)[0]
    assert set(aligned.values()) == {0}, aligned
    assert any(plain.values()), plain  # without it the gains sit 4 bytes off


def test_a_warmup_as_long_as_the_run_is_named_with_where_the_rate_ends():
    """own-data.yaml's warmup_steps=50 with train.steps=40 trained 40 steps below the peak rate
    without a word; the last step's factor is 40/50 of optim.lr (the schedule's own value)."""
    from vlcontrast.train.optimizer import cosine_with_warmup, warmup_note

    assert cosine_with_warmup(50, 40)(39) == pytest.approx(0.8)
    assert warmup_note(OptimConfig(lr=3e-3, warmup_steps=50), 40) == (
        "optim.warmup_steps=50 is longer than the run's 40 steps: the learning rate rises the "
        "whole run and ends at 80% of optim.lr=0.003; lower optim.warmup_steps (e.g. to 4)")
    assert warmup_note(OptimConfig(warmup_steps=41), 40).startswith("optim.warmup_steps=41 is")
    assert warmup_note(OptimConfig(warmup_steps=40), 40) == ""  # the peak at the last step
    assert warmup_note(OptimConfig(warmup_steps=0), 1) == ""


def test_a_resume_with_another_length_names_the_jump_of_the_rate():
    """Raising train.steps at a resume (what "nothing left to train" suggests) laid the cosine out
    anew without a word: at the end of a 10-step run the rate was 0, and step 11 of 14 trains at
    a quarter of the peak."""
    from vlcontrast.train.optimizer import cosine_with_warmup, schedule_change_note

    optim = OptimConfig(lr=1e-3, warmup_steps=2)
    now = 1e-3 * cosine_with_warmup(2, 14)(10)
    assert now == pytest.approx(2.5e-4)
    assert schedule_change_note(optim, 10, 14, 10) == (
        "train.steps=14, the checkpoint's run had 10: the learning-rate schedule is laid out anew "
        "over 14 steps, so step 11 trains at 0.00025 (the old schedule's rate there: 0)")
    assert schedule_change_note(optim, 14, 14, 10) == ""  # the same run resumed
    assert schedule_change_note(optim, 0, 14, 10) == ""   # an epochs run: no step count saved
