"""``train.engine=torch``: the ZeRO-0 step without DeepSpeed's wrapper does DeepSpeed's arithmetic.

Checked against DeepSpeed's own engine (the reference): gradients after the backward on 2 ranks
(averaged, as DeepSpeed averages), whole trainings on 1 and 2 ranks (GradCache, amp_bf16,
clipping, DeCL's state), checkpoints written by one engine resumed by the other, and the one-line
refusals.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed import default_backend, run_distributed
from tests.train.helpers import checkpoint_weights, max_difference, read_metrics


def _engine(kind: str, model, world_size: int, **train):
    from vlcontrast.config import DeepSpeedConfig, OptimConfig, TrainConfig
    from vlcontrast.train.engine import build_engine

    engine, ds_config = build_engine(model, optim=OptimConfig(grad_clip=0.5, warmup_steps=1),
                                     train=TrainConfig(steps=4, engine=kind, **train),
                                     deepspeed=DeepSpeedConfig(), micro_batch_size=3,
                                     world_size=world_size, total_steps=4)
    return engine, ds_config


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))


def _gradients_and_weights(rank, world_size, kinds):
    """Per engine: the gradients right after the first backward (reduced over the ranks), and
    the weights after 3 updates; each rank feeds its own batch."""
    out = {}
    for kind in kinds:
        engine, ds_config = _engine(kind, _model(), world_size)
        grads = None
        for step in range(3):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            engine.backward(engine(x).pow(2).sum() * (1 + rank))
            if step == 0:
                grads = [p.grad.detach().clone().tolist() for p in engine.module.parameters()]
            engine.step()
        weights = [p.detach().clone().tolist() for p in engine.module.parameters()]
        out[kind] = (type(engine).__name__, ds_config is None, grads, weights,
                     [float(v) for v in engine.get_lr()], engine.global_steps)
    return out


def _close(a, b, tol):
    return max(float((torch.tensor(x) - torch.tensor(y)).abs().max()) for x, y in zip(a, b)) <= tol


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_torch_engine_reduces_clips_and_updates_as_deepspeeds_does(world_size):
    outcomes = run_distributed(_gradients_and_weights, world_size, ("deepspeed", "torch"),
                               timeout=300, backend=default_backend())
    for out in outcomes:
        ds_name, ds_none, ds_grads, ds_weights, ds_lr, ds_steps = out["deepspeed"]
        name, none, grads, weights, lr, steps = out["torch"]
        assert (ds_name, ds_none, name, none) == ("DeepSpeedEngine", False, "TorchEngine", True)
        # The ranks' losses differ (weighted 1 and 2): a sum, or no reduction, shows here.
        assert _close(grads, ds_grads, 1e-6), "gradients after the backward"
        assert _close(weights, ds_weights, 1e-5), "weights after 3 clipped updates"
        assert lr == pytest.approx(ds_lr) and steps == ds_steps == 3
    # The data-parallel contract: every rank holds the same gradients and weights.
    assert all(out["torch"][2:4] == outcomes[0]["torch"][2:4] for out in outcomes)


def _unused_parameter(rank, world_size):
    from vlcontrast.errors import ConfigError

    class WithSpare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.towers, self.unused = _model(), torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.towers(x)

    engine, _ = _engine("torch", WithSpare(), world_size)
    engine.backward(engine(torch.ones(3, 4)).sum())
    try:
        engine.step()
    except ConfigError as err:
        return str(err)
    return None


def test_a_parameter_without_a_gradient_is_a_one_line_error_under_ddp():
    messages = run_distributed(_unused_parameter, 2, timeout=300, backend=default_backend())
    for message in messages:
        assert message and "\n" not in message
        assert "'unused.weight'" in message and "train.engine=deepspeed" in message


def test_an_explicit_torch_engine_is_refused_where_it_does_not_apply():
    from vlcontrast.config import load_config
    from vlcontrast.errors import ConfigError

    base = ["data.train=x", "train.steps=1", "train.engine=torch"]
    for extra, why in ((["deepspeed.zero_stage=2"], "zero_stage=2"),
                       (["train.precision=bf16"], "master-copy"),
                       (["deepspeed.overrides={wall_clock_breakdown: true}"], "overrides")):
        with pytest.raises(ConfigError, match=f"train.engine='torch': .*{why}.*deepspeed"):
            load_config(None, base + extra)
    load_config(None, base + ["train.precision=amp_bf16"])


def test_auto_picks_the_torch_engine_only_where_it_applies():
    from vlcontrast.config import DeepSpeedConfig, TrainConfig
    from vlcontrast.train.engine import engine_kind

    assert engine_kind(TrainConfig(steps=1), DeepSpeedConfig()) == "torch"
    assert engine_kind(TrainConfig(steps=1, precision="amp_bf16"), DeepSpeedConfig()) == "torch"
    assert engine_kind(TrainConfig(steps=1, precision="fp16"), DeepSpeedConfig()) == "deepspeed"
    assert engine_kind(TrainConfig(steps=1), DeepSpeedConfig(zero_stage=1)) == "deepspeed"
    assert engine_kind(TrainConfig(steps=1), DeepSpeedConfig(overrides={"a": 1})) == "deepspeed"
    assert engine_kind(TrainConfig(steps=1, engine="deepspeed"), DeepSpeedConfig()) == "deepspeed"


# -- whole trainings ------------------------------------------------------------------------------

RUNS = {
    "fp32": {},
    # GradCache over 2 micro-batches (the temperature's gradient on the reduced pass), bf16
    # autocast and an engaged clip.
    "amp_bf16_accum2_clip": {"train__precision": "amp_bf16", "train__accum_steps": 2,
                             "optim__grad_clip": 0.05},
    "decl": {"loss__name": "decl"},
    # DeCL's momentum towers: an EMA copy of the towers beside the DDP-wrapped model.
    "decl_momentum": {"loss__name": "decl", "loss__estimator": "momentum"},
    # A distillation projection: a model parameter the loss uses outside the towers' forward,
    # its gradient on GradCache's reduced pass.
    "distill_projection_accum2": {"distill__teacher": "vlc-tiny", "distill__kind": "features",
                                  "distill__projection": True, "train__accum_steps": 2},
    # Losses that leave a trainable parameter without a gradient, which DDP must still reduce:
    # SogCLR keeps its own temperature (logit_scale unused), InfoNCE ignores a logit_bias;
    # with and without GradCache.
    "sogclr": {"loss__name": "sogclr"},
    "infonce_unused_bias_accum2": {"model__init_logit_bias": -10.0, "train__accum_steps": 2},
}


def _train_both(rank, world_size, data_dir, out_root, teacher):
    from tests.train.helpers import tiny_config
    from vlcontrast.train import train

    for name, extra in RUNS.items():
        if "distill__teacher" in extra:
            extra = {**extra, "distill__teacher_pretrained": str(teacher)}
        for kind in ("deepspeed", "torch"):
            train(tiny_config(data_dir, out_root / name / kind, train__steps=4,
                              train__engine=kind, checkpoint__every=4, **extra))


@pytest.mark.slow
def test_trainings_under_both_engines_end_with_the_same_weights(synthetic_data, tmp_path):
    from vlcontrast.config import ModelConfig
    from vlcontrast.models import build_model

    torch.manual_seed(7)
    teacher = tmp_path / "teacher.pt"
    torch.save(build_model(ModelConfig(name="vlc-tiny")).model.state_dict(), teacher)
    run_distributed(_train_both, 2, synthetic_data, tmp_path, teacher, timeout=900,
                    backend=default_backend())
    for name in RUNS:
        reference = checkpoint_weights(tmp_path / name / "deepspeed")
        weights = checkpoint_weights(tmp_path / name / "torch")
        # Measured on gloo: equal bit for bit in fp32, 3e-8 apart under amp_bf16 with GradCache.
        assert max_difference(reference, weights) <= 1e-6, name
        if "distill" in name:  # the projection trained, the same under both engines
            assert "distill_projection.weight" in weights
        for kind in ("deepspeed", "torch"):
            results = json.loads((tmp_path / name / kind / "results.json").read_text())
            assert results["engine"] == kind
        torch_losses = [r["loss"] for r in read_metrics(tmp_path / name / "torch", "train")]
        ds_losses = [r["loss"] for r in read_metrics(tmp_path / name / "deepspeed", "train")]
        assert torch_losses == pytest.approx(ds_losses, rel=1e-4, abs=1e-5), name
        assert "grad_norm" in read_metrics(tmp_path / name / "torch", "train")[-1]
        assert not (tmp_path / name / "torch" / "deepspeed.json").exists()
        assert (tmp_path / name / "deepspeed" / "deepspeed.json").is_file()


def _resume_across(rank, world_size, data_dir, out_root):
    from tests.train.helpers import tiny_config
    from vlcontrast.train import StopRequested, train

    train(tiny_config(data_dir, out_root / "full", train__steps=6, checkpoint__every=3,
                      train__engine="deepspeed"))
    for first, second in (("deepspeed", "torch"), ("torch", "deepspeed")):
        run = out_root / f"{first}_then_{second}"
        try:
            train(tiny_config(data_dir, run, train__steps=6, train__stop_at_step=3,
                              train__engine=first))
        except StopRequested:
            pass
        train(tiny_config(data_dir, run, train__steps=6, train__resume="latest",
                          train__engine=second))


@pytest.mark.slow
def test_a_checkpoint_of_either_engine_resumes_under_the_other(synthetic_data, tmp_path):
    run_distributed(_resume_across, 1, synthetic_data, tmp_path, timeout=600,
                    backend=default_backend())
    full = checkpoint_weights(tmp_path / "full")
    midway = torch.load(tmp_path / "full" / "checkpoints" / "step_00000003" / "model.pt",
                        weights_only=True)
    assert max_difference(full, midway) > 1e-4  # the second half moved the weights
    for run in ("deepspeed_then_torch", "torch_then_deepspeed"):
        # The optimizer's moments and the schedule came across (a fresh optimizer would land
        # far from the uninterrupted run); measured: equal bit for bit.
        assert max_difference(full, checkpoint_weights(tmp_path / run)) <= 1e-6, run


def _cuda_steps(rank, world_size, precision):
    """Per engine: 3 clipped steps of a small model on this rank's GPU; the first gradients and
    the final weights (as lists) and where they lived."""
    from vlcontrast.config import DeepSpeedConfig, OptimConfig, TrainConfig
    from vlcontrast.train.engine import build_engine

    out = {}
    for kind in ("deepspeed", "torch"):
        model = _model().cuda()
        engine, _ = build_engine(model, optim=OptimConfig(grad_clip=0.5, warmup_steps=1),
                                 train=TrainConfig(steps=4, engine=kind, precision=precision),
                                 deepspeed=DeepSpeedConfig(), micro_batch_size=3,
                                 world_size=world_size, total_steps=4)
        grads = None
        for step in range(3):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step)).cuda()
            engine.backward(engine(x).float().pow(2).sum())
            if step == 0:
                grads = [p.grad.detach().float().cpu().tolist() for p in engine.module.parameters()]
            engine.step()
        torch.cuda.synchronize()
        out[kind] = (grads, [p.detach().float().cpu().tolist() for p in engine.module.parameters()],
                     {p.device.type for p in engine.module.parameters()})
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "amp_bf16"])
def test_on_a_gpu_the_torch_engine_steps_as_deepspeeds_does(precision):
    """The CUDA path (one GPU, NCCL): autocast on the device, the fused kernel's found_inf, the
    clip without a host-built scalar; gradients and weights as DeepSpeed's engine makes them."""
    (out,) = run_distributed(_cuda_steps, 1, precision, timeout=300, backend="nccl")
    (ds_grads, ds_weights, ds_devices), (grads, weights, devices) = out["deepspeed"], out["torch"]
    assert ds_devices == devices == {"cuda"}
    assert _close(grads, ds_grads, 1e-6) and _close(weights, ds_weights, 1e-5)


def test_a_zero_partitioned_checkpoint_is_refused_not_resumed_with_a_fresh_optimizer(tmp_path):
    """A ZeRO 1-3 checkpoint's model-states file holds no optimizer (it is in the ranks'
    partition files): the torch engine says so instead of resuming with new moments."""
    from vlcontrast.errors import CheckpointError

    engine, _ = _engine("torch", _model(), 1)
    folder = tmp_path / "engine"
    folder.mkdir()
    torch.save({"module": engine.module.state_dict(), "optimizer": None, "lr_scheduler": None},
               folder / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match="not in this file .*ZeRO 1-3.*zero_stage that wrote"):
        engine.load_checkpoint(str(tmp_path), tag="engine")
    # A lost file is lost (the format was checked against the checkpoint's config.yaml before):
    # the checkpointer names it and the checkpoint before it (test_checkpoint.py).
    with pytest.raises(FileNotFoundError) as lost:
        engine.load_checkpoint(str(tmp_path), tag="elsewhere")
    assert lost.value.filename == str(tmp_path / "elsewhere" / "mp_rank_00_model_states.pt")
