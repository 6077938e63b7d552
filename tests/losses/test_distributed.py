"""Data parallelism: every loss on 2 and 4 ranks equals the single-process loss on the global batch.

One spawn per world size checks all losses (spawning costs seconds): the mean over ranks of the
per-rank loss equals the global loss; the local feature gradients, divided by the world size and
concatenated, equal the single-process gradients (DeepSpeed averages the ranks' parameter
gradients, and the gather's backward sums every rank's contribution); ``logit_scale`` and
``logit_bias`` gradients averaged over ranks equal the single-process ones. DeCL runs three steps,
and its buffer (replicated or sharded by id) must end equal to the single-process buffer, also
after resuming a checkpoint written at another world size.

Each test runs under every backend of ``backend_params``: gloo on CPU here, and NCCL on CUDA on a
machine with enough GPUs, where the gather's backward is a reduce_scatter instead of gloo's
all_to_all (``torch.distributed.nn.functional``) and DeCL's collectives move CUDA tensors.
"""

from __future__ import annotations

import numpy
import pytest
import torch

from tests.distributed import rank_device, run_distributed, world_backend_params
from tests.losses import references
from vlcontrast.distributed import get_rank, get_world_size
from vlcontrast.losses import build_loss

GLOBAL_BATCH, DIM, ID_SPACE, SCALE, BIAS = 12, 8, 30, 14.29, -4.0
STEP_IDS = [list(range(12)), list(range(6, 18)), list(range(0, 24, 2))]

# (label, loss name, options, chunk_size, steps)
CASES = [
    ("infonce", "infonce", {}, 0, 1),
    ("dcl", "dcl", {}, 0, 1),
    ("dclw", "dclw", {}, 0, 1),
    ("dclw-chunked", "dclw", {"sigma": 0.3}, 2, 1),
    ("debiased", "debiased", {}, 0, 1),
    ("hcl", "hcl", {}, 0, 1),
    ("bcl", "bcl", {}, 0, 1),
    ("bcl-chunked", "bcl", {"alpha": 0.7}, 2, 1),
    ("balanced", "balanced", {}, 0, 1),
    ("siglip", "siglip", {}, 0, 1),
    ("siglip-chunked", "siglip", {}, 2, 1),
    ("decl-buffer", "decl", {"gamma": 0.6}, 0, 3),
    ("decl-sharded-chunked", "decl", {"gamma": 0.6, "shard_buffer": True}, 2, 3),
    ("decl-weighted-sample", "decl", {"schedule": "weighted", "u_mode": "sample", "gamma": 0.8}, 0,
     3),
    ("decl-momentum", "decl", {"estimator": "momentum", "schedule": "loss1"}, 0, 2),
    ("sogclr", "sogclr", {"gamma": 0.6}, 0, 3),
    ("fastclip-global-cosine", "fastclip", {"temperature": "global", "gamma_schedule": "cosine",
                                            "gamma_decay_steps": 2, "gamma": 0.3}, 0, 3),
    ("fastclip-sharded-chunked", "fastclip", {"gamma": 0.5, "shard_buffer": True}, 2, 3),
    ("fastclip-individual-sharded-chunked", "fastclip",
     {"temperature": "individual", "gamma": 0.5, "tau_lr": 0.05, "shard_buffer": True}, 2, 3),
]
RESUME_OPTIONS = {"gamma": 0.6, "shard_buffer": True, "schedule": "loss1"}


def make_batches():
    batches = []
    for step, ids in enumerate(STEP_IDS):
        image, text = references.random_pairs(GLOBAL_BATCH, DIM, seed=10 + step)
        ema = references.random_pairs(GLOBAL_BATCH, DIM, seed=20 + step)
        batches.append((image, text, torch.tensor(ids), ema))
    return batches


