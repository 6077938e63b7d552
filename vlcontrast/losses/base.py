"""Machinery shared by every contrastive loss: gathering, logit row blocks, chunking, diagnostics.

A loss in this package is a :class:`ContrastiveLoss`. Its ``forward`` gathers the global batch
*with gradient* when a process group with more than one rank exists, then for each direction
(image→text: local images against all texts; text→image: local texts against all images) scores
the **local** anchors against the gathered candidates, ``logits = (scale * anchors) @ candidates.T``,
with the positive of local row ``i`` at global column ``rank * B_local + i``.

A loss touches its logit rows only through one number per row, a :class:`RowStatistic` (a
logsumexp over the negatives, HCL's tilted mass, BCL's weighted logsumexp, SigLIP's softplus sum)
whose gradient is written out. That is the one way to write a loss: implement
:meth:`ContrastiveLoss.row_statistic` (which statistic) and :meth:`ContrastiveLoss.statistic_terms`
(per-anchor terms from the statistic, the positive logit and the rows' :class:`RowContext`).
Dense mode computes the statistic over one ``[B_local, B_global]`` block. With ``chunk_size > 0``
:class:`_ChunkedStatistic` cuts the rows into blocks of at most ``chunk_size`` anchors, keeps none
of them, and in backward recomputes only each block's matmul and the statistic's gradient
(Inf-CL's scheme, for every loss): one extra matmul over dense, at most ``chunk_size x B_global``
logits alive at any time. Quantities normalised over the global batch (DCLW's weights, DeCL's
buffer look-ups) are computed once per step in :meth:`ContrastiveLoss.prepare` and handed to the
rows through the :class:`RowContext`.

The per-rank ``loss`` is the mean over the local anchors (and over directions), so the mean over
ranks is the global-batch loss; the definitions are in ``docs/losses.md`` and the guide to writing
a loss is ``docs/losses-guide.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from vlcontrast.distributed import gather_no_grad, gather_with_grad, get_rank, get_world_size
from vlcontrast.errors import LossOptionError

IMAGE_TO_TEXT = "image_to_text"
TEXT_TO_IMAGE = "text_to_image"


@dataclass
class PairBatch:
    """One step's features: the local micro-batch and the gathered global batch."""

    image: Tensor
    text: Tensor
    all_image: Tensor
    all_text: Tensor
    logit_scale: Tensor
    logit_bias: Tensor | None
    sample_ids: Tensor | None
    step: int | None
    momentum_features: tuple[Tensor, Tensor] | None
    rank: int
    world_size: int

    @property
    def local_size(self) -> int:
        return self.image.shape[0]

    @property
    def global_size(self) -> int:
        return self.all_image.shape[0]

    @property
    def num_negatives(self) -> int:
        """``K = N_global - 1``."""
        return self.global_size - 1

    @property
    def offset(self) -> int:
        """Global index of local row 0."""
        return self.rank * self.local_size

    def local_rows(self, tensor: Tensor) -> Tensor:
        """The slice of a global-batch tensor that belongs to this rank's anchors."""
        return tensor[self.offset:self.offset + self.local_size]

    def positives(self) -> Tensor:
        return torch.arange(self.offset, self.offset + self.local_size, device=self.image.device)

    def anchors_and_candidates(self, direction: str) -> tuple[Tensor, Tensor]:
        if direction == IMAGE_TO_TEXT:
            return self.image, self.all_text
        return self.text, self.all_image


@dataclass(kw_only=True)
class RowContext:
    """What one direction's anchor rows need besides their logits: per-anchor tensors ``[B_local]``.

    ``offset`` (optional) is added to every logit of row ``i`` before the statistic (SigLIP's bias);
    the base applies it in dense and chunked mode and returns its gradient. ``row_scale``
    (optional, no gradient) multiplies row ``i``'s logits, its positive included, on top of the
    loss's scale: a temperature per anchor (FastCLIP's individual temperatures). A loss that needs more
    (DCLW's weights, DeCL's rate estimates) subclasses this dataclass with typed fields of its own
    and returns an instance from :meth:`ContrastiveLoss.row_context`.
    """

    offset: Tensor | None = None
    row_scale: Tensor | None = None


# --------------------------------------------------------------------------------------------
# Row helpers used by the row statistics.


