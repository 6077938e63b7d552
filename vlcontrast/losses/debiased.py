"""Debiased contrastive loss (docs/losses.md, row ``debiased``; Chuang et al. 2020).

Per anchor (image→text shown), ``K = N_global - 1`` negatives::

    Ng_i = max((sum_{j != i} e^{L_ij} - tau_plus * K * e^{L_ii}) / (1 - tau_plus),  K * e^{-s})
    l_i  = -log(e^{L_ii} / (e^{L_ii} + Ng_i))

The floor uses the detached scale ``s``. ``tau_plus = 0`` gives InfoNCE (the floor can never bind
then, because every ``L_ij >= -s``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from vlcontrast.errors import LossOptionError
from vlcontrast.losses.base import ContrastiveLoss, LogSumExp, RowContext
from vlcontrast.losses.registry import register_loss


def debiased_row_loss(positive: Tensor, log_negative_mass: Tensor, num_negatives: int,
                      tau_plus: float, scale: Tensor) -> Tensor:
    """``-L_ii + log(e^{L_ii} + Ng_i)`` given ``log sum_{j != i} e^{L_ij}`` (or HCL's estimate).

    Everything is shifted by ``M_i = max(L_ii, log_negative_mass_i)`` (detached; the shift cancels
    exactly), so no ``exp`` sees a positive argument. The bracket stays >= ``min(1/2, 1/(2N))``:
    either the shifted positive is 1, or the shifted negative mass is 1 and the debiased estimate
    is >= 1/2 unless the positive is >= 1/(2 tau_plus K).
    """
    shift = torch.maximum(positive, log_negative_mass).detach()
    positive_mass = torch.exp(positive - shift)
    negative_mass = torch.exp(log_negative_mass - shift)
    debiased = (negative_mass - tau_plus * num_negatives * positive_mass) / (1 - tau_plus)
    floor = torch.exp(math.log(num_negatives) - scale.detach() - shift)
    estimate = torch.maximum(debiased, floor)
    return shift - positive + torch.log(positive_mass + estimate)


@dataclass(kw_only=True)
class ScaledRows(RowContext):
    """The rows of a loss whose terms need the logit scale itself (the ``K e^{-s}`` floor)."""

    scale: Tensor


@register_loss
class DebiasedLoss(ContrastiveLoss):
    """Debiased InfoNCE: the negative term corrected for same-class samples among the negatives.

    Args:
        tau_plus: class prior (probability that a "negative" shares the anchor's class).
    """

    name = "debiased"

    def __init__(self, tau_plus: float = 0.1, *, chunk_size: int = 0):
        super().__init__(chunk_size=chunk_size)
        if not 0 <= tau_plus < 1:
            raise LossOptionError(self.name, "must be in [0, 1)", tau_plus=tau_plus)
        self.tau_plus = float(tau_plus)

    def row_context(self, batch, direction, state) -> ScaledRows:
        return ScaledRows(scale=batch.logit_scale.detach())

    def row_statistic(self) -> LogSumExp:
        return LogSumExp(exclude_positive=True)

    def statistic_terms(self, value: Tensor, positive: Tensor, context: RowContext,
                        num_negatives: int) -> dict[str, Tensor]:
        return {"loss": debiased_row_loss(positive, value, num_negatives,
                                          self.tau_plus, context.scale.to(value.dtype))}