def run_case(name, options, chunk_size, steps, batches, state=None, first_step=1,
             device=torch.device("cpu")):
    """Per-step ``(loss, image grad, text grad, scale grad, bias grad, diagnostics)`` on this rank
    (computed on ``device``, returned on the CPU)."""
    rank, world = get_rank(), get_world_size()
    local = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    loss_fn = build_loss(name, chunk_size=chunk_size, id_space=ID_SPACE, **options).to(device)
    if state is not None:
        loss_fn.load_state_dict(to_torch(state))
    records = []
    for step in range(first_step, first_step + steps):
        image, text, ids, (ema_image, ema_text) = to_torch(batches[step - 1])
        image = image[local].to(device).requires_grad_()
        text = text[local].to(device).requires_grad_()
        scale = torch.tensor(SCALE, dtype=torch.float64, device=device, requires_grad=True)
        bias = torch.tensor(BIAS, dtype=torch.float64, device=device, requires_grad=True)
        out = loss_fn(image, text, scale, logit_bias=bias, sample_ids=ids[local].to(device),
                      step=step, momentum_features=(ema_image[local].to(device),
                                                    ema_text[local].to(device)))
        grads = torch.autograd.grad(out["loss"], (image, text, scale, bias), allow_unused=True)
        grads = [torch.zeros(()) if g is None else g.cpu() for g in grads]
        diagnostics = {key: float(value) for key, value in out.items() if key != "loss"}
        records.append((float(out["loss"].detach()), *grads, diagnostics))
    buffer = loss_fn.state_dict()["log_u"].cpu().clone() \
        if name in ("decl", "sogclr", "fastclip") and loss_fn.needs_sample_ids \
        else None  # every rank calls state_dict(): it is a collective when sharded
    return records, buffer


def to_numpy(value):
    """Tensors travel back as numpy arrays: a torch tensor would be shared through a file
    descriptor that dies with the worker process."""
    if torch.is_tensor(value):
        return value.detach().cpu().numpy()
    if isinstance(value, (list, tuple)):
        return type(value)(to_numpy(v) for v in value)
    if isinstance(value, dict):
        return {key: to_numpy(v) for key, v in value.items()}
    return value


def to_torch(value):
    if isinstance(value, numpy.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, (list, tuple)):
        return type(value)(to_torch(v) for v in value)
    if isinstance(value, dict):
        return {key: to_torch(v) for key, v in value.items()}
    return value


def worker(rank, world_size, batches, resume_state, backend):
    device = rank_device(backend)
    results = {label: run_case(name, options, chunk, steps, batches, device=device)
               for label, name, options, chunk, steps in CASES}
    results["decl-resumed"] = run_case("decl", RESUME_OPTIONS, 0, 1, batches, state=resume_state,
                                       first_step=3, device=device)
    return to_numpy(results)


def single_process(batches):
    results = {label: run_case(name, options, chunk, steps, batches)
               for label, name, options, chunk, steps in CASES}
    first_two = build_loss("decl", id_space=ID_SPACE, **RESUME_OPTIONS)
    for step in (1, 2):
        image, text, ids, _ = batches[step - 1]
        first_two(image, text, torch.tensor(SCALE, dtype=torch.float64), sample_ids=ids, step=step)
    resume_state = first_two.state_dict()
    results["decl-resumed"] = run_case("decl", RESUME_OPTIONS, 0, 1, batches, state=resume_state,
                                       first_step=3)
    return results, resume_state


