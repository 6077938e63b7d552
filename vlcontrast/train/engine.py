"""DeepSpeed engine from our config: parameter groups, AdamW, cosine schedule, generated ds config.

The optimizer is plain ``torch.optim.AdamW`` handed to DeepSpeed (no JIT-built fused optimizers, so
the same code runs on CPU and GPU); weight decay skips gains, biases, embeddings' norms and
``logit_scale``/``logit_bias`` (open_clip's rule). The generated DeepSpeed config is saved next to
the run as ``deepspeed.json``; ``deepspeed.overrides`` is merged into it last.

Non-finite gradients. DeepSpeed's ZeRO (1, 2, 3) and bf16/fp16 optimizers check the reduced
gradients themselves: on inf/NaN the update is skipped on every rank, the lr schedule does not
advance and ``engine.was_step_applied()`` is False. Its plain fp32 path (ZeRO 0, fp32) hands the
gradients to the client optimizer unchecked; :class:`FiniteCheckedAdamW` gives that path the same
contract, so the loop has one test for every stage and precision.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from vlcontrast import distributed as dist_utils
from vlcontrast.config import ConfigError, RunConfig


class FiniteCheckedAdamW(torch.optim.AdamW):
    """AdamW that skips its update on every rank alike when any gradient is non-finite.

    DeepSpeed reads ``optimizer.overflow`` after ``step()``: when it is True the step counts as
    skipped (``engine.skipped_steps``) and the lr scheduler is not stepped, exactly as for its own
    mixed-precision optimizers. The flag is all-reduced, so one rank's NaN skips every rank.
    """

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.overflow = False

    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        local_bad = bool(grads) and not bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all())
        self.overflow = dist_utils.any_rank(local_bad)
        if self.overflow:
            return None
        return super().step(closure)


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    def exempt(name: str, param: torch.nn.Parameter) -> bool:
        return (param.ndim < 2 or "bn" in name or "ln" in name or "bias" in name
                or "logit_scale" in name or "logit_bias" in name)

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if not exempt(n, p)]
    no_decay = [p for n, p in named if exempt(n, p)]
    return [{"params": no_decay, "weight_decay": 0.0},
            {"params": decay, "weight_decay": weight_decay}]


def cosine_with_warmup(warmup_steps: int, total_steps: int, min_ratio: float = 0.0):
    """LR multiplier: linear warmup from 1/warmup to 1, then cosine down to ``min_ratio``."""

    def factor(step: int) -> float:  # LambdaLR passes the number of completed steps
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def deepspeed_config(config: RunConfig, world_size: int) -> dict[str, Any]:
    train = config.train
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": config.data.batch_size,
        # The loss of an accumulated step is computed once over all micro-batches (GradCache), and
        # the k feature-gradient backward passes accumulate into one optimizer step.
        "gradient_accumulation_steps": train.accum_steps,
        "train_batch_size": config.data.batch_size * train.accum_steps * world_size,
        "gradient_clipping": config.optim.grad_clip,
        "zero_optimization": {"stage": config.deepspeed.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": train.precision == "bf16"},
        "fp16": {"enabled": train.precision == "fp16", "loss_scale": 0,
                 "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                 "min_loss_scale": 1},
    }
    if config.deepspeed.zero_stage == 3:
        # Keep the small CLIP parameters (logit_scale, norms) whole so clamping stays simple.
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 10**5
    return _merge(ds, config.deepspeed.overrides)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


SCALAR_PARAMS_ATTR = "_vlcontrast_scalar_params"


def vectorise_scalar_parameters(model: torch.nn.Module) -> list[str]:
    """Give 0-dim parameters (open_clip's ``logit_scale``/``logit_bias``) shape ``[1]``.

    DeepSpeed's initial parameter broadcast views every parameter as bytes, which fails for 0-dim
    tensors. Shape ``[1]`` broadcasts identically in the model's forward; the names are recorded so
    checkpoints written for open_clip get the original shape back (:func:`open_clip_state_dict`).
    """
    names = []
    for name, param in model.named_parameters():
        if param.ndim == 0:
            param.data = param.data.reshape(1)
            names.append(name)
    setattr(model, SCALAR_PARAMS_ATTR, names)
    return names


def open_clip_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Undo :func:`vectorise_scalar_parameters` on a state dict."""
    for name in getattr(model, SCALAR_PARAMS_ATTR, []):
        if name in state:
            state[name] = state[name].reshape(())
    return state


def check_precision(precision: str, device: torch.device) -> None:
    """Fail at start, not deep inside DeepSpeed, when the device cannot train in ``precision``."""
    if precision == "fp32":
        return
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    supported = (accelerator.is_fp16_supported() if precision == "fp16"
                 else accelerator.is_bf16_supported())
    if not supported:
        raise ConfigError(f"train.precision={precision!r}: DeepSpeed's {accelerator.device_name()} "
                          f"accelerator does not support {precision} on this {device.type} device; "
                          "use train.precision=bf16 or fp32")


def num_parameters(model: torch.nn.Module) -> int:
    """Parameter count, also for ZeRO-3 partitioned parameters (``ds_numel``)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def skip_cpu_inference_comm_op() -> None:
    """Keep DeepSpeed's CPU backend from JIT-building its shared-memory all-reduce op.

    The op serves only ``inference_all_reduce``; training reduces through torch.distributed. On
    CPU DeepSpeed compiles it at the first ``initialize`` of every process (and first probes every
    op with compiler runs), which costs a minute per launch and serialises concurrent launches on
    the extension cache's lock. DeepSpeed loads the op only when ``deepspeed.ops``' compatibility
    table lists it; a table set beforehand is used as is.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu" and "__compatible_ops__" not in vars(deepspeed.ops):
        deepspeed.ops.__compatible_ops__ = {}


def build_engine(model: torch.nn.Module, config: RunConfig, total_steps: int, world_size: int):
    """(engine, ds_config): DeepSpeed engine with torch AdamW and a cosine schedule."""
    import deepspeed

    skip_cpu_inference_comm_op()
    vectorise_scalar_parameters(model)
    optim = config.optim
    plain_fp32 = config.deepspeed.zero_stage == 0 and config.train.precision == "fp32"
    optimizer_class = FiniteCheckedAdamW if plain_fp32 else torch.optim.AdamW
    # torch's fused AdamW (CPU and CUDA kernels shipped with torch, nothing JIT-built): one pass over
    # the parameters instead of a dozen; 8x faster per step than the loop form on CPU.
    optimizer = optimizer_class(parameter_groups(model, optim.weight_decay), lr=optim.lr,
                                betas=optim.betas, eps=optim.eps, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_with_warmup(optim.warmup_steps, total_steps, optim.min_lr / optim.lr))
    ds_config = deepspeed_config(config, world_size)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config, dist_init_required=False)
    if config.train.compile:
        # DeepSpeed compiles the wrapped module in place: parameter names (and so checkpoints)
        # stay those of the eager model.
        engine.compile()
    return engine, ds_config


def clamp_logit_scale(engine, max_scale: float = 100.0) -> None:
    """open_clip's rule: keep s = exp(logit_scale) in [1, 100] after every step."""
    module = engine.module
    param = getattr(module, "logit_scale", None)
    if param is None:
        return
    if hasattr(param, "ds_id"):  # ZeRO-3 partitioned parameter
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            with torch.no_grad():
                param.clamp_(0, math.log(max_scale))
        return
    with torch.no_grad():
        param.clamp_(0, math.log(max_scale))


def read_logit_scale(engine) -> float:
    """exp(logit_scale) as a float (gathers the parameter under ZeRO-3; collective there)."""
    param = getattr(engine.module, "logit_scale", None)
    if param is None:
        return float("nan")
    if hasattr(param, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return float(param.detach().float().exp().reshape(-1)[0])
    return float(param.detach().float().exp().reshape(-1)[0])