class _RowLogSumExp(torch.autograd.Function):
    """``logsumexp`` over dim 1 through the fused softmax kernels.

    ``torch.logsumexp`` is composite on CPU (max, sub, exp, sum, log, add: six passes over the
    block, two allocating, and three more in backward); ``log_softmax``/``softmax`` are single
    row kernels. Forward: ``lse_i = L[i, r_i] - log_softmax(L)[i, r_i]`` at a finite reference
    column ``r_i`` (rounding ``~eps * |L[i, r_i] - lse_i| <= eps * (2 s + log N)``, the logits'
    own precision); backward: ``softmax(L) * grad``. The block is saved, not copied.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, reference: Tensor) -> Tensor:
        reference = reference[:, None]
        log_probabilities = torch.log_softmax(logits, dim=1)
        lse = logits.gather(1, reference) - log_probabilities.gather(1, reference)
        ctx.save_for_backward(logits)
        return lse.squeeze(1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (logits,) = ctx.saved_tensors
        return torch.softmax(logits, dim=1).mul_(grad[:, None]), None


def row_logsumexp(logits: Tensor, reference: Tensor) -> Tensor:
    """``logsumexp_j logits[i, j]``; ``reference[i]``: any column whose entry is finite."""
    return _RowLogSumExp.apply(logits, reference)


def fill_positives_(logits: Tensor, positives: Tensor, value: float = -math.inf) -> Tensor:
    """Overwrite each row's positive entry in place (``-inf`` removes it from a logsumexp).

    Only call this on a tensor the caller just created (a matmul output or an arithmetic result):
    autograd has not saved it, so the in-place write is legal and saves a ``rows x N`` copy.
    """
    # A scalar scatter: no host value is copied to the device.
    return logits.scatter_(1, positives[:, None], value)


def negatives_logsumexp(logits: Tensor, positives: Tensor) -> Tensor:
    """``logsumexp_{j != pos_i} logits[i, j]``; consumes ``logits`` (in place, see above)."""
    return row_logsumexp(fill_positives_(logits, positives), (positives + 1) % logits.shape[1])


def row_dtype(dtype: torch.dtype) -> torch.dtype:
    """Row reductions run in at least float32 (bf16/fp16 logsumexp loses the positive's gradient)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def logit_dtype(features: Tensor) -> torch.dtype:
    """The dtype of a logit matrix ``(s * features) @ candidates.T`` computed here and now.

    Under ``torch.autocast`` for the features' device type, a matmul of float32 or 16-bit
    features runs in the autocast dtype (an open_clip-style loop calls the loss inside its
    autocast block); float64 is never cast. Otherwise it is the features' own dtype.
    """
    device_type = features.device.type
    if (features.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and torch.amp.is_autocast_available(device_type)  # not "meta"
            and torch.is_autocast_enabled(device_type)):
        return torch.get_autocast_dtype(device_type)
    return features.dtype


# --------------------------------------------------------------------------------------------
# Row statistics: one number per anchor row of a logit block, with a written-out gradient.


class RowStatistic:
    """``value_i = f(L_i.)`` for each row of a block, in three forms.

    ``dense(logits, positives)``: an autograd op over a whole block (dense mode). ``forward`` and
    ``backward`` are its graph-free halves for the chunked mode: ``forward`` returns the values and
    per-row tensors to keep (``aux``); ``backward`` gets the recomputed block and returns
    ``grad_i * d value_i / d L_ij``. All three may overwrite ``logits`` (always a fresh block).
    """

    def dense(self, logits: Tensor, positives: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, logits: Tensor, positives: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        raise NotImplementedError

    def backward(self, logits: Tensor, positives: Tensor, value: Tensor, aux: tuple[Tensor, ...],
                 grad: Tensor) -> Tensor:
        raise NotImplementedError


class LogSumExp(RowStatistic):
    """``logsumexp_j L_ij``, over the negatives only when ``exclude_positive``."""

    def __init__(self, exclude_positive: bool):
        self.exclude_positive = exclude_positive

    def _prepare(self, logits: Tensor, positives: Tensor) -> tuple[Tensor, Tensor]:
        if self.exclude_positive:
            return fill_positives_(logits, positives), (positives + 1) % logits.shape[1]
        return logits, positives

    def dense(self, logits: Tensor, positives: Tensor) -> Tensor:
        return row_logsumexp(*self._prepare(logits, positives))

    def forward(self, logits, positives):
        logits, _ = self._prepare(logits, positives)
        shift = logits.amax(dim=1, keepdim=True)  # finite: every row has a finite entry
        return shift.squeeze(1) + logits.sub_(shift).exp_().sum(dim=1).log_(), ()  # in place

    def backward(self, logits, positives, value, aux, grad):
        logits, _ = self._prepare(logits, positives)
        return logits.sub_(value[:, None]).exp_().mul_(grad[:, None])  # softmax * grad, in place


# --------------------------------------------------------------------------------------------


class ContrastiveLoss(nn.Module):
    """Base of every loss: ``forward`` returns ``{"loss": per-rank scalar, **diagnostics}``.

    Subclasses set ``name``, optionally ``directions`` (SigLIP scores one direction), and implement
    :meth:`row_statistic` and :meth:`statistic_terms`; hooks :meth:`scale`, :meth:`prepare`,
    :meth:`row_context`, :meth:`reduce` and :meth:`rollback` cover losses with batch-global
    quantities or training state. A loss that wants the number of distinct sample ids declares an
    ``id_space`` keyword in its ``__init__`` (``build_loss`` passes it only then).
    """

    name = ""
    directions: tuple[str, ...] = (IMAGE_TO_TEXT, TEXT_TO_IMAGE)
    uses_logit_bias = False
    needs_sample_ids = False
    needs_momentum_features = False
    ema_decay: float | None = None
    diagnostics = True
    """Add the similarity diagnostics to the result; the trainer turns them off between log
    steps (a dozen small kernels a step that nobody reads)."""
    _sizes_checked_at = 1
    """The world size at which this instance last checked that every rank passes the same local
    batch size (:func:`check_local_sizes`, once: at its first forward under that world size)."""

    def __init__(self, *, chunk_size: int = 0):
        super().__init__()
        if chunk_size < 0:
            raise LossOptionError(self.name or type(self).__name__, "must be >= 0",
                                  chunk_size=chunk_size)
        self.chunk_size = int(chunk_size)

    # ---- hooks ------------------------------------------------------------------------------

    def scale(self, batch: PairBatch) -> Tensor | float:
        """Multiplier of the cosines in the logits (``logit_scale``; Balanced uses its ``alpha``)."""
        return batch.logit_scale

    def prepare(self, batch: PairBatch) -> dict:
        """Batch-global quantities of this step (computed once, before any block)."""
        return {}

    def row_context(self, batch: PairBatch, direction: str, state: dict) -> RowContext:
        """What the anchor rows of ``direction`` need besides their logits (see :class:`RowContext`)."""
        return RowContext()

    def row_statistic(self) -> RowStatistic:
        """The one per-row statistic of the logit block this loss needs."""
        raise NotImplementedError(f"{type(self).__name__} must implement row_statistic()")

    def statistic_terms(self, value: Tensor, positive: Tensor, context: RowContext,
                        num_negatives: int) -> dict[str, Tensor]:
        """Per-anchor terms from the rows' statistic (``"loss"``, unless :meth:`reduce` is overridden).

        ``value`` is the statistic of each local anchor row, ``positive`` its positive logit
        ``L[i, pos_i]`` (computed from the features, so its gradient never passes through a
        ``rows x N`` tensor), ``context`` the rows' :class:`RowContext`, ``num_negatives`` ``K``.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement statistic_terms()")

    def reduce(self, batch: PairBatch, terms: list[dict[str, Tensor]],
               state: dict) -> dict[str, Tensor | float]:
        """Per-rank loss from the per-anchor terms of each direction: mean over anchors and directions."""
        loss = torch.stack([t["loss"].mean() for t in terms]).mean()
        return {"loss": loss}

    def set_epoch(self, epoch: int) -> None:
        """The data epoch (0-based) of the coming training step; the trainer calls it before every
        step. A loss whose schedule counts epochs (FastCLIP's ``fast_clip`` recipe) keeps it;
        the others ignore it."""

    def rollback(self) -> None:
        """Undo the state changes made by the last ``forward`` (e.g. DeCL's buffer writes).

        The trainer calls it when the step that forward belonged to is skipped (a non-finite loss
        or gradient), so a skipped step leaves the loss exactly as it was. Stateless losses have
        nothing to undo.
        """

    def rollback_where(self, skipped: Tensor) -> None:
        """:meth:`rollback` when the 0-dim device flag ``skipped`` is non-zero, without reading it
        on the host (the trainer calls it after every step). Stateless losses have nothing to
        undo."""

    # ---- driver -----------------------------------------------------------------------------

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Tensor | float,
                logit_bias: Tensor | None = None, sample_ids: Tensor | None = None,
                step: int | None = None,
                momentum_features: tuple[Tensor, Tensor] | None = None) -> dict[str, Tensor | float]:
        batch = self.make_batch(image_features, text_features, logit_scale, logit_bias, sample_ids,
                                step, momentum_features)
        scale = self.scale(batch)
        state = self.prepare(batch)
        # L_ii is the same number in both directions: computed once, from the local pairs (the
        # gathered copies of this rank's rows are the same values; other ranks never use them).
        # A 16-bit logit matrix (16-bit features, or float32 ones under autocast): each direction
        # takes its L_ii rounded as its own matrix entry is (score_rows), the number its rows'
        # statistic saw (else InfoNCE could fall below 0 by the rounding).
        matrix_dtype = logit_dtype(batch.image)
        positive = (scale * (batch.image * batch.text).sum(1)
                    if matrix_dtype == row_dtype(matrix_dtype) == batch.image.dtype else None)
        terms = []
        for direction in self.directions:
            anchors, candidates = batch.anchors_and_candidates(direction)
            context = self.row_context(batch, direction, state)
            terms.append(self.score_rows(anchors, candidates, scale, batch.offset, context,
                                         batch.num_negatives, positive))
        result = self.reduce(batch, terms, state)
        if self.diagnostics:
            result.update(similarity_diagnostics(batch))
        return result

    def make_batch(self, image_features, text_features, logit_scale, logit_bias, sample_ids, step,
                   momentum_features) -> PairBatch:
        if image_features.shape != text_features.shape or image_features.dim() != 2:
            raise ValueError(f"{self.name}: image and text features must both be [B, D], got "
                             f"{tuple(image_features.shape)} and {tuple(text_features.shape)}")
        if not torch.is_tensor(logit_scale):
            logit_scale = torch.tensor(float(logit_scale), device=image_features.device)
        world_size = get_world_size()
        if world_size != self._sizes_checked_at:
            # Once, not every step: a size that differs between ranks is a set-up error (the
            # gather would abort one rank in C++ and leave the others waiting for the timeout),
            # and the first step synchronises the ranks anyway.
            check_local_sizes(self.name or type(self).__name__, image_features)
            self._sizes_checked_at = world_size
        all_image = gather_with_grad(image_features)
        all_text = gather_with_grad(text_features)
        if all_image.shape[0] < 2:
            raise ValueError(f"{self.name}: a contrastive loss needs a global batch of at least 2")
        return PairBatch(image_features, text_features, all_image, all_text, logit_scale.squeeze(),
                         logit_bias, sample_ids, step, momentum_features, get_rank(), world_size)

    def score_rows(self, anchors: Tensor, candidates: Tensor, scale: Tensor | float,
                   first_positive: int, context: RowContext, num_negatives: int,
                   positive: Tensor | None = None) -> dict[str, Tensor]:
        """Per-anchor terms of all local rows: one block (dense) or recomputed blocks (chunked).

        Row ``i``'s positive is candidate ``first_positive + i``.
        """
        statistic = self.row_statistic()
        rows = anchors.shape[0]
        if context.row_scale is not None:
            # Scaling the anchors scales their rows' logits: L_ij = r_i * s * <a_i, c_j>.
            row_scale = context.row_scale.detach()
            anchors = anchors * row_scale.to(anchors.dtype)[:, None]
            if positive is not None:
                positive = positive * row_scale.to(positive.dtype)
        if self.chunk_size == 0 or self.chunk_size >= rows:
            positives = torch.arange(first_positive, first_positive + rows, device=anchors.device)
            scaled = scale * anchors
            logits = scaled @ candidates.T
            matrix_dtype = logits.dtype  # 16-bit under autocast, whatever the features' dtype
            logits = logits.to(row_dtype(logits.dtype))  # fresh: the statistic may overwrite it
            if positive is None or positive.dtype != matrix_dtype:
                positive = _positive_logits(scaled, candidates, first_positive, matrix_dtype)
            if context.offset is not None:
                logits = logits.add_(context.offset.to(logits.dtype)[:, None])
            value = statistic.dense(logits, positives)
        else:
            scale_tensor = scale if torch.is_tensor(scale) else None
            matrix_dtype = logit_dtype(anchors)
            value = _ChunkedStatistic.apply(statistic, self.chunk_size, first_positive, scale,
                                            anchors, candidates, scale_tensor, context.offset,
                                            matrix_dtype)
            if positive is None or positive.dtype != matrix_dtype:
                positive = _positive_logits(scale * anchors, candidates, first_positive,
                                            matrix_dtype)
        return self.statistic_terms(value, positive, context, num_negatives)


def check_local_sizes(name: str, features: Tensor) -> None:
    """Collective: every rank raises the same one-line error when the ranks' local batch sizes
    differ (the contract needs one ``B``: rank ``r``'s row ``i`` has its positive at global column
    ``r * B + i``)."""
    size = torch.tensor([features.shape[0]], dtype=torch.long, device=features.device)
    sizes = gather_no_grad(size).tolist()
    if len(set(sizes)) > 1:
        shown = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(sizes))
        raise ValueError(f"{name}: the ranks pass different local batch sizes ({shown}); every "
                         "rank must pass the same number of pairs at every step: give each rank "
                         "the same batch size and drop a last partial batch (drop_last=True)")


def _positive_logits(scaled: Tensor, candidates: Tensor, first_positive: int,
                     matrix_dtype: torch.dtype) -> Tensor:
    """``L[i, first_positive + i]`` from the features (in the row dtype), rounded as the logit
    matrix ``scaled @ candidates.T`` is when computed in ``matrix_dtype`` (16 bits for 16-bit
    features or under autocast: both factors rounded to it, products summed in float32, the sum
    rounded to it), so a row's positive is the number its statistic saw in the matrix."""
    dtype = row_dtype(matrix_dtype)
    # The positives are consecutive columns: a slice, whose backward is cheap.
    paired = candidates.narrow(0, first_positive, scaled.shape[0])
    if dtype == matrix_dtype:
        return (scaled.to(dtype) * paired.to(dtype)).sum(1)
    # 16-bit factors multiply exactly in float32 (8 or 11 significant bits each).
    positive = (scaled.to(matrix_dtype).to(dtype) * paired.to(matrix_dtype).to(dtype)).sum(1)
    return positive.to(matrix_dtype).to(dtype)


class _ChunkedStatistic(torch.autograd.Function):
    """Chunked mode of a loss with a :class:`RowStatistic`: ``value_i`` for every local row.

    Forward computes each block's logits ``(s A_b) C^T (+ offset_b)``, the statistic and drops the
    block. Backward recomputes the block's logits, asks the statistic for ``G = grad * dvalue/dL``
    and applies the matmul's chain rule by hand: ``dA_b = s G C``, ``dC += G^T (s A_b)``,
    ``ds += sum(A_b * (G C))``, ``d offset_b = G 1``. So chunking costs one extra matmul per block
    and no autograd graph is built at all.

    ``matrix_dtype`` is the dtype the blocks' matmul runs in (:func:`logit_dtype` at the forward:
    the autocast dtype under autocast). Both passes cast the factors to it explicitly, so the
    backward, which runs outside the forward's autocast, recomputes bitwise the forward's blocks.
    """

    @staticmethod
    def forward(ctx, statistic, chunk, first_positive, scale, anchors, candidates, scale_tensor,
                offset, matrix_dtype):
        values, auxes = [], []
        buffer = _ChunkedStatistic.block_buffer(anchors, candidates, chunk, matrix_dtype)
        factors = candidates.to(matrix_dtype)
        with torch.no_grad():
            for start in range(0, anchors.shape[0], chunk):
                logits = _ChunkedStatistic.block_logits(scale, anchors, factors, offset, start,
                                                        chunk, matrix_dtype, buffer)
                positives = torch.arange(first_positive + start,
                                         first_positive + start + logits.shape[0],
                                         device=logits.device)
                value, aux = statistic.forward(logits, positives)
                values.append(value)
                auxes.append(aux)
        value = torch.cat(values)
        aux = tuple(torch.cat(parts) for parts in zip(*auxes))
        ctx.statistic, ctx.chunk, ctx.first_positive = statistic, chunk, first_positive
        ctx.matrix_dtype = matrix_dtype
        ctx.scale = None if scale_tensor is not None else scale
        ctx.save_for_backward(anchors, candidates, scale_tensor, offset, value, *aux)
        return value

    @staticmethod
    def block_buffer(anchors, candidates, chunk, matrix_dtype) -> Tensor | None:
        """One ``chunk x N`` block reused by every block of the pass (no allocation and page
        faults per block); ``None`` when the logits need a cast to the row dtype anyway."""
        if not matrix_dtype == row_dtype(matrix_dtype) == anchors.dtype:
            return None
        return anchors.new_empty(min(chunk, anchors.shape[0]), candidates.shape[0])

    @staticmethod
    def block_logits(scale, anchors, candidates, offset, start, chunk, matrix_dtype, buffer=None):
        """The block's logits in the row dtype; ``candidates`` already in ``matrix_dtype``."""
        scaled = (scale * anchors[start:start + chunk]).to(matrix_dtype)
        if buffer is not None:
            logits = torch.mm(scaled, candidates.T, out=buffer[:scaled.shape[0]])
        else:
            logits = (scaled @ candidates.T).to(row_dtype(matrix_dtype))
        if offset is not None:
            logits.add_(offset[start:start + chunk].to(logits.dtype)[:, None])
        return logits

    @staticmethod
    def backward(ctx, grad):
        anchors, candidates, scale_tensor, offset, value, *aux = ctx.saved_tensors
        needs = ctx.needs_input_grad
        scale = scale_tensor.detach() if scale_tensor is not None else ctx.scale
        grad_anchors = torch.empty_like(anchors) if needs[4] else None
        grad_candidates = torch.zeros_like(candidates) if needs[5] else None
        grad_scale = torch.zeros((), dtype=torch.float64, device=anchors.device) if needs[6] \
            else None
        grad_offset = torch.empty_like(offset) if needs[7] else None
        chunk, matrix_dtype = ctx.chunk, ctx.matrix_dtype
        buffer = _ChunkedStatistic.block_buffer(anchors, candidates, chunk, matrix_dtype)
        factors = candidates.to(matrix_dtype)
        for start in range(0, anchors.shape[0], chunk):
            block = slice(start, start + chunk)
            logits = _ChunkedStatistic.block_logits(scale, anchors, factors, offset, start, chunk,
                                                    matrix_dtype, buffer)
            positives = torch.arange(ctx.first_positive + start,
                                     ctx.first_positive + start + logits.shape[0],
                                     device=logits.device)
            block_grad = ctx.statistic.backward(logits, positives, value[block],
                                                tuple(a[block] for a in aux), grad[block])
            if grad_offset is not None:
                grad_offset[block] = block_grad.sum(1).to(grad_offset.dtype)
            block_grad = block_grad.to(anchors.dtype)
            if grad_anchors is not None or grad_scale is not None:
                grad_scaled = block_grad @ candidates  # d loss / d (s A_b)
                if grad_anchors is not None:
                    grad_anchors[block] = scale * grad_scaled
                if grad_scale is not None:
                    grad_scale += (anchors[block].double() * grad_scaled.double()).sum()
            if grad_candidates is not None:
                grad_candidates.addmm_(block_grad.T, scale * anchors[block])
        if grad_scale is not None:
            grad_scale = grad_scale.to(scale_tensor.dtype).reshape(scale_tensor.shape)
        return (None, None, None, None, grad_anchors, grad_candidates, grad_scale, grad_offset,
                None)


@torch.no_grad()
def similarity_diagnostics(batch: PairBatch) -> dict[str, Tensor]:
    """Mean positive cosine and mean negative cosine of the local anchors (both directions).

    Computed from feature sums, never from the logit matrix: ``sum_j c_ij = <a_i, sum_j x_j>``.
    Like the loss, the mean over ranks is the global value.
    """
    image, text = batch.image.float(), batch.text.float()
    positive = (image * text).sum(-1)
    image_to_text = (image @ batch.all_text.float().sum(0) - positive) / batch.num_negatives
    text_to_image = (text @ batch.all_image.float().sum(0) - positive) / batch.num_negatives
    return {"positive_similarity": positive.mean(),
            "negative_similarity": (image_to_text.mean() + text_to_image.mean()) / 2}
