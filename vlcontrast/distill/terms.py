"""The three distillation terms, and the loss that adds one of them to any loss of the zoo.

Notation per step: ``s_I, s_T`` the student's normalised embeddings of the local micro-batch,
``t_I, t_T`` the teacher's of the same samples, ``S`` the gathered global batch, ``a = exp(logit
scale)`` of the student and ``a_t`` of the teacher. Each term is a mean over the local anchors, so
the mean over ranks is the global-batch term (the contract of docs/losses.md):

* ``logits`` (open_clip's ``DistillClipLoss``): per anchor row ``i``,
  ``-sum_j softmax(a_t t_I[i] . t_T[S])_j * log softmax(a s_I[i] . s_T[S])_j``, and the same with
  the modalities swapped, averaged over both directions. Rows are scored through the zoo's
  :meth:`~vlcontrast.losses.base.ContrastiveLoss.score_rows`, so ``loss.chunk_size`` keeps at
  most ``chunk_size x B`` student *and* teacher logits alive, as for every loss.
* ``features`` (CLIP-KD's feature mimicry): ``||P s_I[i] - t_I[i]||^2 + ||P s_T[i] - t_T[i]||^2``
  over 2, with ``P`` the identity or a learned linear map followed by renormalisation (the
  teacher's embeddings are unit vectors, so the target is reachable).
* ``interactive`` (CLIP-KD's interactive contrastive learning): InfoNCE rows of the student's
  image anchors against the teacher's text embeddings of the global batch and the converse, at the
  student's temperature.

The teacher's embeddings carry no gradient; the student's temperature gets the gradient of the
``logits`` and ``interactive`` terms, as in open_clip and CLIP-KD.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlcontrast.distributed import gather_no_grad, gather_with_grad, get_rank
from vlcontrast.losses.base import (ContrastiveLoss, LogSumExp, RowContext, RowStatistic,
                                    row_logsumexp)

KINDS = ("logits", "features", "interactive")


@dataclass
class TeacherBatch:
    """The teacher's view of this step's local samples, in the order of the student's rows."""

    image: Tensor
    """``[B_local, D_teacher]`` normalised image embeddings."""
    text: Tensor
    """``[B_local, D_teacher]`` normalised caption embeddings."""
    logit_scale: Tensor
    """The teacher's ``exp(logit_scale)`` (a scalar)."""


class SoftTargetRows(RowStatistic):
    """``value_i = logsumexp_j L_ij - sum_j p_ij L_ij``: the cross-entropy of row ``i`` of the
    student's logits against ``p_i = softmax(teacher row i)``. The teacher's rows are recomputed
    for each block from the teacher's embeddings (never a whole ``B x B`` matrix in chunked mode);
    the gradient is ``softmax(L_i) - p_i``."""

    def __init__(self, anchors: Tensor, candidates: Tensor, scale: Tensor, first_row: int):
        self.anchors, self.candidates, self.scale = anchors, candidates, scale
        self.first_row = first_row

    def targets(self, positives: Tensor) -> Tensor:
        # The block's rows are its positives shifted back to 0: an index on the device, so no
        # host sync per block.
        rows = self.anchors.index_select(0, positives - self.first_row)
        return torch.softmax((self.scale * rows) @ self.candidates.T, dim=1)

    def dense(self, logits: Tensor, positives: Tensor) -> Tensor:
        targets = self.targets(positives)
        return row_logsumexp(logits, positives) - (targets * logits).sum(1)

    def forward(self, logits, positives):
        cross = (self.targets(positives) * logits).sum(1)
        shift = logits.amax(dim=1, keepdim=True)
        lse = shift.squeeze(1) + logits.sub_(shift).exp_().sum(dim=1).log_()  # in place
        return lse - cross, ()

    def backward(self, logits, positives, value, aux, grad):
        targets = self.targets(positives)
        return torch.softmax(logits, dim=1).sub_(targets).mul_(grad[:, None])


class _Rows(ContrastiveLoss):
    """The zoo's row driver (dense or chunked) for one statistic; not a registered loss."""

    name = "distill-rows"

    def __init__(self, statistic: RowStatistic, chunk_size: int, subtract_positive: bool):
        super().__init__(chunk_size=chunk_size)
        self.statistic, self.subtract_positive = statistic, subtract_positive

    def row_statistic(self) -> RowStatistic:
        return self.statistic

    def statistic_terms(self, value, positive, context, num_negatives):
        return {"loss": value - positive if self.subtract_positive else value}


def _score(statistic: RowStatistic, anchors: Tensor, candidates: Tensor, scale: Tensor,
           first_positive: int, chunk_size: int, subtract_positive: bool) -> Tensor:
    rows = _Rows(statistic, chunk_size, subtract_positive)
    terms = rows.score_rows(anchors, candidates, scale, first_positive, RowContext(),
                            candidates.shape[0] - 1)
    return terms["loss"].mean()


def project(features: Tensor, projection: nn.Module | None) -> Tensor:
    """The student's embeddings in the teacher's space: ``normalize(P s)``, or ``s``."""
    if projection is None:
        return features
    weight = projection.weight
    return F.normalize(features.to(weight.dtype) @ weight.T, dim=-1)


