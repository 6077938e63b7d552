"""The 16-bit positive under ``torch.autocast`` with float32 features (open_clip's training loop
calls the loss inside its autocast block).

The logit matrix is then a 16-bit matmul while the features are float32; the loss picked the
float32 positive by the features' dtype, so a row's statistic saw ``L_ii`` rounded to 16 bits and
the ``L_ii`` subtracted from it was another number: InfoNCE of aligned pairs came out at -9e-4
under fp16 autocast (its bound is 0). The loss now decides by the dtype the logits have, in dense
and chunked mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.losses import references
from vlcontrast.losses import LOSSES, build_loss
from vlcontrast.losses.base import logit_dtype

AUTOCAST = [torch.bfloat16, torch.float16]
OPTIONS = {"decl": {"estimator": "batch", "schedule": "weighted"}}


def pairs(seed, noise=0.3, n=16, dim=64):
    generator = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(n, dim, generator=generator), dim=1)
    text = F.normalize(image + noise * torch.randn(n, dim, generator=generator), dim=1)
    return image, text


def formula_on_the_autocast_matrix(name, image, text, scale, dtype):
    """InfoNCE or DCL evaluated in float64 on the logits autocast computes for each direction
    (``L_ii`` read from that matrix)."""
    terms = []
    for anchors, candidates in ((image, text), (text, image)):
        with torch.autocast("cpu", dtype=dtype):
            logits = ((scale * anchors) @ candidates.T).double()
        if name == "dcl":
            logits_for_sum = logits.masked_fill(torch.eye(len(logits), dtype=torch.bool),
                                                -torch.inf)
        else:
            logits_for_sum = logits
        terms.append((torch.logsumexp(logits_for_sum, 1) - logits.diagonal()).mean())
    return float(sum(terms) / 2)


def test_logit_dtype_follows_autocast():
    x = torch.ones(2, 3)
    assert logit_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert logit_dtype(x) == torch.bfloat16
        assert logit_dtype(x.half()) == torch.bfloat16  # autocast casts 16-bit inputs too
        assert logit_dtype(x.double()) == torch.float64  # never cast
        assert ((x * 2) @ x.T).dtype == logit_dtype(x)


@pytest.mark.parametrize("chunk_size", [0, 5], ids=["dense", "chunked"])
@pytest.mark.parametrize("dtype", AUTOCAST, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["infonce", "dcl"])
def test_the_positive_is_the_matrix_entry_under_autocast(name, dtype, chunk_size):
    scale = torch.tensor(14.29)
    for seed in range(10):
        image, text = pairs(seed)
        with torch.autocast("cpu", dtype=dtype):
            value = float(build_loss(name, chunk_size=chunk_size)(image, text, scale)["loss"])
        expected = formula_on_the_autocast_matrix(name, image, text, scale, dtype)
        # float32 rounding of the row statistics; the float32 positive was off by up to 5e-3
        assert abs(value - expected) < 1e-5, (seed, value, expected)


@pytest.mark.parametrize("chunk_size", [0, 5], ids=["dense", "chunked"])
@pytest.mark.parametrize("dtype", AUTOCAST, ids=["bf16", "fp16"])
@pytest.mark.parametrize("scale", [14.29, 100.0])
def test_infonce_of_aligned_pairs_is_not_negative_under_autocast(scale, dtype, chunk_size):
    for seed in range(20):
        features, _ = pairs(seed)
        with torch.autocast("cpu", dtype=dtype):
            value = build_loss("infonce", chunk_size=chunk_size)(features, features.clone(),
                                                                 torch.tensor(scale))["loss"]
        assert value.dtype == torch.float32
        assert float(value) >= 0.0, (seed, float(value))


@pytest.mark.parametrize("dtype", AUTOCAST, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_chunked_equals_dense_under_autocast(name, dtype):
    """Chunked mode computes its blocks in the autocast dtype too (forward and recomputed
    backward alike), so it gives the dense values; gradients come back float32."""
    image, text = references.random_pairs(10, 8, dtype=torch.float32, seed=6)
    results = []
    for chunk_size in (0, 3):
        x, y = image.clone().requires_grad_(), text.clone().requires_grad_()
        scale = torch.tensor(14.29, requires_grad=True)
        loss_fn = build_loss(name, chunk_size=chunk_size, **OPTIONS.get(name, {}))
        if name in ("sogclr", "fastclip"):
            loss_fn.eval()  # the batch's own estimate of u (training mode needs sample ids)
        with torch.autocast("cpu", dtype=dtype):
            out = loss_fn(x, y, scale, logit_bias=torch.tensor(-5.0), step=2)
        grads = torch.autograd.grad(out["loss"], (x, y, scale), allow_unused=True)
        grads = [torch.zeros(()) if g is None else g for g in grads]  # balanced: no scale
        assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
        results.append((out["loss"].detach(), grads))
    (dense, dense_grads), (chunked, chunked_grads) = results
    torch.testing.assert_close(chunked, dense, rtol=1e-5, atol=1e-5)
    for grad, expected in zip(chunked_grads, dense_grads):
        # dense mode's backward runs autocast's 16-bit matmuls, the chunked one float32 ones
        torch.testing.assert_close(grad, expected, rtol=2e-2, atol=2e-2)
