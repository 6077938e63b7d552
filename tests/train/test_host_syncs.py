"""Host synchronisations per steady-state step, by who causes them.

A host synchronisation is any point where the CPU waits for the device: reading a tensor's value
(``item``, ``tolist``, ``bool``/``float``/``int`` of a tensor), building a device tensor from host
data (``new_tensor``, ``torch.tensor(..., device=...)``: a blocking copy from pageable memory) and
the accelerator's ``synchronize``. On CPU none of them waits, but each is counted where it happens,
so the count is the one a GPU run would pay. Every call is attributed to the first caller frame
outside ``torch``: DeepSpeed, or a vlcontrast module. Two runs of the same configuration, of 2 and
5 steps, differ only by 3 steady-state steps: their difference divided by 3 is the per-step count.

The limits are the documented ones (docs/training.md, "Host synchronisations"): vlcontrast's own
code reads nothing in a steady-state step (the step's flags stay on the device until a log,
checkpoint or evaluation step, or the end; ``FiniteCheckedAdamW``'s overflow check is a device
flag read by the fused kernel). DeepSpeed's reads at ZeRO 1-3 and in its bf16/fp16 optimizers are
listed there by name; the test pins their number too, so a DeepSpeed upgrade that adds one is
noticed.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

from tests.distributed import default_backend, run_distributed
from vlcontrast.losses import LOSSES

# DeepSpeed 0.19's own reads per step (docs/training.md, "Host synchronisations"), by function.
INVALID_NORM = ("__bool__", "deepspeed:runtime/utils.py:is_invalid_grad_norm")
MASK_NAN = ("torch.tensor(device=)", "deepspeed:runtime/utils.py:mask_nan_or_inf_with_val_inplace")
HAS_OVERFLOW = ("item", "deepspeed:runtime/zero/stage_1_and_2.py:has_overflow")
STAGE3_NORM = ("torch.tensor(device=)", "deepspeed:runtime/zero/stage3.py:get_grad_norm_direct")
ZERO_1_2_BF16 = {INVALID_NORM: 1, MASK_NAN: 2, HAS_OVERFLOW: 1}
# DeepSpeed's ZeRO-0 clip builds max_norm and 1.0 on the host each step (train.engine=deepspeed).
ZERO0_CLIP = ("torch.tensor(device=)", "deepspeed:runtime/utils.py:clip_grad_norm_")

# configuration -> (overrides, vlcontrast's own syncs per step, DeepSpeed's syncs per step)
CASES = {
    "zero0_fp32": ({"deepspeed__zero_stage": 0}, {}, {}),
    "zero0_amp_bf16": ({"deepspeed__zero_stage": 0, "train__precision": "amp_bf16"}, {}, {}),
    # ZeRO 0 runs the torch engine (train.engine=auto); with clipping and GradCache it still
    # reads nothing. DeepSpeed's engine, asked for, pays its clip's two host-built tensors.
    "zero0_amp_bf16_clip_accum2": ({"deepspeed__zero_stage": 0, "train__precision": "amp_bf16",
                                    "optim__grad_clip": 1.0, "train__accum_steps": 2}, {}, {}),
    "zero0_fp32_deepspeed_clip": ({"deepspeed__zero_stage": 0, "train__engine": "deepspeed",
                                   "optim__grad_clip": 1.0}, {}, {ZERO0_CLIP: 2}),
    "zero1_amp_bf16": ({"deepspeed__zero_stage": 1, "train__precision": "amp_bf16"}, {},
                       {INVALID_NORM: 1, MASK_NAN: 2}),
    "zero2_bf16": ({"deepspeed__zero_stage": 2, "train__precision": "bf16"}, {}, ZERO_1_2_BF16),
    "zero3_fp32": ({"deepspeed__zero_stage": 3}, {}, {INVALID_NORM: 1, STAGE3_NORM: 2}),
    "gradcache_zero1_bf16": ({"deepspeed__zero_stage": 1, "train__precision": "bf16",
                              "train__accum_steps": 2}, {}, ZERO_1_2_BF16),
    "decl_momentum_zero2_bf16": ({"deepspeed__zero_stage": 2, "train__precision": "bf16",
                                  "loss__name": "decl", "loss__estimator": "momentum"},
                                 {}, ZERO_1_2_BF16),
    "decl_buffer_zero0_amp_bf16": ({"deepspeed__zero_stage": 0, "train__precision": "amp_bf16",
                                    "loss__name": "decl"}, {}, {}),
}

READS = ("item", "tolist", "__bool__", "__float__", "__int__")

# Code that reads only the loader's host-side tensors (sample ids, the position in the epoch)
# before the batch is copied to the device, or the CPU generator's draws of a crop (torchvision's
# own get_params, with 0 workers in this process): on a GPU these reads never wait for it.
HOST_SIDE = {"vlcontrast/train/batches.py", "vlcontrast/data/crops.py"}


def _issuer() -> str:
    import vlcontrast

    package = Path(vlcontrast.__file__).parent
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if "/deepspeed/" in filename:
            return "deepspeed:" + filename.split("/deepspeed/", 1)[1] + ":" + frame.f_code.co_name
        if filename.startswith(str(package)):
            return str(Path(filename).relative_to(package.parent))
        if "/torch/" not in filename and "/tests/" in filename:
            return "test"
        frame = frame.f_back
    return "other"


def install_counter(counts: collections.Counter) -> None:
    """Wrap every host-synchronising tensor call; ``counts[(kind, issuer)]`` grows per call."""
    import torch
    from deepspeed.accelerator import get_accelerator

    def counted(kind, real):
        def wrapper(*args, **kwargs):
            counts[(kind, _issuer())] += 1
            return real(*args, **kwargs)
        return wrapper

    for name in READS + ("new_tensor",):
        setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    real_tensor = torch.tensor

    def tensor(*args, **kwargs):
        if kwargs.get("device") is not None:
            counts[("torch.tensor(device=)", _issuer())] += 1
        return real_tensor(*args, **kwargs)

    torch.tensor = tensor
    accelerator = type(get_accelerator())
    accelerator.synchronize = counted("synchronize", accelerator.synchronize)
    torch.cuda.synchronize = counted("synchronize", torch.cuda.synchronize)


def _count(rank, world_size, data_dir, out_root, cases):
    from tests.train.helpers import tiny_config
    from vlcontrast.train import train

    counts: collections.Counter = collections.Counter()
    install_counter(counts)
    per_run = {}
    for case, (extra, _, _) in cases.items():
        for steps in (2, 5):
            counts.clear()
            train(tiny_config(data_dir, out_root / case / str(steps), train__steps=steps,
                              train__log_every=1000, checkpoint__every=0, **extra))
            per_run[(case, steps)] = dict(counts)
    return per_run


def per_step_counts(per_run: dict, case: str) -> dict:
    short, long = per_run[(case, 2)], per_run[(case, 5)]
    per_step = {key: (long.get(key, 0) - short.get(key, 0)) / 3 for key in set(short) | set(long)}
    # An engine destroyed by the garbage collector (DeepSpeed's __del__) lands in whichever run
    # is going on: end-of-run work, not a step's.
    return {key: n for key, n in per_step.items() if n and not key[1].endswith(":destroy")}


@pytest.mark.slow
def test_host_synchronisations_per_step_are_the_documented_ones(synthetic_data, tmp_path):
    outcomes = run_distributed(_count, 2, synthetic_data, tmp_path, CASES, timeout=600,
                               backend=default_backend())
    for case, (_, expected, deepspeed_expected) in CASES.items():
        for per_run in outcomes:
            per_step = per_step_counts(per_run, case)
            ours = collections.Counter()
            for (kind, issuer), n in per_step.items():
                if issuer.startswith("vlcontrast/") and issuer not in HOST_SIDE:
                    ours[issuer] += n
            assert dict(ours) == expected, (case, sorted(per_step.items()))
            # No host-to-device copies of our own in the step (the flag is made on the device).
            assert not [key for key in per_step if key[0] in ("new_tensor", "torch.tensor(device=)")
                        and key[1].startswith("vlcontrast/")], (case, per_step)
            # DeepSpeed's: the documented ones, and no synchronize (its throughput timer is off).
            theirs = {key: n for key, n in per_step.items() if key[1].startswith("deepspeed:")}
            assert theirs == deepspeed_expected, (case, theirs)


def test_the_gpu_checks_sync_limits_are_these_counts():
    """`make gpu-check`'s syncs group passes at the totals counted here, not at a number of its
    own (bench/gpu_check/plan.py)."""
    from bench.gpu_check.plan import HOST_SYNCS_PER_STEP

    for case, total in HOST_SYNCS_PER_STEP.items():
        _, ours, theirs = CASES[case]
        assert sum(ours.values()) + sum(theirs.values()) == total, case


# -- what the Python-level counter cannot see ---------------------------------------------------

SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2",
            "unique_consecutive", "unique_dim", "repeat_interleave", "is_nonzero", "equal",
            "lift_fresh", "lift_fresh_copy", "multinomial", "bincount", "histc"}
"""Aten ops that make the host wait for a CUDA device: a value read (``_local_scalar_dense``,
what ``item``/``bool``/``float`` of a tensor become, even when C++ issues them), an output whose
size depends on the data (``nonzero``, boolean-mask indexing, ``unique``...), a tensor built from
host data (``lift_fresh``: on CUDA a blocking copy from pageable memory)."""


def _dispatch_syncs(loss: str, extra: list[str]) -> dict:
    """Sync ops per steady-state step of the torch engine's train_step (steps 4-6 of 6), seen at
    the dispatcher, with the vlcontrast line that issued each."""
    import traceback

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from vlcontrast.config import ModelConfig, load_config
    from vlcontrast.data.loader import Batch
    from vlcontrast.losses import build_loss
    from vlcontrast.models import build_model
    from vlcontrast.train.engine import build_engine, clamp_logit_scale
    from vlcontrast.train.precision import Precision
    from vlcontrast.train.step import StepLedger, train_step
    from vlcontrast.train.steplog import StepTimer

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.on, self.counts = False, collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            masked = name == "index" and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))
            if self.on and (name in SYNC_OPS or masked):
                where = [f"{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_stack()
                         if "/vlcontrast/" in f.filename][-2:]
                self.counts[(name, " <- ".join(where))] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    batch, accum = 8, 2 if "train.accum_steps=2" in extra else 1
    config = load_config(None, ["data.train=x", "train.steps=20", f"loss.name={loss}",
                                "optim.warmup_steps=2", f"data.batch_size={batch}", *extra])
    bundle = build_model(ModelConfig(name="vlc-micro"), device="cpu")
    engine, _ = build_engine(bundle.model.train(), optim=config.optim, train=config.train,
                             deepspeed=config.deepspeed, micro_batch_size=batch, total_steps=20,
                             world_size=1)
    assert type(engine).__name__ == "TorchEngine"
    loss_fn = build_loss(loss, id_space=64)
    precision = Precision(config.train.precision)
    images = torch.randn(batch, 3, 32, 32)
    texts = torch.randint(1, 100, (batch, 16))
    timer, ledger, counter = StepTimer(torch.device("cpu")), StepLedger(), Counter()
    with counter:
        for step in range(1, 7):
            counter.on = step >= 4
            timer.start()
            micro = [Batch(images, texts, torch.arange(batch) + (j + step * accum) % 8 * batch)
                     for j in range(accum)]
            ledger.record(step, train_step(engine, loss_fn, micro, step, torch.device("cpu"),
                                           precision.parameter_dtype, timer))
            clamp_logit_scale(engine)
    return {key: n / 3 for key, n in counter.counts.items()}


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("extra", [["train.precision=amp_bf16"],
                                   ["train.precision=fp32", "optim.grad_clip=1.0",
                                    "train.accum_steps=2"]], ids=["amp_bf16", "clip_accum2"])
def test_no_op_in_a_steady_state_step_waits_for_the_device(loss, extra, monkeypatch):
    """The Python-level counter above sees reads made from Python; this one sees every aten op
    that would make the host wait on CUDA, from Python or C++ (``.item()`` inside a torch
    function, boolean-mask indexing, a tensor built from host data), in every loss's step.
    (``_assert_async`` is not one: on CUDA it asserts on the device.)"""
    from vlcontrast.losses import bcl

    # BCL ranks with numpy on a CPU (faster there, with host reads); on an accelerator it takes
    # its sync-free path, which is the one a GPU step runs: take it here too.
    monkeypatch.setattr(bcl, "_sync_free_ranks", lambda values: True)
    assert _dispatch_syncs(loss, extra) == {}