def distill_term(kind: str, image: Tensor, text: Tensor, logit_scale: Tensor | float,
                 teacher: TeacherBatch, *, projection: nn.Module | None = None,
                 chunk_size: int = 0) -> Tensor:
    """The per-rank distillation term of ``kind`` (see the module docstring).

    ``image``/``text``: the student's local normalised embeddings (with gradient), ``logit_scale``
    its ``exp(logit_scale)``; ``teacher``: the teacher's embeddings of the same local samples.
    Gathers over the process group like every loss (the student's with gradient, the teacher's
    without)."""
    if kind not in KINDS:
        raise ValueError(f"distill.kind={kind!r}: must be one of {', '.join(KINDS)}")
    if not torch.is_tensor(logit_scale):
        logit_scale = torch.tensor(float(logit_scale), device=image.device)
    scale = logit_scale.squeeze()
    dtype = torch.float32 if image.dtype in (torch.float16, torch.bfloat16) else image.dtype
    teacher_image = teacher.image.to(image.device, dtype)
    teacher_text = teacher.text.to(image.device, dtype)
    offset = get_rank() * image.shape[0]
    if kind == "features":
        student_image, student_text = project(image, projection), project(text, projection)
        image_part = (student_image.to(dtype) - teacher_image).pow(2).sum(1).mean()
        text_part = (student_text.to(dtype) - teacher_text).pow(2).sum(1).mean()
        return (image_part + text_part) / 2
    all_teacher_image = gather_no_grad(teacher_image)
    all_teacher_text = gather_no_grad(teacher_text)
    if kind == "interactive":
        student_image, student_text = project(image, projection), project(text, projection)
        statistic = LogSumExp(exclude_positive=False)
        image_to_text = _score(statistic, student_image, all_teacher_text.to(student_image.dtype),
                               scale, offset, chunk_size, subtract_positive=True)
        text_to_image = _score(statistic, student_text, all_teacher_image.to(student_text.dtype),
                               scale, offset, chunk_size, subtract_positive=True)
        return (image_to_text + text_to_image) / 2
    teacher_scale = teacher.logit_scale.to(image.device, dtype).squeeze()
    all_image, all_text = gather_with_grad(image), gather_with_grad(text)
    image_to_text = _score(SoftTargetRows(teacher_image, all_teacher_text, teacher_scale, offset),
                           image, all_text, scale, offset, chunk_size, subtract_positive=False)
    text_to_image = _score(SoftTargetRows(teacher_text, all_teacher_image, teacher_scale, offset),
                           text, all_image, scale, offset, chunk_size, subtract_positive=False)
    return (image_to_text + text_to_image) / 2


class DistilledLoss(nn.Module):
    """``loss.name``'s loss plus ``weight`` times the distillation term of ``kind``.

    Called exactly like the wrapped loss (GradCache passes the concatenated features of all
    micro-batches); the teacher's embeddings of the same rows, in the same order, are handed over
    before the call with :meth:`set_teacher` (the loop's :class:`~vlcontrast.distill.Distiller`
    does it). ``projection`` (``features``/``interactive`` with another width) is a module that
    lives in the student model, so the optimizer, the gradient reduction and the checkpoints treat
    it like any weight; :attr:`model_parameters` names it for GradCache, which computes the loss
    on detached features and must carry its gradient back through the model's backward.
    The wrapped loss's state (``state_dict``, ``rollback``) is the wrapped loss's own.
    """

    def __init__(self, loss: nn.Module, *, kind: str, weight: float, chunk_size: int = 0,
                 projection: nn.Module | None = None):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"distill.kind={kind!r}: must be one of {', '.join(KINDS)}")
        self.loss = loss
        self.kind, self.weight, self.chunk_size = kind, float(weight), int(chunk_size)
        # Not a submodule: its weights belong to the model (and the model's checkpoint).
        self.__dict__["projection"] = projection
        self.teacher: TeacherBatch | None = None

    # The trainer asks the loss for these; they are the wrapped loss's.
    @property
    def name(self) -> str:
        return self.loss.name

    @property
    def needs_sample_ids(self) -> bool:
        return getattr(self.loss, "needs_sample_ids", False)

    @property
    def needs_momentum_features(self) -> bool:
        return getattr(self.loss, "needs_momentum_features", False)

    @property
    def ema_decay(self):
        return getattr(self.loss, "ema_decay", None)

    @property
    def uses_logit_bias(self) -> bool:
        return getattr(self.loss, "uses_logit_bias", False)

    @property
    def model_parameters(self) -> list[nn.Parameter]:
        """Trainable model parameters used by the term besides the features (the projection)."""
        return [] if self.projection is None else list(self.projection.parameters())

    def rollback(self) -> None:
        self.loss.rollback()

    def set_epoch(self, epoch: int) -> None:
        self.loss.set_epoch(epoch)

    def state_dict(self, *args, **kwargs):
        return self.loss.state_dict(*args, **kwargs)

    def load_state_dict(self, state, *args, **kwargs):
        return self.loss.load_state_dict(state, *args, **kwargs)

    def set_teacher(self, teacher: TeacherBatch) -> None:
        self.teacher = teacher

    def forward(self, image_features, text_features, logit_scale, logit_bias=None,
                sample_ids=None, step=None, momentum_features=None):
        if self.teacher is None:
            raise RuntimeError("distillation: no teacher embeddings were set for this step")
        if self.teacher.image.shape[0] != image_features.shape[0]:
            raise RuntimeError(f"distillation: {self.teacher.image.shape[0]} teacher rows for "
                               f"{image_features.shape[0]} student rows")
        result = self.loss(image_features, text_features, logit_scale, logit_bias,
                           sample_ids=sample_ids, step=step, momentum_features=momentum_features)
        term = distill_term(self.kind, image_features, text_features, logit_scale, self.teacher,
                            projection=self.projection, chunk_size=self.chunk_size)
        result["student_loss"] = result["loss"].detach()
        result["distill_loss"] = term.detach()
        result["loss"] = result["loss"] + self.weight * term.to(result["loss"].dtype)
        return result
