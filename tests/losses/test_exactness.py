"""Values and gradients of every loss against docs/losses.md, open_clip, identities, symmetry, chunks."""

from __future__ import annotations

import pytest
import torch
from open_clip.loss import ClipLoss, SigLipLoss

from tests.losses import references
from vlcontrast.losses import LOSSES, base, build_loss
from vlcontrast.losses import bcl as bcl_module

SCALES = (1.0, 14.29, 100.0)
NAMES = sorted(LOSSES)
# Options that differ from the defaults, so the tests see every option doing something.
NON_DEFAULT = {
    "dclw": {"sigma": 0.3}, "debiased": {"tau_plus": 0.2}, "hcl": {"tau_plus": 0.05, "beta": 0.5},
    "bcl": {"tau_plus": 0.2, "alpha": 0.8, "beta": 0.7},
    "balanced": {"alpha": 3.0, "lam": 1.5, "include_positive": True},
}


def leaves(image, text, scale, bias=-2.0):
    return (image.clone().requires_grad_(), text.clone().requires_grad_(),
            torch.tensor(scale, dtype=image.dtype, requires_grad=True),
            torch.tensor(bias, dtype=image.dtype, requires_grad=True))


def loss_and_grads(fn, image, text, scale, bias):
    loss = fn(image, text, scale, bias)
    grads = torch.autograd.grad(loss, (image, text, scale, bias), allow_unused=True)
    return loss.detach(), [torch.zeros_like(t) if g is None else g
                           for g, t in zip(grads, (image, text, scale, bias))]


def assert_same(first, second, rtol=1e-9, atol=1e-10):
    (loss_a, grads_a), (loss_b, grads_b) = first, second
    torch.testing.assert_close(loss_a, loss_b, rtol=rtol, atol=atol)
    for name, grad_a, grad_b in zip(("image", "text", "logit_scale", "logit_bias"), grads_a, grads_b):
        torch.testing.assert_close(grad_a, grad_b, rtol=rtol, atol=atol, msg=f"grad of {name}")


def module_fn(name, **options):
    loss_fn = build_loss(name, **options)
    return lambda image, text, scale, bias: loss_fn(image, text, scale, logit_bias=bias, step=1)[
        "loss"]


def reference_fn(name, **options):
    return lambda image, text, scale, bias: references.reference_loss(name, image, text, scale,
                                                                      bias, **options)


# SogCLR and FastCLIP carry u across steps: their reference, over several steps, is in
# test_fastclip.py.
STEPWISE = ("decl", "sogclr", "fastclip")
REFERENCE_CASES = ([(name, {}) for name in NAMES if name not in STEPWISE]
                   + [(name, options) for name, options in NON_DEFAULT.items()]
                   # HCL: beta = 1 shares one exp between both sums; beta > 1 takes the pow path.
                   + [("hcl", {"beta": 2.5, "tau_plus": 0.0})]
                   # DeCL with the batch estimator here; the buffer's recurrence is in test_decl.py.
                   + [("decl", {"estimator": "batch", "schedule": "loss1"}),
                      ("decl", {"estimator": "batch", "schedule": "loss2"})])


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name,options", REFERENCE_CASES,
                         ids=[f"{name}-{'-'.join(map(str, o.values())) or 'defaults'}"
                              for name, o in REFERENCE_CASES])
def test_matches_reference(name, options, scale):
    image, text = references.random_pairs(12, 8, seed=1)
    args = leaves(image, text, scale)
    expected = loss_and_grads(reference_fn(name, **options), *args)
    assert torch.isfinite(expected[0])
    assert_same(loss_and_grads(module_fn(name, **options), *args), expected)


@pytest.mark.parametrize("scale", SCALES)
def test_infonce_equals_open_clip_clip_loss(scale):
    image, text = references.random_pairs(16, 8, seed=2)
    args = leaves(image, text, scale)
    clip_loss = ClipLoss(gather_with_grad=True)
    expected = loss_and_grads(lambda i, t, s, b: clip_loss(i, t, s), *args)
    assert_same(loss_and_grads(module_fn("infonce"), *args), expected)


@pytest.mark.parametrize("scale", SCALES)
def test_siglip_equals_open_clip_siglip_loss(scale):
    image, text = references.random_pairs(16, 8, seed=3)
    args = leaves(image, text, scale, bias=-10.0)
    siglip_loss = SigLipLoss()
    expected = loss_and_grads(lambda i, t, s, b: siglip_loss(i, t, s, b), *args)
    assert_same(loss_and_grads(module_fn("siglip"), *args), expected)


