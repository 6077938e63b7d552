"""The engine from its sections: ``TrainConfig``, ``DeepSpeedConfig`` and the optimizer.

:func:`deepspeed_config` writes the DeepSpeed config of a run (saved next to it as
``deepspeed.json``; ``deepspeed.overrides`` is merged into it last); :func:`build_engine` wraps the
model, the optimizer of :mod:`vlcontrast.train.optimizer` and the precision of
:mod:`vlcontrast.train.precision` into a DeepSpeed engine, or, where ``train.engine``
(:func:`engine_kind`) picks it, into :class:`~vlcontrast.train.torch_engine.TorchEngine`. The rest are the engine-side helpers the
loop needs: open_clip's logit-scale clamp on the fp32 master copy, scalar parameters made
DeepSpeed-safe, the parameter count under ZeRO-3.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from typing import Any

import torch

from vlcontrast.config import (CUDAGRAPH_MODES, DeepSpeedConfig, OptimConfig, TrainConfig,
                               torch_engine_blocker)
from vlcontrast.distributed import set_gpu_defaults
from vlcontrast.errors import ConfigError
from vlcontrast.train.optimizer import (FLAT_ALIGN, FiniteCheckedAdamW, build_optimizer,
                                        unstep_schedule)
from vlcontrast.train.precision import Precision


def deepspeed_config(train: TrainConfig, deepspeed: DeepSpeedConfig, *, micro_batch_size: int,
                     grad_clip: float, world_size: int, accelerator: str | None = None,
                     trainable_parameters: int | None = None,
                     load_universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed config of a run; ``accelerator`` (default: DeepSpeed's) is "cuda" or "cpu";
    ``trainable_parameters`` sizes ZeRO's gradient buckets (:func:`bucket_elements`);
    ``load_universal``: the run resumes a universal checkpoint (ZeRO 1-3 with another world size,
    :func:`vlcontrast.checkpoints.universal_resume`)."""
    if accelerator is None:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator().device_name()
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        # The loss of an accumulated step is computed once over all micro-batches (GradCache), and
        # the k feature-gradient backward passes accumulate into one optimizer step.
        "gradient_accumulation_steps": train.accum_steps,
        "train_batch_size": micro_batch_size * train.accum_steps * world_size,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": deepspeed.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer synchronises the device at the start and end of every
        # step (two host syncs a step) only to print samples/s, which the step logger measures.
        "timers": {"throughput": {"enabled": False}},
        **Precision(train.precision).deepspeed_entries(),
    }
    zero = ds["zero_optimization"]
    if deepspeed.zero_stage >= 1 and trainable_parameters is not None:
        zero["reduce_bucket_size"] = bucket_elements(trainable_parameters)
        if deepspeed.zero_stage <= 2:
            zero["allgather_bucket_size"] = bucket_elements(trainable_parameters)
    if deepspeed.zero_stage == 3:
        # Keep the small CLIP parameters (logit_scale, norms) whole: they are read every step.
        zero["stage3_param_persistence_threshold"] = 10**5
    if deepspeed.zero_stage >= 1 and accelerator == "cuda":
        # EVA-CLIP's settings: reduce gradient buckets on a side stream while the backward goes
        # on, into one contiguous buffer (no fragmentation). CPU has no streams to overlap on.
        zero["overlap_comm"] = True
        zero["contiguous_gradients"] = True
    if load_universal:
        ds["checkpoint"] = {"load_universal": True}
    return _merge(ds, deepspeed.overrides)


BATCH_ENTRIES = ("train_batch_size", "train_micro_batch_size_per_gpu",
                 "gradient_accumulation_steps")
"""The DeepSpeed entries :func:`deepspeed_config` sets from ``data.batch_size``,
``train.accum_steps`` and the ranks (the loop's GradCache step is built on them)."""