@pytest.mark.slow
@pytest.mark.parametrize("world_size, backend", world_backend_params(2, 4))
def test_data_parallel_equals_single_process(world_size, backend):
    batches = make_batches()
    expected, resume_state = single_process(batches)
    per_rank = to_torch(run_distributed(worker, world_size, to_numpy(batches),
                                        to_numpy(resume_state), backend, backend=backend))
    checked = 0
    for label, (expected_records, expected_buffer) in expected.items():
        rank_records = [result[label][0] for result in per_rank]
        for step, expected_record in enumerate(expected_records, start=1):
            where = f"{label} step {step} world {world_size}"
            loss, image_grad, text_grad, scale_grad, bias_grad, diagnostics = expected_record
            steps = [records[step - 1] for records in rank_records]
            assert sum(r[0] for r in steps) / world_size == pytest.approx(loss, rel=1e-9), where
            torch.testing.assert_close(torch.cat([r[1] for r in steps]) / world_size, image_grad,
                                       msg=where)
            torch.testing.assert_close(torch.cat([r[2] for r in steps]) / world_size, text_grad,
                                       msg=where)
            torch.testing.assert_close(sum(r[3] for r in steps) / world_size, scale_grad, msg=where)
            torch.testing.assert_close(sum(r[4] for r in steps) / world_size, bias_grad, msg=where)
            for key in ("loss_1", "loss_2", "positive_similarity", "negative_similarity", "U"):
                if key in diagnostics:
                    mean = sum(r[5][key] for r in steps) / world_size
                    assert mean == pytest.approx(diagnostics[key], rel=1e-6), f"{where} {key}"
            checked += 1
        if expected_buffer is not None:
            for result in per_rank:
                torch.testing.assert_close(result[label][1], expected_buffer, msg=label)
            assert torch.isfinite(expected_buffer).any() and torch.isinf(expected_buffer).any()
    assert checked == sum(case[4] for case in CASES) + 1


REDUCE_SCATTER_CASES = ("infonce", "dclw-chunked", "siglip-chunked", "decl-sharded-chunked")


def reduce_scatter_worker(rank, world_size, batches):
    """Every case of REDUCE_SCATTER_CASES with the gather's backward on NCCL's branch.

    ``torch.distributed.nn.functional``'s all_gather picks its backward by backend: a
    reduce_scatter under NCCL, an all_to_all elsewhere. gloo implements reduce_scatter too, so
    answering "nccl" to the backward's backend query runs the NCCL branch here, on CPU.
    """
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_fn

    calls = []
    real_get_backend, real_reduce_scatter = dist.get_backend, dist_fn._Reduce_Scatter.apply

    def get_backend(group=None):
        return dist.Backend.NCCL if group is not None else real_get_backend()

    dist.get_backend = get_backend
    dist_fn._Reduce_Scatter.apply = lambda *args: calls.append(1) or real_reduce_scatter(*args)
    try:
        results = {label: run_case(name, options, chunk, steps, batches)
                   for label, name, options, chunk, steps in CASES
                   if label in REDUCE_SCATTER_CASES}
    finally:
        dist.get_backend, dist_fn._Reduce_Scatter.apply = real_get_backend, real_reduce_scatter
    return to_numpy(results), len(calls)


@pytest.mark.slow
def test_nccl_gather_backward_branch_is_exact():
    batches = make_batches()
    expected = {label: run_case(name, options, chunk, steps, batches)
                for label, name, options, chunk, steps in CASES if label in REDUCE_SCATTER_CASES}
    per_rank = run_distributed(reduce_scatter_worker, 2, to_numpy(batches), backend="gloo")
    assert all(calls > 0 for _, calls in per_rank)  # the reduce_scatter branch ran
    for label, (records, buffer) in expected.items():
        for step, record in enumerate(records):
            steps = [to_torch(result[label][0][step]) for result, _ in per_rank]
            where = f"{label} step {step + 1}"
            assert sum(r[0] for r in steps) / 2 == pytest.approx(record[0], rel=1e-9), where
            torch.testing.assert_close(torch.cat([r[1] for r in steps]) / 2, record[1], msg=where)
            torch.testing.assert_close(torch.cat([r[2] for r in steps]) / 2, record[2], msg=where)
            torch.testing.assert_close(sum(r[3] for r in steps) / 2, record[3], msg=where)
        if buffer is not None:
            for result, _ in per_rank:
                torch.testing.assert_close(to_torch(result[label][1]), buffer, msg=label)