IDENTITIES = [
    # (left loss, left options, right loss, right options, right scale override or None, factor)
    ("debiased", {"tau_plus": 0.0}, "infonce", {}, None, 1.0),
    ("hcl", {"beta": 0.0, "tau_plus": 0.1}, "debiased", {"tau_plus": 0.1}, None, 1.0),
    ("hcl", {"beta": 0.0, "tau_plus": 0.0}, "infonce", {}, None, 1.0),
    ("balanced", {"lam": 1.0, "alpha": 4.0}, "dcl", {}, 4.0, 1 / 4.0),
    ("balanced", {"lam": 1.0, "alpha": 3.0, "include_positive": True}, "infonce", {}, 3.0, 1 / 3.0),
    ("dclw", {"sigma": 1e9}, "dcl", {}, None, 1.0),
    ("decl", {"estimator": "batch", "schedule": "loss2"}, "dcl", {}, None, 1.0),
]


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("left,left_options,right,right_options,right_scale,factor", IDENTITIES,
                         ids=[f"{i[0]}={i[2]}" for i in IDENTITIES])
def test_identities(left, left_options, right, right_options, right_scale, factor, scale):
    image, text = references.random_pairs(10, 6, seed=4)
    left_fn, right_fn = build_loss(left, **left_options), build_loss(right, **right_options)
    image = image.requires_grad_()
    text = text.requires_grad_()
    left_loss = left_fn(image, text, torch.tensor(scale, dtype=torch.float64), step=1)["loss"]
    right_loss = factor * right_fn(image, text, torch.tensor(right_scale or scale,
                                                             dtype=torch.float64))["loss"]
    grads_left = torch.autograd.grad(left_loss, (image, text))
    grads_right = torch.autograd.grad(right_loss, (image, text))
    rtol = 1e-6 if left == "dclw" else 1e-9  # sigma = 1e9 is "sigma -> inf" up to 1e-9
    torch.testing.assert_close(left_loss, right_loss, rtol=rtol, atol=rtol)
    for grad_left, grad_right in zip(grads_left, grads_right):
        torch.testing.assert_close(grad_left, grad_right, rtol=rtol, atol=rtol)


def test_bcl_weights_at_half_are_constant():
    bcl = build_loss("bcl", alpha=0.5, beta=0.5)
    logits = torch.randn(5, 7, dtype=torch.float64)
    log_weights = bcl.log_weights(logits, torch.arange(5), num_negatives=6)
    off_positive = ~torch.eye(5, 7, dtype=torch.bool)
    torch.testing.assert_close(torch.exp(log_weights[off_positive]),
                               torch.full((30,), 0.5 / 0.501, dtype=torch.float64))


def test_bcl_weights_use_ranks_with_ties():
    bcl = build_loss("bcl", tau_plus=0.1, alpha=0.7, beta=0.9)
    row = torch.tensor([[0.3, 5.0, 0.3, -1.0, 2.0]], dtype=torch.float64)  # positive at column 1
    log_weights = bcl.log_weights(row, torch.tensor([1]), num_negatives=4)
    expected = references.bcl_weights(row[0, [0, 2, 3, 4]], tau_plus=0.1, alpha=0.7, beta=0.9)
    torch.testing.assert_close(torch.exp(log_weights[0, [0, 2, 3, 4]]), expected)
    assert log_weights[0, 0] == log_weights[0, 2]  # tied negatives share the larger rank


# (SogCLR's and FastCLIP's value is tau by construction in batch mode: test_fastclip.py checks them.)
@pytest.mark.parametrize("name", [name for name in NAMES if name not in ("sogclr", "fastclip")])
def test_symmetric_under_swap_and_permutation(name):
    image, text = references.random_pairs(11, 8, seed=5)
    permutation = torch.randperm(11, generator=torch.Generator().manual_seed(0))
    options = {"estimator": "batch", "schedule": "weighted", "lambda_c": 1.0} if name == "decl" else {}
    loss_fn = build_loss(name, **options)
    scale, bias = torch.tensor(14.29, dtype=torch.float64), torch.tensor(-3.0, dtype=torch.float64)
    straight = loss_fn(image, text, scale, logit_bias=bias, step=2)["loss"]
    swapped = loss_fn(text[permutation], image[permutation], scale, logit_bias=bias, step=2)["loss"]
    torch.testing.assert_close(straight, swapped, rtol=1e-12, atol=1e-12)
    shifted = loss_fn(image, text.roll(1, 0), scale, logit_bias=bias, step=2)["loss"]
    assert not torch.allclose(straight, shifted)  # pairing matters: the test can fail


CHUNKED_OPTIONS = {"decl": {"estimator": "batch", "schedule": "weighted", "lambda_c": 1.0}}


