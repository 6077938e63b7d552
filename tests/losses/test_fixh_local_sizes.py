"""Ranks that pass different local batch sizes get one line, on every rank, at the first forward.

The gather of the features needs one ``B`` on every rank; with two sizes gloo aborted one rank in
C++ ("Received data size doesn't match") and left the other waiting for the process group's
timeout. Each loss instance checks the sizes once per world size (its first distributed
forward), so a step issues no extra collective.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import backend_params, rank_device, run_distributed
from vlcontrast.losses import LOSSES, build_loss


def features(rows, seed, device):
    generator = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, 8, generator=generator), dim=1).to(device)


def uneven_worker(rank, world_size, backend):
    device = rank_device(backend)
    rows = 3 if rank == 0 else 2
    x = features(rows, rank, device)
    messages = {}
    for name in sorted(LOSSES):
        loss_fn = build_loss(name, id_space=8).to(device)
        try:
            loss_fn(x, x.clone(), torch.tensor(10.0, device=device),
                    logit_bias=torch.tensor(-1.0, device=device),
                    sample_ids=torch.arange(rows, device=device), step=1)
            messages[name] = "no error"
        except ValueError as error:
            messages[name] = str(error)
    return messages


@pytest.mark.parametrize("backend", backend_params(2))
def test_every_rank_names_both_sizes(backend):
    per_rank = run_distributed(uneven_worker, 2, backend, timeout=120, backend=backend)
    assert per_rank[0] == per_rank[1]
    for name, message in per_rank[0].items():
        assert message.startswith(f"{name}: the ranks pass different local batch sizes")
        assert "rank 0: 3, rank 1: 2" in message and "same batch size" in message
        assert "\n" not in message


def checks_worker(rank, world_size, backend):
    from vlcontrast.losses import base

    device = rank_device(backend)
    calls = []
    original = base.check_local_sizes
    base.check_local_sizes = lambda *args: calls.append(1) or original(*args)
    try:
        loss_fn = build_loss("infonce")
        values = []
        for step, rows in enumerate((4, 4, 2), start=1):  # equal on both ranks at every step
            x = features(rows, 10 * step + rank, device).requires_grad_()
            out = loss_fn(x, x.detach().clone(), torch.tensor(10.0, device=device))
            out["loss"].backward()
            values.append(float(out["loss"]))
        build_loss("infonce")(x.detach(), x.detach().clone(), torch.tensor(10.0, device=device))
    finally:
        base.check_local_sizes = original
    return len(calls), values


@pytest.mark.parametrize("backend", backend_params(2))
def test_the_sizes_are_checked_once_per_loss_instance(backend):
    per_rank = run_distributed(checks_worker, 2, backend, timeout=120, backend=backend)
    for calls, values in per_rank:
        assert calls == 2  # the first forward of each of the two instances
        assert all(value == value for value in values)


def test_a_single_process_issues_no_check(monkeypatch):
    from vlcontrast.losses import base

    monkeypatch.setattr(base, "check_local_sizes",
                        lambda *args: pytest.fail("checked without a process group"))
    x = features(4, 0, "cpu")
    build_loss("infonce")(x, x.clone(), torch.tensor(10.0))
