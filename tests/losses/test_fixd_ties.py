"""Chunked equals dense on tied batches: duplicated samples, all-equal rows, ties across chunk
borders.

A matmul rounds equal dot products differently by column and by the shape of the block it
computes, so the logits of a duplicated caption or image tie in one block and not in another.
Smooth losses do not care (a rounding difference stays a rounding difference); BCL's rank-based
weights jump where the order changes, so BCL ranks bitwise-identical candidates on one logit
(``duplicate_columns``). Every loss's chunked path must equal its dense path on these batches.
"""

from __future__ import annotations

import pytest
import torch

from tests.losses import references
from vlcontrast.losses import LOSSES, build_loss
from vlcontrast.losses import bcl as bcl_module

N, DIM = 10, 8
BCL_OPTIONS = {"tau_plus": 0.2, "alpha": 0.8, "beta": 0.7}
OPTIONS = {"bcl": BCL_OPTIONS, "decl": {"estimator": "batch", "schedule": "weighted",
                                         "lambda_c": 1.0}}


def tied_batch(label):
    image, text = references.random_pairs(N, DIM, seed=6)
    image, text = image.clone(), text.clone()
    if label == "all_equal":  # every row one pair: every negative ties with every other
        image[:], text[:] = image[0].clone(), text[0].clone()
    elif label == "all_equal_aligned":  # image == text everywhere: negatives tie with positives
        image[:], text[:] = image[0].clone(), image[0].clone()
    elif label == "duplicated_halves":  # pair i + 5 is pair i
        image[5:], text[5:] = image[:5].clone(), text[:5].clone()
    elif label == "two_distinct":  # two pairs, five copies each, interleaved
        image[:], text[:] = image[:2].repeat(5, 1), text[:2].repeat(5, 1)
    elif label == "across_chunk_borders":  # copies on both sides of the borders of chunks 3 and 4
        image[3], image[4] = image[2].clone(), image[2].clone()
        text[6], text[8], text[9] = text[5].clone(), text[5].clone(), text[0].clone()
    return image, text


LABELS = ["all_equal", "all_equal_aligned", "duplicated_halves", "two_distinct",
          "across_chunk_borders"]


def run(loss_fn, image, text, scale, bias=-5.0, steps=1, ids=None):
    results = []
    for step in range(1, steps + 1):
        i, t = image.clone().requires_grad_(), text.clone().requires_grad_()
        s = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
        b = torch.tensor(bias, dtype=torch.float64, requires_grad=True)
        loss = loss_fn(i, t, s, logit_bias=b, sample_ids=ids, step=step)["loss"]
        grads = torch.autograd.grad(loss, (i, t, s, b), allow_unused=True)
        results.append((loss.detach(), [torch.zeros_like(x) if g is None else g
                                        for g, x in zip(grads, (i, t, s, b))]))
    return results


def assert_same(first, second, rtol=1e-12, atol=1e-12):
    for (loss_a, grads_a), (loss_b, grads_b) in zip(first, second, strict=True):
        torch.testing.assert_close(loss_a, loss_b, rtol=rtol, atol=atol)
        for name, grad_a, grad_b in zip(("image", "text", "logit_scale", "logit_bias"),
                                        grads_a, grads_b):
            torch.testing.assert_close(grad_a, grad_b, rtol=rtol, atol=atol, msg=f"grad of {name}")


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_chunked_equals_dense_on_tied_batches(name, label):
    image, text = tied_batch(label)
    for scale in (14.29, 100.0):
        dense = build_loss(name, **OPTIONS.get(name, {}))
        if name in ("sogclr", "fastclip"):
            dense.eval()  # the batch's own u; the buffered path is the next test
        expected = run(dense, image, text, scale)
        for chunk_size in (1, 3, 4):
            chunked = build_loss(name, chunk_size=chunk_size, **OPTIONS.get(name, {}))
            chunked.train(dense.training)
            assert_same(run(chunked, image, text, scale), expected)


STATEFUL = [("decl", {}), ("sogclr", {}), ("fastclip", {"temperature": "individual"})]


@pytest.mark.parametrize("name,options", STATEFUL, ids=[name for name, _ in STATEFUL])
def test_stateful_chunked_equals_dense_over_steps_on_tied_batches(name, options):
    image, text = tied_batch("duplicated_halves")
    ids = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4])  # the copies share their sample ids too
    expected = run(build_loss(name, id_space=16, **options), image, text, 14.29, steps=3, ids=ids)
    chunked = build_loss(name, chunk_size=3, id_space=16, **options)
    assert_same(run(chunked, image, text, 14.29, steps=3, ids=ids), expected)


