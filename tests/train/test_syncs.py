"""Host synchronisation per step: the loop issues exactly one small collective per optimizer step
(the ``[loss non-finite, stop signal]`` flag sum) and no other; skipping and stopping still happen
on every rank alike (tests/train/test_faults.py).

Every ``torch.distributed`` collective is counted by who issued it: the first caller frame outside
``torch`` that belongs to DeepSpeed or to vlcontrast (the losses' own gathers and their backward are
the data-parallel loss, not synchronisation, and are counted apart). ``FiniteCheckedAdamW`` (plain
fp32 at ZeRO 0) checks the already all-reduced gradients locally and issues none. Two runs of the same configuration, of 2 and
5 steps, differ only by 3 steps: their difference divided by 3 is the per-step count."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

from tests.distributed import default_backend, run_distributed

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
               "barrier", "all_to_all_single", "reduce", "gather", "scatter")
CASES = {"zero0_fp32": {"deepspeed__zero_stage": 0},
         "zero2_bf16_accum2": {"deepspeed__zero_stage": 2, "train__precision": "bf16",
                               "train__accum_steps": 2}}


def _issuer() -> str:
    """``deepspeed``, a vlcontrast module path, ``loss gather with gradient`` or ``other``: who
    called the collective."""
    import vlcontrast

    package = Path(vlcontrast.__file__).parent
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if "/torch/distributed/nn/" in filename:  # a loss's gather-with-grad (either pass)
            return "loss gather with gradient"
        if "/deepspeed/" in filename:
            return "deepspeed"
        if filename.startswith(str(package)) and not filename.endswith("vlcontrast/distributed.py"):
            return str(Path(filename).relative_to(package.parent))
        frame = frame.f_back
    return "other"


def _count_collectives(rank, world_size, data_dir, out_root, cases):
    import torch.distributed as dist

    from tests.train.helpers import tiny_config
    from vlcontrast.train import train

    counts: collections.Counter = collections.Counter()

    def counted(name, real):
        def wrapper(*args, **kwargs):
            counts[(name, _issuer())] += 1
            return real(*args, **kwargs)
        return wrapper

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, counted(name, getattr(dist, name)))
    per_run = {}
    for case, extra in cases.items():
        for steps in (2, 5):
            counts.clear()
            train(tiny_config(data_dir, out_root / case / str(steps), train__steps=steps,
                              train__log_every=1000, checkpoint__every=0, **extra))
            per_run[(case, steps)] = dict(counts)
    return per_run


@pytest.mark.slow
def test_the_loop_issues_one_small_collective_per_step(synthetic_data, tmp_path):
    outcomes = run_distributed(_count_collectives, 2, synthetic_data, tmp_path, CASES,
                               timeout=400, backend=default_backend())
    for case in CASES:
        for per_run in outcomes:
            short, long = per_run[(case, 2)], per_run[(case, 5)]
            per_step = {key: (long.get(key, 0) - short.get(key, 0)) / 3
                        for key in set(short) | set(long)}
            ours = {key: n for key, n in per_step.items()
                    if n and key[1].startswith("vlcontrast/")}
            assert ours == {("all_reduce", "vlcontrast/train/step.py"): 1}, (case, per_step)