class _ReadKeys(dict):
    """A dict that records the keys looked up in it (``get``, ``[]``, ``in``, ``keys()``): what
    DeepSpeed's config reads is what it knows, whatever its version."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read: set = set()

    def get(self, key, *default):
        self.read.add(key)
        return super().get(key, *default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def keys(self):
        outer = self

        class Keys:
            def __contains__(self, key):
                outer.read.add(key)
                return dict.__contains__(outer, key)

            def __iter__(self):
                return iter(dict.keys(outer))

            def __len__(self):
                return dict.__len__(outer)

        return Keys()


def _deepspeed_error(err: Exception) -> str:
    """DeepSpeed's (or its pydantic models') refusal on one line, without the links."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        try:
            found = errors()
            title = getattr(err, "title", "")
            parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}"
                     for e in found]
            return f"{title}: {'; '.join(parts)}" if title else "; ".join(parts)
        except Exception:  # noqa: BLE001 -- not pydantic's after all: its text below
            pass
    lines = [line.strip() for line in str(err).splitlines()
             if line.strip() and not line.strip().startswith("For further information")]
    return " ".join(lines) or type(err).__name__


def check_deepspeed_overrides(train: TrainConfig, deepspeed: DeepSpeedConfig, *,
                              micro_batch_size: int, grad_clip: float, world_size: int) -> None:
    """``deepspeed.overrides`` checked by DeepSpeed's own config class before any model is built
    (the preflight): a top-level key DeepSpeed does not read (it would be ignored without a
    word) is refused with the keys it reads; an override of the batch entries vlcontrast sets is
    refused unless it agrees; a value DeepSpeed refuses (``zero_optimization.stage: 9``) is one
    line naming the override, not a traceback from ``deepspeed.initialize``."""
    if not deepspeed.overrides:
        return
    import logging

    from deepspeed.runtime.config import DeepSpeedConfig as DeepSpeedSchema
    from deepspeed.utils.logging import logger as deepspeed_logger

    from vlcontrast.config import _did_you_mean

    plain = dataclasses.replace(deepspeed, overrides={})
    ours = deepspeed_config(train, plain, micro_batch_size=micro_batch_size, grad_clip=grad_clip,
                            world_size=world_size)
    for key in BATCH_ENTRIES:
        if key in deepspeed.overrides and deepspeed.overrides[key] != ours[key]:
            raise ConfigError(
                f"deepspeed.overrides.{key}={deepspeed.overrides[key]!r}: vlcontrast sets it "
                f"({key}={ours[key]} from data.batch_size={micro_batch_size} x "
                f"train.accum_steps={train.accum_steps} x {world_size} rank(s)); set those "
                f"instead and drop deepspeed.overrides.{key}")
    # DeepSpeed's config reads its world size from its own process group, which may not exist
    # yet: the batch entries agree (above), so the size is left to it to derive.
    ours.pop("train_batch_size", None)

    def refusal(config: dict) -> Exception | None:
        try:
            DeepSpeedSchema(config)
        except (ValueError, TypeError, KeyError, AssertionError, AttributeError) as err:
            return err
        return None

    level = deepspeed_logger.level
    deepspeed_logger.setLevel(logging.WARNING)  # its config logs its world size at INFO
    try:
        seen = _ReadKeys(ours)
        if refusal(seen) is not None:
            return  # vlcontrast's own config is refused here: not the overrides' doing
        known = {key for key in seen.read if isinstance(key, str)}
        if {"train_micro_batch_size_per_gpu", "zero_optimization"} <= known:  # it did read
            for key, value in deepspeed.overrides.items():
                if key not in known:
                    raise ConfigError(
                        f"deepspeed.overrides.{key}={value!r}: not a DeepSpeed setting"
                        f"{_did_you_mean(key, known)} (DeepSpeed would ignore it); its "
                        f"top-level keys: {', '.join(sorted(known))}")
        if refusal(_merge(ours, deepspeed.overrides)) is None:
            return
        for key, value in deepspeed.overrides.items():  # the override DeepSpeed refuses
            err = refusal(_merge(ours, {key: value}))
            if err is not None:
                raise ConfigError(f"deepspeed.overrides.{key}={value!r}: DeepSpeed refuses it "
                                  f"({_deepspeed_error(err)}); fix it or drop it")
        err = refusal(_merge(ours, deepspeed.overrides))
        raise ConfigError(f"deepspeed.overrides={deepspeed.overrides!r}: DeepSpeed refuses them "
                          f"together ({_deepspeed_error(err)}); fix them or drop one")
    finally:
        deepspeed_logger.setLevel(level)