@pytest.mark.parametrize("scale", [14.29, 100.0])
def test_bcl_all_equal_rows_rank_every_negative_last(scale):
    """All pairs equal: every negative is tied with all K, F = 1, so each anchor's term is
    ``logaddexp(L_p, log(K w(1)) + L_n) - L_p`` (``L_p``, ``L_n``: its positive and negative logit),
    in every mode: a closed form, not a comparison of two code paths."""
    image, text = tied_batch("all_equal")
    loss_fn = build_loss("bcl", **BCL_OPTIONS)
    log_weight = loss_fn.log_weights_from_ecdf(torch.ones((), dtype=torch.float64))
    logit = scale * (image[0] @ text[0])
    log_negatives = torch.log(torch.tensor(N - 1.0, dtype=torch.float64))
    expected = torch.logaddexp(logit, log_negatives + log_weight + logit) - logit
    for chunk_size in (0, 1, 3):
        got = build_loss("bcl", chunk_size=chunk_size, **BCL_OPTIONS)(
            image, text, torch.tensor(scale, dtype=torch.float64))["loss"]
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("label", ["duplicated_halves", "across_chunk_borders"])
def test_bcl_duplicates_are_ranked_as_ties_of_the_reference(label):
    """The dense value against docs/losses.md's formula with the duplicates' logits tied exactly
    (a candidate equal to another has the same dot product with every anchor)."""
    image, text = tied_batch(label)
    scale = torch.tensor(100.0, dtype=torch.float64)
    got = build_loss("bcl", **BCL_OPTIONS)(image, text, scale)["loss"]

    def direction(anchors, candidates):
        first = [next(k for k in range(N) if torch.equal(candidates[k], candidates[j]))
                 for j in range(N)]
        logits = scale * anchors @ candidates.T
        terms = []
        for i in range(N):
            others = [j for j in range(N) if j != i]
            omega = references.bcl_weights(logits[i, [first[j] for j in others]], **BCL_OPTIONS)
            positive = torch.exp(logits[i, i])
            terms.append(-torch.log(positive / (positive + (omega * torch.exp(logits[i, others]))
                                                .sum())))
        return torch.stack(terms).mean()
    expected = (direction(image, text) + direction(text, image)) / 2
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("label", LABELS)
def test_bcl_rows_split_like_ranks_equal_the_whole_batch(label):
    """A rank scores its local rows against the global candidates (``score_rows`` with the rank's
    first positive column): any split of the rows gives the whole batch's per-anchor terms."""
    image, text = tied_batch(label)
    loss_fn = build_loss("bcl", **BCL_OPTIONS)
    scale = torch.tensor(100.0, dtype=torch.float64)
    positive = scale * (image * text).sum(1)
    whole = loss_fn.score_rows(image, text, scale, 0, bcl_module.RowContext(), N - 1,
                               positive)["loss"]
    for local in (2, 5):
        parts = [loss_fn.score_rows(image[start:start + local], text, scale, start,
                                    bcl_module.RowContext(), N - 1,
                                    positive[start:start + local])["loss"]
                 for start in range(0, N, local)]
        torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("label", LABELS)
def test_bcl_accelerator_path_equals_the_cpu_path_on_tied_batches(label, monkeypatch):
    image, text = tied_batch(label)
    expected = {chunk: run(build_loss("bcl", chunk_size=chunk, **BCL_OPTIONS), image, text, 100.0)
                for chunk in (0, 3)}
    monkeypatch.setattr(bcl_module, "_sync_free_ranks", lambda values: True)
    for chunk, want in expected.items():
        assert_same(run(build_loss("bcl", chunk_size=chunk, **BCL_OPTIONS), image, text, 100.0),
                    want)


def test_duplicate_columns_point_at_the_first_bitwise_copy():
    rows = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    rows[4], rows[6] = rows[1], rows[1]
    rows[2, 0], rows[5] = 0.0, rows[2]
    rows[5, 0] = -0.0  # equal to 0.0: the same dot product with every anchor
    torch.testing.assert_close(bcl_module.duplicate_columns(rows),
                               torch.tensor([0, 1, 2, 3, 1, 2, 1]))
    assert bcl_module.duplicate_columns(torch.eye(4, dtype=torch.bfloat16)) is None
    near = rows[:4].clone()
    near[3] = torch.nextafter(near[0], torch.tensor(2.0, dtype=torch.float64))
    assert bcl_module.duplicate_columns(near) is None  # equal to rounding is not a duplicate
