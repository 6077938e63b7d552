"""Numerical safety: fp32 and bf16 at logit_scale 100 with hard negatives, dense and chunked."""

from __future__ import annotations

import pytest
import torch

from tests.losses import references
from vlcontrast.losses import LOSSES, build_loss

CASES = [(name, {}) for name in sorted(LOSSES) if name != "decl"] + [
    ("decl", {"estimator": "buffer", "gamma": 0.9}),
    ("decl", {"estimator": "buffer", "u_mode": "sample"}),
    ("decl", {"estimator": "momentum"}),
    ("decl", {"estimator": "batch", "schedule": "weighted"}),
]


@pytest.mark.parametrize("chunk_size", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,options", CASES,
                         ids=[f"{n}-{'-'.join(map(str, o.values())) or 'defaults'}" for n, o in CASES])
def test_hard_negatives_at_scale_100_are_finite(name, options, dtype, chunk_size):
    n = 16
    image, text = references.hard_negative_pairs(n, 32, dtype=dtype)
    cosines = image.float() @ text.float().T
    hard = cosines.diagonal(1) > cosines.diagonal()[:-1] + 0.5  # a negative far above the positive
    assert hard.sum() >= n - 3  # all but the duplicated pairs
    assert cosines.max() > 0.887  # raw e^{100 c} overflows float32 here
    loss_fn = build_loss(name, chunk_size=chunk_size, id_space=n, **options)
    image.requires_grad_()
    text.requires_grad_()
    scale = torch.tensor(100.0, requires_grad=True)
    bias = torch.tensor(-10.0, requires_grad=True)
    momentum = (image.detach().roll(1, 0), text.detach()) if "momentum" in options.values() else None
    for step in (1, 2, 3):  # later steps read the buffer written by earlier ones
        out = loss_fn(image, text, scale, logit_bias=bias, sample_ids=torch.arange(n), step=step,
                      momentum_features=momentum)
        grads = torch.autograd.grad(out["loss"], (image, text, scale, bias), allow_unused=True)
        assert torch.isfinite(out["loss"]), out
        for grad in grads:
            assert grad is None or torch.isfinite(grad).all()
        assert any(grad is not None and grad.abs().sum() > 0 for grad in grads[:2])
        for key, value in out.items():
            assert torch.isfinite(torch.as_tensor(value)).all(), key


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_fp32_matches_float64_at_scale_100(name):
    image, text = references.hard_negative_pairs(12, 16, dtype=torch.float64)
    options = {"estimator": "batch", "schedule": "weighted"} if name == "decl" else {}
    loss_fn = build_loss(name, **options)
    if name in ("sogclr", "fastclip"):
        loss_fn.eval()  # the batch's own estimate of u (training mode needs sample ids)
    values = [float(loss_fn(image.to(dtype), text.to(dtype), torch.tensor(100.0, dtype=dtype),
                            logit_bias=torch.tensor(-10.0, dtype=dtype), step=2)["loss"])
              for dtype in (torch.float64, torch.float32)]
    assert values[1] == pytest.approx(values[0], rel=1e-4, abs=1e-3)


@pytest.mark.parametrize("name", ["infonce", "dcl", "debiased", "hcl", "balanced"])
def test_16_bit_features_take_the_positive_from_the_rounded_matrix(name):
    """With bf16 features the logit matrix is rounded to bf16 (spacing 0.5 near 100) while the
    positive was computed in float32, so L_ii in a row's logsumexp was not the L_ii subtracted:
    InfoNCE of perfectly aligned pairs came out at -0.129 (below its bound of 0)."""
    from vlcontrast.losses import build_loss

    generator = torch.Generator().manual_seed(0)
    features = torch.nn.functional.normalize(
        torch.randn(7, 8, generator=generator, dtype=torch.float64), dim=1).bfloat16()
    exact = build_loss(name)(features.double(), features.double(), torch.tensor(100.0,
                             dtype=torch.float64))["loss"]
    rounded = build_loss(name)(features, features, torch.tensor(100.0))["loss"]
    if name == "infonce":
        assert rounded >= 0.0
    # each row's statistic and its positive see the same rounded numbers: the loss is within
    # the matrix's rounding of the exact value on the same (bf16) inputs
    assert abs(float(rounded) - float(exact)) < 0.05, (float(rounded), float(exact))
