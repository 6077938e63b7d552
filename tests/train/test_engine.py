"""The generated DeepSpeed config, the precision check, and the non-finite-gradient contract:
for every ZeRO stage and precision, a NaN gradient on one rank skips the update on every rank,
leaves the weights and the lr schedule where they were, and the next step applies."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed


def _config(**overrides):
    from vlcontrast.config import load_config

    values = [f"{k.replace('__', '.')}={v}" for k, v in overrides.items()]
    return load_config(None, ["data.train=x", "train.steps=10"] + values)


def test_deepspeed_config_follows_our_config_and_merges_overrides():
    from vlcontrast.train.engine import deepspeed_config

    config = _config(deepspeed__zero_stage=2, train__precision="bf16", train__accum_steps=4,
                     data__batch_size=16, optim__grad_clip=1.0,
                     **{"deepspeed.overrides.zero_optimization.reduce_bucket_size": 1000,
                        "deepspeed.overrides.wall_clock_breakdown": "true"})
    ds = deepspeed_config(config.train, config.deepspeed, micro_batch_size=config.data.batch_size,
                          grad_clip=config.optim.grad_clip, world_size=8)
    assert ds["train_batch_size"] == 16 * 4 * 8
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 1.0
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    # Overrides merge into nested sections instead of replacing them.
    assert ds["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}
    assert ds["wall_clock_breakdown"] is True


def test_precision_check_names_the_setting(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    from vlcontrast.config import ConfigError
    from vlcontrast.train.precision import Precision

    Precision("fp32").check_supported(torch.device("cpu"))
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: False)
    with pytest.raises(ConfigError, match="train.precision='fp16'.*use train.precision=bf16"):
        Precision("fp16").check_supported(torch.device("cpu"))


def _combinations():
    """Every ZeRO stage x fp32/bf16, and fp16 where DeepSpeed's accelerator supports it (GPUs; its
    CPU accelerator only on CPUs with AVX512-FP16)."""
    from deepspeed.accelerator import get_accelerator

    precisions = ("fp32", "bf16") + (("fp16",) if get_accelerator().is_fp16_supported() else ())
    return [(stage, precision) for precision in precisions for stage in (0, 1, 2, 3)]


def _nan_gradient_on_one_rank(rank, world_size, combinations):
    from vlcontrast.train.engine import build_engine, count_skipped
    from vlcontrast.train.step import skip_flag

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    outcome = {}
    for stage, precision in combinations:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
        # fp16: a small initial loss scale, so step 1 is not a loss-scale overflow.
        config = _config(deepspeed__zero_stage=stage, train__precision=precision,
                         data__batch_size=2, optim__warmup_steps=5,
                         **{"deepspeed.overrides.fp16.initial_scale_power": 4})
        engine, _ = build_engine(model, optim=config.optim, train=config.train, deepspeed=config.deepspeed,
                             micro_batch_size=config.data.batch_size, total_steps=10, world_size=world_size)
        # Under ZeRO-3 a rank holds its shard of each parameter in ``ds_tensor``.
        def weights():
            return [getattr(p, "ds_tensor", p).detach().float().clone()
                    for p in engine.module.parameters()]

        steps = []
        for step in range(3):
            before = weights()
            loss = engine(torch.ones(2, 4, dtype=dtypes[precision])).float().pow(2).sum()
            if step == 1 and rank == 1:
                loss = loss * float("nan")
            engine.backward(loss)
            engine.step()
            # What the loop does: the step's device flag (ZeRO 0 fp32: decided by the fused
            # kernel's found_inf, unknown to DeepSpeed), read, and the skip counted back.
            skipped, _ = skip_flag(engine, torch.device("cpu"))
            applied = not bool(skipped)
            if not applied:
                count_skipped(engine, 1)
            after = weights()
            moved = any(not torch.equal(a, b) for a, b in zip(before, after))
            steps.append((applied, moved, engine.get_lr()[0]))
        outcome[(stage, precision)] = steps
    return outcome


@pytest.mark.slow
def test_nan_gradient_on_one_rank_skips_the_step_on_every_rank():
    combinations = _combinations()
    outcomes = run_distributed(_nan_gradient_on_one_rank, 2, combinations, timeout=400)
    for combination in combinations:
        ranks = [outcome[combination] for outcome in outcomes]
        assert ranks[0] == ranks[1], combination  # the same decision and lr on both ranks
        (applied_1, moved_1, lr_1), (applied_2, moved_2, lr_2), (applied_3, moved_3, lr_3) = ranks[0]
        assert applied_1 and moved_1, combination
        assert not applied_2 and lr_2 == lr_1, combination
        assert not moved_2, combination
        assert applied_3 and lr_3 > lr_1, combination


def test_zero_buckets_are_sized_from_the_trainable_parameters():
    """ZeRO-1/2's two gradient buckets are DeepSpeed's 5e8 elements (4 GB a GPU) whatever the
    model unless set: vlcontrast sizes them from the trainable parameter count."""
    from vlcontrast.train.engine import DEFAULT_BUCKET_ELEMENTS, bucket_elements, deepspeed_config

    assert bucket_elements(151_000_000) == 37_750_016  # ViT-B-32: about four buckets
    assert bucket_elements(300_000) == 300_032 and bucket_elements(3_000_000) == 1_000_000
    assert bucket_elements(10**10) == DEFAULT_BUCKET_ELEMENTS
    assert all(bucket_elements(n) % 64 == 0 for n in (1, 3, 999, 123_457, 10**9))
    for stage in (1, 2, 3):
        config = _config(deepspeed__zero_stage=stage)
        zero = deepspeed_config(config.train, config.deepspeed, micro_batch_size=4, grad_clip=0.0,
                                world_size=2, accelerator="cpu",
                                trainable_parameters=151_000_000)["zero_optimization"]
        assert zero["reduce_bucket_size"] == 37_750_016
        assert zero.get("allgather_bucket_size") == (37_750_016 if stage <= 2 else None)
    config = _config(deepspeed__zero_stage=2,
                     **{"deepspeed.overrides.zero_optimization.reduce_bucket_size": 1000})
    zero = deepspeed_config(config.train, config.deepspeed, micro_batch_size=4, grad_clip=0.0,
                            world_size=2, accelerator="cpu",
                            trainable_parameters=151_000_000)["zero_optimization"]
    assert zero["reduce_bucket_size"] == 1000  # an override still wins


def test_deepspeeds_throughput_timer_is_off():
    """Its start and stop synchronise the device every step (two host syncs) to print samples/s."""
    from vlcontrast.train.engine import deepspeed_config

    config = _config()
    ds = deepspeed_config(config.train, config.deepspeed, micro_batch_size=4, grad_clip=0.0,
                          world_size=1, accelerator="cuda")
    assert ds["timers"] == {"throughput": {"enabled": False}}


def test_locked_towers_under_16_bit_parameters_are_refused_with_the_fix():
    from vlcontrast.config import ConfigError, load_config

    for lock in ("model.lock_image=true", "model.lock_text=true"):
        for precision in ("bf16", "fp16"):
            with pytest.raises(ConfigError, match=r"train.precision=.*16 bits.*use "
                                                  r"train.precision=amp_bf16"):
                load_config(None, ["data.train=x", "train.steps=1", lock,
                                   f"train.precision={precision}"])
        load_config(None, ["data.train=x", "train.steps=1", lock, "train.precision=amp_bf16"])


def _one_rank_steps(rank, world_size, precisions):
    """Weights after 3 steps with DeepSpeed's gradient all-reduce as built and forced on."""
    from vlcontrast.train.engine import build_engine

    out = {}
    for precision in precisions:
        for stage in (0, 1):
            for force in (False, True):
                torch.manual_seed(0)
                model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(),
                                            torch.nn.Linear(8, 2))
                config = _config(deepspeed__zero_stage=stage, train__precision=precision,
                                 data__batch_size=2, optim__warmup_steps=1,
                                 train__engine="deepspeed")
                engine, _ = build_engine(model, optim=config.optim, train=config.train,
                                         deepspeed=config.deepspeed, micro_batch_size=2,
                                         total_steps=10, world_size=world_size)
                built = engine.enable_backward_allreduce
                if force:
                    engine.enable_backward_allreduce = True
                for step in range(3):
                    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
                    engine.backward(engine(x.to(next(engine.module.parameters()).dtype))
                                    .float().pow(2).sum())
                    engine.step()
                weights = [p.detach().float().tolist() for p in engine.module.parameters()]  # plain lists
                out[(precision, stage, force)] = (built, weights)
    return out


