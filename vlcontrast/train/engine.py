"""DeepSpeed engine from our config: parameter groups, AdamW, cosine schedule, generated ds config.

The optimizer is plain ``torch.optim.AdamW`` handed to DeepSpeed (no JIT-built fused optimizers, so
the same code runs on CPU and GPU); weight decay skips gains, biases, embeddings' norms and
``logit_scale``/``logit_bias`` (open_clip's rule). The generated DeepSpeed config is saved next to
the run as ``deepspeed.json``; ``deepspeed.overrides`` is merged into it last.

Precision (``train.precision``, docs/training.md "Precision"). ``amp_bf16`` is DeepSpeed's
``torch_autocast`` with no "lower-precision-safe" modules: parameters, gradients, their all-reduce
and accumulation stay fp32 and only the forward computes in bf16 (open_clip's ``amp_bf16``).
``bf16``/``fp16`` are DeepSpeed's own modes: bf16/fp16 parameters and gradients with an fp32 master
copy in the optimizer. :func:`input_dtype` says what the images are cast to.

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

from vlcontrast.config import PRECISIONS, ConfigError, RunConfig


class FiniteCheckedAdamW(torch.optim.AdamW):
    """AdamW that skips its update on every rank alike when any gradient is non-finite.

    DeepSpeed reads ``optimizer.overflow`` after ``step()``: when it is True the step counts as
    skipped (``engine.skipped_steps``) and the lr scheduler is not stepped, exactly as for its own
    mixed-precision optimizers. This optimizer serves only ZeRO 0, where DeepSpeed has already
    all-reduced the gradients before ``step()``: every rank holds the same sum, a NaN on one rank is
    a NaN on all, so the local check agrees everywhere and needs no collective of its own.
    """

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.overflow = False

    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.overflow = bool(grads) and not bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all())
        if self.overflow:
            return None
        return super().step(closure)


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    def exempt(name: str, param: torch.nn.Parameter) -> bool:
        return (param.ndim < 2 or "bn" in name or "ln" in name or "bias" in name
                or "logit_scale" in name or "logit_bias" in name)

    # Locked towers (requires_grad=False) never reach the optimizer: no moments, no master copy.
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ConfigError("nothing to train: every parameter is locked (model.lock_image and "
                          "model.lock_text lock both towers, and logit_scale is frozen)")
    decay = [p for n, p in named if not exempt(n, p)]
    no_decay = [p for n, p in named if exempt(n, p)]
    groups = [{"params": no_decay, "weight_decay": 0.0},
              {"params": decay, "weight_decay": weight_decay}]
    return [group for group in groups if group["params"]]


def cosine_with_warmup(warmup_steps: int, total_steps: int, min_ratio: float = 0.0):
    """LR multiplier: linear warmup from 1/warmup to 1, then cosine down to ``min_ratio``."""

    def factor(step: int) -> float:  # LambdaLR passes the number of completed steps
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def input_dtype(precision: str) -> torch.dtype:
    """The dtype images are cast to before the forward.

    fp32 and amp_bf16 keep fp32 parameters, so the images stay fp32 (autocast casts per op);
    bf16/fp16 parameters need inputs of their own dtype.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision={precision!r}: must be one of {', '.join(PRECISIONS)}")
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def set_gpu_defaults() -> None:
    """open_clip's CUDA settings: TF32 matmuls and convolutions, cuDNN autotuning.

    TF32 keeps fp32 storage and range with a 10-bit mantissa in the tensor-core products (fp32
    runs and amp_bf16's fp32 ops); cuDNN benchmarks its convolution algorithms once per input
    shape, and the training shapes do not change.
    """
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    if hasattr(matmul, "fp32_precision") and hasattr(conv, "fp32_precision"):
        matmul.fp32_precision = "tf32"
        conv.fp32_precision = "tf32"
    else:  # torch < 2.9
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True


def deepspeed_config(config: RunConfig, world_size: int,
                     accelerator: str | None = None) -> dict[str, Any]:
    """The DeepSpeed config of a run; ``accelerator`` (default: DeepSpeed's) is "cuda" or "cpu"."""
    if accelerator is None:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator().device_name()
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
    if train.precision == "amp_bf16":
        # An empty list of lower-precision-safe modules: DeepSpeed then tags no parameter with a
        # bf16 communication dtype, so gradients are reduced and accumulated in fp32 as well.
        ds["torch_autocast"] = {"enabled": True, "dtype": "bfloat16",
                                "lower_precision_safe_modules": []}
    zero = ds["zero_optimization"]
    if config.deepspeed.zero_stage == 3:
        # Keep the small CLIP parameters (logit_scale, norms) whole: they are read every step.
        zero["stage3_param_persistence_threshold"] = 10**5
    if config.deepspeed.zero_stage >= 1 and accelerator == "cuda":
        # EVA-CLIP's settings: reduce gradient buckets on a side stream while the backward goes
        # on, into one contiguous buffer (no fragmentation). CPU has no streams to overlap on.
        zero["overlap_comm"] = True
        zero["contiguous_gradients"] = True
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
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision={precision!r}: must be one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    supported = (accelerator.is_fp16_supported() if precision == "fp16"
                 else accelerator.is_bf16_supported())
    if not supported:
        raise ConfigError(f"train.precision={precision!r}: DeepSpeed's {accelerator.device_name()} "
                          f"accelerator does not support {precision} on this {device.type} device; "
                          "use train.precision=bf16, amp_bf16 or fp32")


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


