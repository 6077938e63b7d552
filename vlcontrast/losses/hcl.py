"""HCL, hard-negative contrastive loss (docs/losses.md, row ``hcl``; Robinson et al. 2021).

As :mod:`debiased`, with the negative mass replaced by its hardness-reweighted estimate::

    sum_{j != i} e^{L_ij}  ->  K * sum_{j != i} e^{(1+beta) L_ij} / sum_{j != i} e^{beta L_ij}

computed in log space as ``log K + logsumexp((1+beta) L) - logsumexp(beta L)``. The importance
weights are not detached. ``beta = 0`` gives ``debiased``.

Both sums share one shift: with ``m_i = max_{j != i} L_ij`` (detached; it cancels exactly),
``d_ij = L_ij - m_i <= 0`` (``-inf`` at the positive, so no ``exp`` sees a positive argument),
``e_ij = exp(d_ij)`` and the weights ``w_ij = exp(beta d_ij)``,
``log-mass - log K = m_i + log S_1 - log S_0`` with ``S_0 = sum_j w_ij`` and
``S_1 = sum_j w_ij e_ij``, and its gradient is ``w * ((1+beta) e / S_1 - beta / S_0)``. The weights
are exponentials of ``beta d``, never powers of ``e``: at ``s = 100`` a negative ``d < -104``
below the hardest one underflows ``e`` to 0 in float32, but its weight ``exp(beta d)`` is still
about 1 for a small ``beta`` (``e^beta`` would make it 0 and the mass ``S_0`` wrong).
:class:`_HardNegativeMass` does this in two ``exp`` passes and keeps ``e`` and ``w`` (one block
when ``beta = 1``, where ``w = e``), where two tilted ``logsumexp`` calls would need six passes and
two saved blocks; :class:`HardNegativeMass` is the same statistic for the chunked mode.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vlcontrast.errors import LossOptionError
from vlcontrast.losses.base import (ContrastiveLoss, LogSumExp, RowContext, RowStatistic,
                                    fill_positives_)
from vlcontrast.losses.debiased import ScaledRows, debiased_row_loss
from vlcontrast.losses.registry import register_loss


def _exps_and_weights(shifted: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """``e = exp(d)`` (in place of ``shifted`` = ``d``) and ``w = exp(beta d)`` (``w = e`` when
    ``beta = 1``). ``w`` comes from ``d``, not as ``e^beta``, which is 0 wherever ``e``
    underflowed."""
    if beta == 1:
        exps = shifted.exp_()
        return exps, exps
    # A beta below the dtype's smallest normal number would round to 0 there and make the
    # positive's -inf * beta a NaN; at that size every finite d gets w = 1 either way.
    tilted = torch.mul(shifted, max(beta, torch.finfo(shifted.dtype).tiny)).exp_()
    return shifted.exp_(), tilted


def _tilted_sums(logits: Tensor, positives: Tensor, beta: float):
    """``e = exp(L - m)`` (0 at the positive; ``m`` the max over negatives),
    ``w = exp(beta (L - m))``, ``m``, ``S_0 = sum w``, ``S_1 = sum w e``.

    ``logits`` becomes ``e`` in place.
    """
    shifted = fill_positives_(logits, positives)  # -inf: e = w = 0 there, excluded from the max
    shift = shifted.amax(dim=1)
    exps, tilted = _exps_and_weights(shifted.sub_(shift[:, None]), beta)
    if beta == 1:
        s0 = exps.sum(dim=1)
        s1 = torch.linalg.vector_norm(exps, dim=1).square_()
    else:
        s0 = tilted.sum(dim=1)
        s1 = torch.linalg.vecdot(tilted, exps, dim=1)
    return exps, tilted, shift, s0, s1


def _tilted_grad(exps: Tensor, tilted: Tensor, s0: Tensor, s1: Tensor, grad: Tensor,
                 beta: float) -> Tensor:
    """``grad * w * ((1+beta) e / S_1 - beta / S_0)`` (one allocation)."""
    out = exps * ((1 + beta) * grad / s1)[:, None]
    return out.sub_((beta * grad / s0)[:, None]).mul_(tilted)


class _HardNegativeMass(torch.autograd.Function):
    """Dense mode: ``logsumexp_{j != i}((1+beta) L) - logsumexp_{j != i}(beta L)``, ``beta > 0``.

    ``logits`` must be fresh (it becomes ``e`` in place and is saved). ``S_0, S_1 >= 1`` (the
    maximum's term is 1), so their logs are finite.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, positives: Tensor, beta: float) -> Tensor:
        exps, tilted, shift, s0, s1 = _tilted_sums(logits, positives, beta)
        ctx.beta = beta
        ctx.save_for_backward(exps, tilted, s0, s1)
        return shift + s1.log() - s0.log()

    @staticmethod
    def backward(ctx, grad: Tensor):
        exps, tilted, s0, s1 = ctx.saved_tensors
        return _tilted_grad(exps, tilted, s0, s1, grad, ctx.beta), None, None


class HardNegativeMass(RowStatistic):
    """HCL's ``log(sum e^{(1+beta) L} / sum e^{beta L})`` over the negatives (``beta > 0``)."""

    def __init__(self, beta: float):
        self.beta = beta

    def dense(self, logits, positives):
        return _HardNegativeMass.apply(logits, positives, self.beta)

    def forward(self, logits, positives):
        _, _, shift, s0, s1 = _tilted_sums(logits, positives, self.beta)
        return shift + s1.log() - s0.log(), (shift, s0, s1)

    def backward(self, logits, positives, value, aux, grad):
        shift, s0, s1 = aux
        shifted = fill_positives_(logits, positives).sub_(shift[:, None])
        exps, tilted = _exps_and_weights(shifted, self.beta)
        return _tilted_grad(exps, tilted, s0, s1, grad, self.beta)


@register_loss
class HCLLoss(ContrastiveLoss):
    """Debiased loss whose negatives are importance-weighted towards the hard ones.

    Args:
        tau_plus: class prior, as in ``debiased``.
        beta: hardness concentration (0: uniform, i.e. ``debiased``).
    """

    name = "hcl"

    def __init__(self, tau_plus: float = 0.1, beta: float = 1.0, *, chunk_size: int = 0):
        super().__init__(chunk_size=chunk_size)
        if not 0 <= tau_plus < 1:
            raise LossOptionError(self.name, "must be in [0, 1)", tau_plus=tau_plus)
        self.tau_plus = float(tau_plus)
        if not 0 <= beta <= torch.finfo(torch.float32).max:  # NaN too; inf in float32 too
            raise LossOptionError(self.name, "must be >= 0 and finite (at most "
                                  f"{torch.finfo(torch.float32).max:.3g}, float32's largest)",
                                  beta=beta)
        self.beta = float(beta)

    def row_context(self, batch, direction, state) -> ScaledRows:
        return ScaledRows(scale=batch.logit_scale.detach())

    def row_statistic(self) -> RowStatistic:
        # beta = 0 is exactly debiased (and has no 0^0 at the positive to special-case).
        return LogSumExp(exclude_positive=True) if self.beta == 0 else HardNegativeMass(self.beta)

    def statistic_terms(self, value: Tensor, positive: Tensor, context: RowContext,
                        num_negatives: int) -> dict[str, Tensor]:
        log_negative_mass = value if self.beta == 0 else math.log(num_negatives) + value
        return {"loss": debiased_row_loss(positive, log_negative_mass, num_negatives,
                                          self.tau_plus, context.scale.to(value.dtype))}