def test_one_rank_without_zero_skips_deepspeeds_all_reduce_with_the_same_weights():
    """On one rank the all-reduce returns the gradients it was given: skipping it (a quarter of a
    small model's step) changes no bit; ZeRO keeps it, its optimizer reduces through it."""
    precisions = ("fp32", "bf16")
    (outcome,) = run_distributed(_one_rank_steps, 1, precisions, timeout=300)
    for precision in precisions:
        built, skipped = outcome[(precision, 0, False)]
        _, reduced = outcome[(precision, 0, True)]
        assert built is False, precision
        assert skipped == reduced, precision
        assert outcome[(precision, 1, False)][0] is True, precision


def _two_worlds_in_one_process(rank, world_size):
    """An engine, the group torn down, a new group, another engine: DeepSpeed's cached world
    group of the first world must not reach the second (a stale one raises "not registered")."""
    import os

    import torch.distributed as dist
    from deepspeed.utils import groups

    from tests.distributed import free_port
    from vlcontrast.train.engine import forget_stale_deepspeed_groups

    _engine_for(torch.nn.Linear(4, 2))
    first = groups._WORLD_GROUP
    forget_stale_deepspeed_groups()
    kept = first is not None and groups._WORLD_GROUP is first  # a live group stays cached
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    engine = _engine_for(torch.nn.Linear(4, 2))  # builds on the new world
    engine.backward(engine(torch.ones(3, 4)).sum())
    engine.step()
    fresh = groups._WORLD_GROUP is not None and groups._WORLD_GROUP is not first
    return kept, fresh


