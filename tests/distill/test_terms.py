"""The three distillation terms under the loss contract.

* ``logits`` equals open_clip's own ``DistillClipLoss`` (its ``distill_loss`` output) in value and
  gradient (features, both temperatures' effect), and ``DistilledLoss`` over InfoNCE equals its
  ``contrastive_loss + weight * distill_loss``;
* ``features`` and ``interactive`` equal plain-PyTorch formulas written here from CLIP-KD's
  definitions;
* chunked mode (``loss.chunk_size``) equals dense mode, in value and gradient, for every kind;
* data parallelism: on 2 and 4 gloo ranks the mean over ranks of the per-rank term equals the
  single-process term on the global batch, and the local feature gradients, divided by the world
  size, equal the single-process ones (tests/distributed.py's helper, as tests/losses).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import DistillClipLoss

from tests.distributed import run_distributed
from vlcontrast.distill import DistilledLoss, TeacherBatch, distill_term
from vlcontrast.losses import build_loss

GLOBAL, DIM, TEACHER_DIM = 12, 8, 8


def make_inputs(seed: int = 0, teacher_dim: int = TEACHER_DIM, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)

    def unit(*shape):
        return F.normalize(torch.randn(*shape, generator=generator, dtype=dtype), dim=-1)

    return (unit(GLOBAL, DIM), unit(GLOBAL, DIM), torch.tensor(11.0, dtype=dtype),
            unit(GLOBAL, teacher_dim), unit(GLOBAL, teacher_dim), torch.tensor(23.0, dtype=dtype))


def with_grad(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


def test_logits_kind_equals_open_clip_distill_clip_loss():
    image, text, scale, t_image, t_text, t_scale = make_inputs()
    ours = with_grad(image, text, scale)
    term = distill_term("logits", ours[0], ours[1], ours[2],
                        TeacherBatch(t_image, t_text, t_scale))
    term.backward()
    theirs = with_grad(image, text, scale)
    reference = DistillClipLoss()(theirs[0], theirs[1], theirs[2], t_image, t_text, t_scale,
                                  output_dict=True)["distill_loss"]
    reference.backward()
    torch.testing.assert_close(term, reference, rtol=1e-12, atol=1e-12)
    for mine, other in zip(ours, theirs):
        torch.testing.assert_close(mine.grad, other.grad, rtol=1e-10, atol=1e-12)


def test_distilled_infonce_equals_open_clip_total():
    image, text, scale, t_image, t_text, t_scale = make_inputs(1)
    loss = DistilledLoss(build_loss("infonce"), kind="logits", weight=0.7)
    loss.set_teacher(TeacherBatch(t_image, t_text, t_scale))
    ours = with_grad(image, text, scale)
    result = loss(*ours)
    result["loss"].backward()
    theirs = with_grad(image, text, scale)
    parts = DistillClipLoss()(theirs[0], theirs[1], theirs[2], t_image, t_text, t_scale,
                              output_dict=True)
    total = parts["contrastive_loss"] + 0.7 * parts["distill_loss"]
    total.backward()
    torch.testing.assert_close(result["loss"], total, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(result["distill_loss"], parts["distill_loss"].detach())
    for mine, other in zip(ours, theirs):
        torch.testing.assert_close(mine.grad, other.grad, rtol=1e-10, atol=1e-12)


def reference_features(image, text, t_image, t_text, projection=None):
    if projection is not None:
        image = F.normalize(image @ projection.T, dim=-1)
        text = F.normalize(text @ projection.T, dim=-1)
    return (((image - t_image) ** 2).sum(1).mean() + ((text - t_text) ** 2).sum(1).mean()) / 2


def reference_interactive(image, text, scale, t_image, t_text, projection=None):
    if projection is not None:
        image = F.normalize(image @ projection.T, dim=-1)
        text = F.normalize(text @ projection.T, dim=-1)
    labels = torch.arange(image.shape[0])
    return (F.cross_entropy(scale * image @ t_text.T, labels)
            + F.cross_entropy(scale * text @ t_image.T, labels)) / 2


@pytest.mark.parametrize("kind", ["features", "interactive"])
@pytest.mark.parametrize("teacher_dim", [TEACHER_DIM, 5])
def test_clip_kd_terms_match_their_formulas(kind, teacher_dim):
    image, text, scale, t_image, t_text, _ = make_inputs(2, teacher_dim)
    projection = None
    if teacher_dim != DIM:
        projection = torch.nn.Linear(DIM, teacher_dim, bias=False).double()
    ours = with_grad(image, text, scale)
    term = distill_term(kind, *ours, TeacherBatch(t_image, t_text, torch.tensor(5.0)),
                        projection=projection)
    term.backward()
    ours_weight_grad = projection.weight.grad.clone() if projection is not None else None
    theirs = with_grad(image, text, scale)
    weight = projection.weight.detach().clone().requires_grad_() if projection is not None else None
    if kind == "features":
        reference = reference_features(theirs[0], theirs[1], t_image, t_text, weight)
    else:
        reference = reference_interactive(*theirs, t_image, t_text, weight)
    reference.backward()
    torch.testing.assert_close(term, reference, rtol=1e-12, atol=1e-12)
    for mine, other in zip(ours, theirs):
        if other.grad is None:  # features: the temperature is not used
            assert mine.grad is None or torch.all(mine.grad == 0)
            continue
        torch.testing.assert_close(mine.grad, other.grad, rtol=1e-10, atol=1e-12)
    if projection is not None:
        torch.testing.assert_close(ours_weight_grad, weight.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["logits", "features", "interactive"])
@pytest.mark.parametrize("chunk_size", [1, 5])
def test_chunked_equals_dense(kind, chunk_size):
    image, text, scale, t_image, t_text, t_scale = make_inputs(3)
    teacher = TeacherBatch(t_image, t_text, t_scale)
    dense = with_grad(image, text, scale)
    value = distill_term(kind, *dense, teacher)
    value.backward()
    chunked = with_grad(image, text, scale)
    chunked_value = distill_term(kind, *chunked, teacher, chunk_size=chunk_size)
    chunked_value.backward()
    torch.testing.assert_close(chunked_value, value, rtol=1e-12, atol=1e-12)
    for mine, other in zip(chunked, dense):
        if other.grad is None:
            continue
        torch.testing.assert_close(mine.grad, other.grad, rtol=1e-10, atol=1e-12)


def test_chunked_logits_keep_no_full_matrix(monkeypatch):
    """No ``B x B`` block, student's or teacher's, is ever formed with ``chunk_size < B``."""
    from vlcontrast.distill import terms

    image, text, scale, t_image, t_text, t_scale = make_inputs(4)
    widest = []
    original = terms.SoftTargetRows.targets

    def targets(self, positives):
        result = original(self, positives)
        widest.append(result.shape[0])
        return result

    monkeypatch.setattr(terms.SoftTargetRows, "targets", targets)
    chunk = 4
    ours = with_grad(image, text, scale)
    distill_term("logits", *ours, TeacherBatch(t_image, t_text, t_scale),
                 chunk_size=chunk).backward()
    assert widest and max(widest) == chunk < GLOBAL


def _rank_terms(rank, world_size, chunk_size):
    image, text, scale, t_image, t_text, t_scale = make_inputs(5)
    local = slice(rank * GLOBAL // world_size, (rank + 1) * GLOBAL // world_size)
    results = {}
    for kind in ("logits", "features", "interactive"):
        ours = with_grad(image[local], text[local], scale)
        term = distill_term(kind, *ours, TeacherBatch(t_image[local], t_text[local], t_scale),
                            chunk_size=chunk_size)
        term.backward()
        grads = (term.detach(), ours[0].grad, ours[1].grad,
                 ours[2].grad if ours[2].grad is not None else torch.zeros((), dtype=scale.dtype))
        # numpy, not tensors: a tensor sent from a spawned rank is shared memory that dies with it
        results[kind] = tuple(g.numpy().copy() for g in grads)
    return results


@pytest.mark.parametrize("world_size,chunk_size", [(2, 0), (4, 2)])
def test_data_parallel_equals_single_process(world_size, chunk_size):
    single = _rank_terms(0, 1, chunk_size)
    ranks = run_distributed(_rank_terms, world_size, chunk_size)
    for kind, expected in single.items():
        value, image_grad, text_grad, scale_grad = (torch.from_numpy(e) for e in expected)
        parts = [[torch.from_numpy(x) for x in r[kind]] for r in ranks]
        torch.testing.assert_close(torch.stack([p[0] for p in parts]).mean(), value,
                                   rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.cat([p[1] for p in parts]) / world_size,
                                   image_grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(torch.cat([p[2] for p in parts]) / world_size,
                                   text_grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(torch.stack([p[3] for p in parts]).mean(), scale_grad,
                                   rtol=1e-10, atol=1e-12)