def model_device(model: torch.nn.Module) -> torch.device:
    """The device the model's parameters live on (the loop moves the model there first)."""
    return next(model.parameters()).device


def build_engine(model: torch.nn.Module, config: RunConfig, total_steps: int, world_size: int):
    """(engine, ds_config): DeepSpeed engine with torch AdamW and a cosine schedule."""
    import deepspeed

    from vlcontrast.models.norms import keep_batch_norm_statistics_fp32

    skip_cpu_inference_comm_op()
    vectorise_scalar_parameters(model)
    # bf16/fp16 cast the batch norms' weights but not their running statistics.
    keep_batch_norm_statistics_fp32(model)
    device = model_device(model)
    if device.type == "cuda":
        set_gpu_defaults()
    optim = config.optim
    # ZeRO 0 without DeepSpeed's mixed-precision optimizers: the client optimizer sees the
    # gradients unchecked (amp_bf16 keeps fp32 parameters and uses no DeepSpeed optimizer wrapper).
    plain_fp32 = config.deepspeed.zero_stage == 0 and config.train.precision in ("fp32", "amp_bf16")
    optimizer_class = FiniteCheckedAdamW if plain_fp32 else torch.optim.AdamW
    # torch's fused AdamW (CPU and CUDA kernels shipped with torch, nothing JIT-built): one pass over
    # the parameters instead of a dozen; 8x faster per step than the loop form on CPU.
    optimizer = optimizer_class(parameter_groups(model, optim.weight_decay), lr=optim.lr,
                                betas=optim.betas, eps=optim.eps, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_with_warmup(optim.warmup_steps, total_steps, optim.min_lr / optim.lr))
    ds_config = deepspeed_config(config, world_size, device.type)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config, dist_init_required=False)
    if config.train.compile:
        # DeepSpeed compiles the wrapped module in place: parameter names (and so checkpoints)
        # stay those of the eager model.
        engine.compile()
    return engine, ds_config


def _master_copies(engine, param: torch.nn.Parameter) -> list[torch.Tensor]:
    """This rank's pieces of ``param``'s fp32 master copy, as views that can be written in place.

    The optimizer updates the master and copies it into the working parameter after each step,
    so a change made only to the working copy is undone at the next step. Local pieces only: no
    collective, no host synchronisation. Empty when the parameter is its own master (ZeRO 0 in
    fp32 or amp_bf16) or when this rank holds none of it.
    """
    if hasattr(param, "ds_id"):  # ZeRO-3: this rank's partition of the fp32 master
        from deepspeed.utils import safe_get_local_fp32_param

        local = safe_get_local_fp32_param(param)
        return [local] if local is not None and local.numel() else []
    mapping = getattr(param, "_hp_mapping", None)  # ZeRO 1/2 and DeepSpeed's bf16 optimizer
    if mapping is not None:
        fragment = mapping.get_hp_fragment()
        return [fragment] if fragment.numel() else []
    optimizer = getattr(engine, "optimizer", None)
    groups = getattr(optimizer, "fp16_groups", None)  # DeepSpeed's ZeRO-0 bf16/fp16 optimizers
    if groups is not None and hasattr(optimizer, "fp32_groups"):
        # Unfused: one fp32 master tensor per parameter, in the same order.
        for group, masters in zip(groups, optimizer.fp32_groups):
            for member, master in zip(group, masters):
                if member is param:
                    return [master.data.view(-1)]
    if groups is not None and hasattr(optimizer, "fp32_groups_flat"):
        # Fused: one flat fp32 master per group, parameters in order.
        for group, flat in zip(groups, optimizer.fp32_groups_flat):
            offset = 0
            for member in group:
                if member is param:
                    return [flat.data.narrow(0, offset, param.numel())]
                offset += member.numel()
    return []


def clamp_logit_scale(engine, max_scale: float = 100.0) -> None:
    """open_clip's rule: keep s = exp(logit_scale) in [1, 100] after every step.

    Clamps the fp32 master copy (which the next step starts from and the optimizer checkpoint
    holds) and the working copy alike, on every rank, with no collective.
    """
    param = getattr(engine.module, "logit_scale", None)
    if param is None:
        return
    high = math.log(max_scale)
    with torch.no_grad():
        for master in _master_copies(engine, param):
            master.clamp_(0, high)
        if hasattr(param, "ds_tensor"):  # ZeRO-3: the partition the next gather reads
            param.ds_tensor.clamp_(0, high)
        if param.numel():  # the working copy (ZeRO-3: present while gathered or persistent)
            param.clamp_(0, high)


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
