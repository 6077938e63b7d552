"""Precision: the generated DeepSpeed config per ``train.precision``, amp_bf16's fp32 parameters,
gradients and reductions, the logit-scale clamp acting on the fp32 master under every ZeRO stage,
and both shipped tower families (ResNet, ViT) training under every precision the CPU supports."""

from __future__ import annotations

import math
import types

import pytest
import torch

from tests.distributed import run_distributed

LN_100 = math.log(100.0)


def _config(**overrides):
    from vlcontrast.config import load_config

    values = [f"{k.replace('__', '.')}={v}" for k, v in overrides.items()]
    return load_config(None, ["data.train=x", "train.steps=10"] + values)


def _ds(config, accelerator):
    from vlcontrast.train.engine import deepspeed_config

    return deepspeed_config(config.train, config.deepspeed, micro_batch_size=config.data.batch_size,
                            grad_clip=config.optim.grad_clip, world_size=8,
                            accelerator=accelerator)


def test_precisions_and_input_dtypes():
    from vlcontrast.config import PRECISIONS, ConfigError
    from vlcontrast.train.precision import Precision

    assert PRECISIONS == ("fp32", "amp_bf16", "bf16", "fp16")
    assert [Precision(p).parameter_dtype for p in PRECISIONS] == [
        torch.float32, torch.float32, torch.bfloat16, torch.float16]
    with pytest.raises(ConfigError, match="train.precision='fp8'"):
        Precision("fp8").parameter_dtype
    with pytest.raises(ConfigError, match="train.precision='bf32'.*amp_bf16"):
        _config(train__precision="bf32")


def test_amp_bf16_config_is_torch_autocast_with_fp32_reductions():
    ds = _ds(_config(train__precision="amp_bf16", deepspeed__zero_stage=2), "cpu")
    assert not ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    # No module is "lower-precision safe": DeepSpeed then reduces every gradient in fp32.
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16",
                                    "lower_precision_safe_modules": []}
    for precision in ("fp32", "bf16", "fp16"):
        assert "torch_autocast" not in _ds(_config(train__precision=precision), "cpu")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gpu_defaults_in_the_deepspeed_config(stage):
    cuda = _ds(_config(deepspeed__zero_stage=stage), "cuda")["zero_optimization"]
    cpu = _ds(_config(deepspeed__zero_stage=stage), "cpu")["zero_optimization"]
    assert "overlap_comm" not in cpu and "contiguous_gradients" not in cpu
    if stage == 0:
        assert "overlap_comm" not in cuda
    else:
        assert cuda["overlap_comm"] is True and cuda["contiguous_gradients"] is True
    # deepspeed.overrides still win over the defaults.
    config = _config(deepspeed__zero_stage=stage,
                     **{"deepspeed.overrides.zero_optimization.overlap_comm": "false"})
    assert _ds(config, "cuda")["zero_optimization"]["overlap_comm"] is False


def test_gpu_defaults_set_tf32_and_cudnn_benchmark():
    """TF32 through the API torch.compile and user code read back: after set_gpu_defaults,
    get_float32_matmul_precision() and matmul.allow_tf32 answer (the per-backend
    fp32_precision attributes would make both raise)."""
    from vlcontrast.distributed import set_gpu_defaults

    saved = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.benchmark)
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = False, False
        set_gpu_defaults()
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.backends.cudnn.allow_tf32 is True and torch.backends.cudnn.benchmark is True
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved[1], saved[2]


def test_build_engine_sets_gpu_defaults_only_for_cuda_models(monkeypatch):
    """build_engine reads the model's device: a CUDA model gets the GPU defaults and the CUDA
    DeepSpeed config (device and DeepSpeed mocked)."""
    import deepspeed

    from vlcontrast.train import engine as engine_module

    calls, configs = [], []
    monkeypatch.setattr(engine_module, "set_gpu_defaults", lambda: calls.append("gpu"))
    monkeypatch.setattr(deepspeed, "initialize",
                        lambda **kw: configs.append(kw["config"])
                        or (types.SimpleNamespace(), None, None, None))
    config = _config(deepspeed__zero_stage=1)
    sections = dict(optim=config.optim, train=config.train, deepspeed=config.deepspeed,
                    micro_batch_size=config.data.batch_size, total_steps=10, world_size=2)
    engine_module.build_engine(torch.nn.Linear(4, 4), **sections)
    assert calls == [] and "overlap_comm" not in configs[-1]["zero_optimization"]

    monkeypatch.setattr(engine_module, "model_device", lambda model: torch.device("cuda"))
    engine_module.build_engine(torch.nn.Linear(4, 4), **sections)
    assert calls == ["gpu"] and configs[-1]["zero_optimization"]["overlap_comm"] is True