@pytest.mark.parametrize("chunk_size", [1, 4])
@pytest.mark.parametrize("name", NAMES)
def test_chunked_equals_dense(name, chunk_size):
    image, text = references.random_pairs(10, 8, seed=6)
    args = leaves(image, text, 14.29, bias=-5.0)
    options = CHUNKED_OPTIONS.get(name, {})
    dense_fn, chunked_fn = build_loss(name, **options), build_loss(name, chunk_size=chunk_size,
                                                                   **options)
    if name in ("sogclr", "fastclip"):  # the buffered path is compared in test_fastclip.py
        dense_fn.eval(), chunked_fn.eval()

    def run(loss_fn):
        return loss_and_grads(lambda i, t, s, b: loss_fn(i, t, s, logit_bias=b, step=3)["loss"],
                              *args)
    assert_same(run(chunked_fn), run(dense_fn), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_bcl_chunked_equals_dense_with_tied_logits(chunk_size):
    """Duplicated captions/images tie whole columns; the chunked backward reuses forward's ties."""
    image, text = references.random_pairs(10, 8, seed=10)
    text[5], image[7] = text[3], image[2]
    args = leaves(image, text, 14.29)
    bcl_options = {"tau_plus": 0.2, "alpha": 0.8, "beta": 0.7}

    def run(loss_fn):
        return loss_and_grads(lambda i, t, s, b: loss_fn(i, t, s)["loss"], *args)
    dense = run(build_loss("bcl", **bcl_options))
    assert_same(run(build_loss("bcl", chunk_size=chunk_size, **bcl_options)), dense,
                rtol=1e-12, atol=1e-12)
    assert_same(dense, loss_and_grads(reference_fn("bcl", **bcl_options), *args))


def test_bcl_chunked_forward_sorts_values_and_only_backward_argsorts(monkeypatch):
    """Forward needs each row's multiset of ``L + log w`` (a value sort); only backward, which
    needs ``log w`` at each column, pays for an argsort, once per block and direction."""
    calls = []
    argsort = bcl_module._argsort_rows
    monkeypatch.setattr(bcl_module, "_argsort_rows", lambda v: calls.append(v.shape) or argsort(v))
    image, text = references.random_pairs(10, 8, seed=11)
    image.requires_grad_()
    loss = build_loss("bcl", chunk_size=4)(image, text, 14.29)["loss"]
    assert calls == []
    loss.backward()
    assert calls == [(4, 10), (4, 10), (2, 10)] * 2


def test_row_sorts_split_across_threads_match_torch(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # 3 slices, the last one short
    values = torch.randn(700, 2048, dtype=torch.float32)
    values[5, 7] = values[5, 9]  # a tie
    order = bcl_module._argsort_rows(values)
    expected = values.sort(dim=1).values
    torch.testing.assert_close(values.gather(1, order), expected, rtol=0, atol=0)
    torch.testing.assert_close(bcl_module._sort_rows_(values.clone()), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_builtin_losses_chunk_through_their_row_statistic(name, monkeypatch):
    """Every built-in loss takes the one-extra-matmul chunked path."""
    calls = []
    original = base._ChunkedStatistic.apply
    monkeypatch.setattr(base._ChunkedStatistic, "apply",
                        lambda *a: calls.append(1) or original(*a))
    image, text = references.random_pairs(6, 4, seed=9)
    options = CHUNKED_OPTIONS.get(name, {})
    loss_fn = build_loss(name, chunk_size=2, **options)
    if name in ("sogclr", "fastclip"):
        loss_fn.eval()  # the batch's own estimate of u (training mode needs sample ids)
    assert isinstance(loss_fn.row_statistic(), base.RowStatistic)
    loss_fn(image, text, torch.tensor(10.0, dtype=torch.float64),
            logit_bias=torch.tensor(-1.0, dtype=torch.float64), step=1)
    assert calls


def test_diagnostics_are_detached_scalars():
    image, text = references.random_pairs(6, 4, seed=7)
    for name in NAMES:
        out = build_loss(name, id_space=6)(image.requires_grad_(), text, torch.tensor(10.0),
                                           logit_bias=torch.tensor(0.0), sample_ids=torch.arange(6),
                                           step=1)
        assert out["loss"].dim() == 0 and out["loss"].requires_grad
        expected_positive = (image * text).sum(1).mean()
        torch.testing.assert_close(torch.as_tensor(out["positive_similarity"]).double(),
                                   expected_positive.detach())
        for key, value in out.items():
            if key != "loss":
                assert isinstance(value, float) or (value.dim() == 0 and not value.requires_grad), key


def test_bcl_weights_with_many_ties_match_reference():
    bcl = build_loss("bcl", tau_plus=0.1, alpha=0.7, beta=0.8)
    logits = torch.randint(0, 5, (40, 9), generator=torch.Generator().manual_seed(0)).double()
    positives = torch.randint(0, 9, (40,), generator=torch.Generator().manual_seed(1))
    log_weights = bcl.log_weights(logits, positives, num_negatives=8)
    for row in range(40):
        negatives = [j for j in range(9) if j != positives[row]]
        expected = references.bcl_weights(logits[row, negatives], tau_plus=0.1, alpha=0.7, beta=0.8)
        torch.testing.assert_close(torch.exp(log_weights[row, negatives]), expected)