DEFAULT_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default ``reduce_bucket_size``/``allgather_bucket_size`` (elements)."""


def bucket_elements(trainable_parameters: int) -> int:
    """ZeRO's gradient bucket size for a model of ``trainable_parameters``.

    DeepSpeed's default holds two 5e8-element fp32 buckets (4 GB a GPU) whatever the model; for a
    CLIP model that is several times the whole gradient. A quarter of the trainable parameters
    gives about four buckets a backward (so the reduction of one overlaps the next one's
    computation), at least 1e6 elements (or the whole model when smaller), at most the default;
    a multiple of 64 (ZeRO asks for a multiple of its NCCL alignment factor)."""
    quarter = trainable_parameters // 4
    elements = min(DEFAULT_BUCKET_ELEMENTS, max(quarter, min(trainable_parameters, 1_000_000), 1))
    return int(-(-elements // 64) * 64)


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


def num_parameters(model: torch.nn.Module) -> int:
    """Parameter count, also for ZeRO-3 partitioned parameters (``ds_numel``)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def forget_stale_deepspeed_groups() -> None:
    """Drop DeepSpeed's cached clone of the world group when it belongs to a process group that
    was torn down. DeepSpeed clones the world group on its first engine and keeps it for the
    process's life; a process that destroys its group and initialises another (a notebook, a
    test session, cells run one after another in one process) would otherwise hand the next
    engine a group torch no longer knows ("Group ... is not registered")."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    cached = getattr(groups, "_WORLD_GROUP", None)
    if cached is None:
        return
    try:
        alive = dist.is_initialized() and bool(dist.get_process_group_ranks(cached))
    except (KeyError, ValueError, RuntimeError):
        alive = False
    if not alive:
        groups._WORLD_GROUP = None


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


DEPRECATED_COLLECTIVES = (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                          r"is deprecated\. Please use `torch\.distributed\."
                          r"(all_gather_single|reduce_scatter_single)` instead\.")
"""The FutureWarnings torch (2.14) gives for the collectives DeepSpeed's ZeRO calls: ZeRO 3 at
every start (partitioning the model) and at its gathers and reduce-scatters after."""


def quiet_deepspeed_collectives() -> None:
    """Hide torch's deprecation warnings of the collectives DeepSpeed calls
    (:data:`DEPRECATED_COLLECTIVES`): DeepSpeed's calls, not ours, and harmless (the old names
    still run). Only those messages, only as FutureWarnings from ``torch.distributed``; every
    other warning is shown as before."""
    warnings.filterwarnings("ignore", message=DEPRECATED_COLLECTIVES, category=FutureWarning,
                            module=r"torch\.distributed\.")


def deepspeed_logs_as_lines() -> None:
    """DeepSpeed's logger has its own handler (stdout, ``[time] [WARNING] [file:line:func] ...``)
    and does not propagate, so its warnings skip the one-line format of every other warning.
    Where the root logger has handlers (the CLI's, a test runner's), DeepSpeed's records go there
    instead (``deepspeed: warning: ...``); a program without them keeps DeepSpeed's own output."""
    import logging

    from deepspeed.utils.logging import logger

    if not logging.getLogger().handlers:
        return
    for handler in list(logger.handlers):
        if type(handler) is logging.StreamHandler:  # DeepSpeed's own console handler
            logger.removeHandler(handler)
    logger.propagate = True


def model_device(model: torch.nn.Module) -> torch.device:
    """The device the model's parameters live on (the loop moves the model there first)."""
    return next(model.parameters()).device


def flat_align(train: TrainConfig, deepspeed: DeepSpeedConfig) -> int:
    """Elements to align the optimizer groups' parameters to (:func:`parameter_groups`):
    :data:`FLAT_ALIGN` when DeepSpeed lays each group out in one flat buffer (ZeRO 1-3, or the
    bf16/fp16 master-copy optimizers), else 1 (ZeRO 0 in fp32 or amp_bf16 keeps the parameters
    as they are, and their order stays the model's)."""
    flattened = deepspeed.zero_stage > 0 or Precision(train.precision).master_copy
    return FLAT_ALIGN if flattened else 1


def engine_kind(train: TrainConfig, deepspeed: DeepSpeedConfig) -> str:
    """"torch" or "deepspeed": what ``train.engine`` resolves to for this run (``auto``: the
    plain step of :mod:`vlcontrast.train.torch_engine` wherever it applies)."""
    why_not = torch_engine_blocker(train, deepspeed)
    if train.engine == "torch" and why_not is not None:
        raise ConfigError(f"train.engine='torch': {why_not}; use train.engine=auto or deepspeed")
    if train.engine == "auto":
        return "torch" if why_not is None else "deepspeed"
    return train.engine


