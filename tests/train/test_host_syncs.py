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
