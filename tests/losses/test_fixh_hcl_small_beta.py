"""HCL's importance weights ``exp(beta (L - m))`` at a small ``beta`` and ``logit_scale`` 100.

The weights were computed as ``exp(L - m) ** beta``: a negative more than ~104 logits below the
row's hardest one underflows ``exp(L - m)`` to 0 in float32, so its weight came out 0 instead of
about 1 (at ``beta = 0.001``, ``exp(-0.2)``), and the negative mass with it: float32 was 0.5 above
float64 on a hard-negative batch. Dense and chunked mode, value and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlcontrast.losses import build_loss


def hard_batch(n=64, dim=16):
    """Each image has a near-duplicate negative text (its row's maximum near ``s``); most other
    negatives sit more than 104 logits below it at ``s = 100``."""
    generator = torch.Generator().manual_seed(1)
    image = F.normalize(torch.randn(n, dim, generator=generator, dtype=torch.float64), dim=1)
    text = F.normalize(image.roll(1, 0) + 0.05 * torch.randn(n, dim, generator=generator,
                                                             dtype=torch.float64), dim=1)
    return image, text


def loss_and_grads(image, text, dtype, beta, chunk_size):
    image = image.to(dtype).requires_grad_()
    text = text.to(dtype).requires_grad_()
    scale = torch.tensor(100.0, dtype=dtype, requires_grad=True)
    out = build_loss("hcl", beta=beta, tau_plus=0.0, chunk_size=chunk_size)(image, text, scale)
    grads = torch.autograd.grad(out["loss"], (image, text, scale))
    return out["loss"].detach().double(), [g.double() for g in grads]


def test_the_batch_reaches_the_underflow():
    image, text = hard_batch()
    logits = 100 * image @ text.T
    negatives = logits.masked_fill(torch.eye(len(logits), dtype=torch.bool), -torch.inf)
    below = negatives - negatives.amax(1, keepdim=True)
    # exp() of these is 0 in float32 (its smallest subnormal is e^-103.3)
    assert ((below < -110) & torch.isfinite(below)).sum(1).min() >= 5


@pytest.mark.parametrize("chunk_size", [0, 16], ids=["dense", "chunked"])
@pytest.mark.parametrize("beta", [0.001, 0.01, 0.1, 1.0])
def test_float32_matches_float64_at_scale_100(beta, chunk_size):
    image, text = hard_batch()
    expected, expected_grads = loss_and_grads(image, text, torch.float64, beta, chunk_size)
    value, grads = loss_and_grads(image, text, torch.float32, beta, chunk_size)
    # float32 rounding of a loss near 100 is ~1e-5; the underflowed weights cost 0.36 to 0.5
    # (beta 0.01, 0.001) and 2e-4 (beta 0.1)
    assert abs(float(value - expected)) < 5e-5, (float(value), float(expected))
    for grad, expected_grad in zip(grads, expected_grads):
        error = float((grad - expected_grad).norm() / expected_grad.norm())
        assert error < 2e-6, error


@pytest.mark.parametrize("beta", [0.001, 0.5])
def test_chunked_equals_dense_in_float32(beta):
    image, text = hard_batch()
    dense, dense_grads = loss_and_grads(image, text, torch.float32, beta, 0)
    chunked, chunked_grads = loss_and_grads(image, text, torch.float32, beta, 7)
    torch.testing.assert_close(chunked, dense, rtol=1e-6, atol=1e-5)
    for grad, expected in zip(chunked_grads, dense_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [0, 3], ids=["dense", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("beta", [1e-50, 1e-320])
def test_a_beta_below_the_dtypes_range_is_debiased(beta, dtype, chunk_size):
    """``beta`` rounds to 0 in float32 (and 1e-320 is subnormal in float64): the weights are 1,
    the positive's stays 0 (not ``-inf * 0 = NaN``, not ``0 ** 0 = 1``)."""
    image, text = hard_batch(n=8, dim=4)
    image, text = image.to(dtype).requires_grad_(), text.to(dtype)
    scale = torch.tensor(10.0, dtype=dtype)
    value = build_loss("hcl", beta=beta, chunk_size=chunk_size)(image, text, scale)["loss"]
    (grad,) = torch.autograd.grad(value, (image,))
    expected = build_loss("hcl", beta=0.0)(image, text, scale)["loss"]
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(value, expected)