def build_engine(model: torch.nn.Module, *, optim: OptimConfig, train: TrainConfig,
                 deepspeed: DeepSpeedConfig, micro_batch_size: int, total_steps: int,
                 world_size: int, load_universal: bool = False):
    """(engine, ds_config): with torch AdamW and a cosine schedule, DeepSpeed's engine and its
    config, or (``train.engine``, :func:`engine_kind`) the plain ZeRO-0 step and None.
    ``load_universal``: see :func:`deepspeed_config`."""
    from vlcontrast.models.norms import keep_batch_norm_statistics_fp32

    kind = engine_kind(train, deepspeed)
    skip_cpu_inference_comm_op()
    forget_stale_deepspeed_groups()
    # Also for the torch engine: the checkpoint files keep one shape whichever engine wrote them.
    vectorise_scalar_parameters(model)
    # bf16/fp16 cast the batch norms' weights but not their running statistics.
    keep_batch_norm_statistics_fp32(model)
    device = model_device(model)
    if device.type == "cuda":
        set_gpu_defaults()
    if kind == "torch":
        from vlcontrast.train.torch_engine import TorchEngine

        optimizer, scheduler = build_optimizer(model, optim, total_steps, finite_checked=True,
                                               align=flat_align(train, deepspeed))
        engine = TorchEngine(model, optimizer, scheduler, accum_steps=train.accum_steps,
                             grad_clip=optim.grad_clip,
                             autocast=Precision(train.precision).autocast,
                             micro_batch_size=micro_batch_size, world_size=world_size)
        if train.compile:
            engine.compile(compile_kwargs=compile_kwargs(train))
        engine.cudagraphs = train.compile and train.compile_mode in CUDAGRAPH_MODES
        return engine, None
    import deepspeed as deepspeed_lib

    quiet_deepspeed_collectives()
    deepspeed_logs_as_lines()
    # ZeRO 0 without DeepSpeed's mixed-precision optimizers: the client optimizer sees the
    # gradients unchecked (amp_bf16 keeps fp32 parameters and uses no DeepSpeed optimizer wrapper).
    plain = deepspeed.zero_stage == 0 and not Precision(train.precision).master_copy
    optimizer, scheduler = build_optimizer(model, optim, total_steps, finite_checked=plain,
                                           align=flat_align(train, deepspeed))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ds_config = deepspeed_config(train, deepspeed, micro_batch_size=micro_batch_size,
                                 grad_clip=optim.grad_clip, world_size=world_size,
                                 accelerator=device.type, trainable_parameters=trainable,
                                 load_universal=load_universal)
    engine, _, _, _ = deepspeed_lib.initialize(model=model, optimizer=optimizer,
                                               lr_scheduler=scheduler, config=ds_config,
                                               dist_init_required=False)
    if world_size == 1 and deepspeed.zero_stage == 0:
        # One rank, no ZeRO: DeepSpeed's gradient all-reduce would flatten every gradient into a
        # bucket, "reduce" it over one process, divide by 1 and copy it back, a quarter of a small
        # model's step on a CPU for gradients equal bit for bit to the ones it was given.
        engine.enable_backward_allreduce = False
    if train.compile:
        # DeepSpeed compiles the wrapped module in place: parameter names (and so checkpoints)
        # stay those of the eager model.
        engine.compile(compile_kwargs=compile_kwargs(train))
    engine.cudagraphs = train.compile and train.compile_mode in CUDAGRAPH_MODES
    return engine, ds_config


def compile_kwargs(train: TrainConfig) -> dict[str, Any]:
    """``torch.compile``'s keyword arguments for ``train.compile_mode`` (none for the default)."""
    return {} if train.compile_mode == "default" else {"mode": train.compile_mode}


def count_skipped(engine, steps: int) -> None:
    """The loop learned that ``steps`` updates were skipped on the device (:class:`FiniteCheckedAdamW`):
    DeepSpeed counted them as applied and advanced its lr scheduler, so take those back. DeepSpeed's
    own optimizers (ZeRO 1-3, bf16/fp16) told it on the host; nothing to correct there."""
    if steps <= 0 or not isinstance(engine.optimizer, FiniteCheckedAdamW):
        return
    unstep_schedule(engine.lr_scheduler, steps)
    engine.skipped_steps += steps


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