# --------------------------------------------------------------------------------------------
# the logit-scale clamp acts on the fp32 master


class _ScaleModel(torch.nn.Module):
    """A weight and open_clip's ``logit_scale``; the loss pushes ``logit_scale`` up."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.logit_scale = torch.nn.Parameter(torch.tensor(4.0))

    def forward(self, x):
        return self.linear(x).float().pow(2).mean() - 10.0 * self.logit_scale.float().sum()


def _master_value(engine, param) -> float:
    from deepspeed.utils import safe_get_full_fp32_param

    master = safe_get_full_fp32_param(param)  # collective under ZeRO 1-3: every rank calls it
    if master is None and hasattr(engine.optimizer, "fp32_groups"):
        # ZeRO 0 bf16: DeepSpeed's unfused optimizer, an fp32 master per parameter.
        masters = [m for group, fp32 in zip(engine.optimizer.fp16_groups,
                                            engine.optimizer.fp32_groups)
                   for p, m in zip(group, fp32) if p is param]
        master = masters[0]
    if master is None:  # ZeRO 0 in fp32 / amp_bf16: the parameter is its own master
        master = param
    return float(master.detach().float().reshape(-1)[0])


def _clamp_under_every_stage(rank, world_size, combinations):
    import deepspeed

    from vlcontrast.train.engine import build_engine, clamp_logit_scale
    from vlcontrast.train.precision import Precision

    outcome = {}
    for stage, precision in combinations:
        torch.manual_seed(0)
        # lr 1 with Adam: logit_scale moves by about 1 per step, from 4.0 to past ln 100.
        config = _config(deepspeed__zero_stage=stage, train__precision=precision,
                         data__batch_size=2, optim__lr=1.0, optim__warmup_steps=0,
                         optim__weight_decay=0.0)
        engine, _ = build_engine(_ScaleModel(), optim=config.optim, train=config.train, deepspeed=config.deepspeed,
                             micro_batch_size=config.data.batch_size, total_steps=10, world_size=world_size)
        param = engine.module.logit_scale
        values = []
        for _ in range(3):
            loss = engine(torch.ones(2, 4, dtype=Precision(precision).parameter_dtype))
            engine.backward(loss)
            engine.step()
            clamp_logit_scale(engine)
            master = _master_value(engine, param)
            if hasattr(param, "ds_id"):
                with deepspeed.zero.GatheredParameters([param]):
                    working = float(param.detach().float().reshape(-1)[0])
            else:
                working = float(param.detach().float().reshape(-1)[0])
            values.append((master, working, str(param.dtype)))
        outcome[(stage, precision)] = values
    return outcome


CLAMP_COMBINATIONS = [(stage, precision) for precision in ("fp32", "amp_bf16", "bf16")
                      for stage in (0, 1, 2, 3)]


@pytest.mark.slow
def test_logit_scale_clamp_holds_on_the_master_under_every_stage():
    outcomes = run_distributed(_clamp_under_every_stage, 2, CLAMP_COMBINATIONS, timeout=600)
    for combination in CLAMP_COMBINATIONS:
        ranks = [outcome[combination] for outcome in outcomes]
        assert ranks[0] == ranks[1], combination
        for step, (master, working, dtype) in enumerate(ranks[0]):
            # Without clamping the master, step 2 would start from the unclamped 5.0 and reach 6.
            assert master == pytest.approx(LN_100, abs=1e-6), (combination, step)
            low = {"torch.bfloat16": torch.bfloat16}.get(dtype, torch.float32)
            assert working == float(torch.tensor(master).to(low)), (combination, step)
            assert working <= LN_100 + 1e-6, (combination, step)


# --------------------------------------------------------------------------------------------
# both tower families train under every precision


def _train_towers(rank, world_size, cases):
    from vlcontrast.train.step import skip_flag

    from vlcontrast.config import ModelConfig
    from vlcontrast.losses import build_loss
    from vlcontrast.models import build_model
    from vlcontrast.train.engine import build_engine
    from vlcontrast.train.precision import Precision

    outcome = {}
    for model_name, precision, stage in cases:
        torch.manual_seed(0)
        bundle = build_model(ModelConfig(name=model_name))
        # fp16: a small initial loss scale, so the first steps are not loss-scale overflows (at
        # DeepSpeed's default 2^16 the three steps of this test all overflow on CPUs with fp16).
        config = _config(deepspeed__zero_stage=stage, train__precision=precision,
                         data__batch_size=8, optim__lr=1e-3, optim__warmup_steps=0,
                         **{"deepspeed.overrides.fp16.initial_scale_power": 4})
        engine, _ = build_engine(bundle.model, optim=config.optim, train=config.train,
                                 deepspeed=config.deepspeed,
                                 micro_batch_size=config.data.batch_size, total_steps=10,
                                 world_size=world_size)
        loss_fn = build_loss("infonce")
        size = bundle.model_config["model_cfg"]["vision_cfg"]["image_size"]
        images = torch.rand(8, 3, size, size, generator=torch.Generator().manual_seed(1))
        texts = bundle.tokenizer([f"caption number {i}" for i in range(8)])
        norms = [m for m in engine.module.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        stats_before = [m.running_mean.clone() for m in norms]
        weights_before = [p.detach().float().clone() for p in engine.module.parameters()]
        losses, applied = [], []
        for _ in range(3):
            out = engine(images.to(Precision(precision).parameter_dtype), texts)
            result = loss_fn(out["image_features"], out["text_features"], out["logit_scale"],
                             sample_ids=torch.arange(8))
            engine.backward(result["loss"])
            engine.step()
            losses.append(float(result["loss"]))
            # The step's own flag: ZeRO 0 fp32/amp_bf16 decide on the device (found_inf).
            applied.append(not bool(skip_flag(engine, torch.device("cpu"))[0]))
        outcome[(model_name, precision, stage)] = {
            "losses": losses, "applied": applied,
            "feature_dtype": str(out["image_features"].dtype),
            "param_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
            # ZeRO 1/2 keep one gradient-reduction bucket per communication dtype.
            "reduce_dtypes": sorted(str(d) for d in getattr(engine.optimizer, "ipg_buckets", {})),
            "moved": sum(not torch.equal(a, p.detach().float())
                         for a, p in zip(weights_before, engine.module.parameters())),
            "bn": len(norms),
            "bn_stats_fp32": all(m.running_mean.dtype == torch.float32 for m in norms),
            "bn_stats_moved": all(not torch.equal(a, m.running_mean)
                                  for a, m in zip(stats_before, norms)),
        }
    return outcome


TOWER_PRECISIONS = ["fp32", "amp_bf16", "bf16", "fp16"]


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["vlc-rn-micro", "vlc-micro"], ids=["resnet", "vit"])
def test_every_tower_family_trains_under_every_precision(model_name):
    from deepspeed.accelerator import get_accelerator

    from vlcontrast.config import ConfigError
    from vlcontrast.train.precision import Precision

    precisions = list(TOWER_PRECISIONS)
    if not get_accelerator().is_fp16_supported():
        # This CPU has no fp16 kernels: the run is refused at start, naming the setting.
        with pytest.raises(ConfigError, match="train.precision='fp16'.*not support fp16"):
            Precision("fp16").check_supported(torch.device("cpu"))
        precisions.remove("fp16")
    # ZeRO 1 is what the shipped CC3M configs use; ZeRO 0 bf16 is DeepSpeed's separate bf16 path.
    cases = [(model_name, precision, 1) for precision in precisions] + [(model_name, "bf16", 0)]
    outcome = run_distributed(_train_towers, 1, cases, timeout=600)[0]
    for case in cases:
        result = outcome[case]
        precision = case[1]
        assert all(math.isfinite(v) for v in result["losses"]), (case, result)
        assert all(result["applied"]), (case, result)
        assert result["moved"] > 0, case
        expected_params = "torch.float32" if precision in ("fp32", "amp_bf16") else \
            {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
        assert result["param_dtypes"] == [expected_params], (case, result)
        # amp_bf16 computes the forward in bf16 under autocast, with fp32 weights.
        if precision == "amp_bf16":
            assert result["feature_dtype"] == "torch.bfloat16", case
            # ... and reduces every gradient in fp32 (DeepSpeed's default module list would add a
            # bf16 bucket for the Linear and Conv weights).
            assert result["reduce_dtypes"] == ["torch.float32"], (case, result["reduce_dtypes"])
        if model_name == "vlc-rn-micro":
            assert result["bn"] > 0 and result["bn_stats_fp32"] and result["bn_stats_moved"], case