def _engine_for(model):
    from vlcontrast.config import DeepSpeedConfig, OptimConfig, TrainConfig
    from vlcontrast.train.engine import build_engine

    engine, _ = build_engine(model, optim=OptimConfig(), train=TrainConfig(steps=2, engine="deepspeed"),
                             deepspeed=DeepSpeedConfig(), micro_batch_size=3, world_size=1,
                             total_steps=2)
    return engine


def test_a_new_process_group_gets_a_fresh_deepspeed_world_group():
    ((kept, fresh),) = run_distributed(_two_worlds_in_one_process, 1)
    assert kept and fresh


TORCH_DEPRECATIONS = [  # what torch 2.14 printed at every ZeRO-3 start, from DeepSpeed's calls
    "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
    "`torch.distributed.all_gather_single` instead.",
    "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
    "`torch.distributed.reduce_scatter_single` instead."]


def test_only_torchs_deprecations_of_deepspeeds_collectives_are_quiet():
    """The filter hides exactly those two texts, as torch emits them (FutureWarning, module
    torch.distributed.c10d_logger); another FutureWarning, the same text from elsewhere or of
    another category still shows."""
    import warnings

    import torch.distributed as dist

    from vlcontrast.train.engine import quiet_deepspeed_collectives

    def emit(text, category=FutureWarning, module="torch.distributed.c10d_logger"):
        warnings.warn_explicit(text, category, f"{module.replace('.', '/')}.py", 83, module=module)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for collective in (dist.all_gather_into_tensor, dist.reduce_scatter_tensor):
            # torch warns, then refuses: no process group (ValueError), or one left by another
            # test in this process, whose sizes these tensors do not fit (RuntimeError)
            with pytest.raises((ValueError, RuntimeError)):
                collective(torch.zeros(2), torch.zeros(1))
    assert [str(w.message) for w in seen] == TORCH_DEPRECATIONS  # torch's own texts
    assert {(w.category, w.filename.endswith("c10d_logger.py")) for w in seen} == {
        (FutureWarning, True)}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_deepspeed_collectives()
        for collective in (dist.all_gather_into_tensor, dist.reduce_scatter_tensor):
            with pytest.raises((ValueError, RuntimeError)):
                collective(torch.zeros(2), torch.zeros(1))
        for text in TORCH_DEPRECATIONS:
            emit(text)
        emit("`torch.distributed.reduce_op` is deprecated, please use "
             "`torch.distributed.ReduceOp` instead", module="torch.distributed.distributed_c10d")
        emit(TORCH_DEPRECATIONS[0], module="vlcontrast.losses.base")
        emit(TORCH_DEPRECATIONS[1], category=DeprecationWarning)
    assert [(str(w.message)[:40], w.category) for w in seen] == [
        ("`torch.distributed.reduce_op` is depreca", FutureWarning),
        (TORCH_DEPRECATIONS[0][:40], FutureWarning),
        (TORCH_DEPRECATIONS[1][:40], DeprecationWarning)]


def _zero3_start_warnings(rank, world_size):
    import warnings

    from vlcontrast.config import DeepSpeedConfig, OptimConfig, TrainConfig
    from vlcontrast.train.engine import build_engine

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine, _ = build_engine(torch.nn.Linear(4, 2), optim=OptimConfig(),
                                 train=TrainConfig(steps=2), deepspeed=DeepSpeedConfig(zero_stage=3),
                                 micro_batch_size=3, world_size=1, total_steps=2)
        engine.backward(engine(torch.ones(3, 4)).sum())
        engine.step()
    return [f"{w.category.__name__}: {w.message}" for w in seen
            if issubclass(w.category, FutureWarning)]


def test_a_zero3_engine_starts_and_steps_without_torchs_deprecation_warnings():
    (future,) = run_distributed(_zero3_start_warnings, 1, timeout=300)
    assert future == []
