"""Balanced contrastive loss (docs/losses.md, row ``balanced``).

Per anchor (image→text shown), on raw cosines ``c`` (``logit_scale`` is not used)::

    l_i = -c_ii + lam * (1/alpha) * logsumexp_{j != i}(alpha * c_ij)

``include_positive=True`` keeps ``j = i`` in the logsumexp. Identities: ``lam = 1`` is
``dcl(s=alpha) / alpha``; with ``include_positive`` and ``lam = 1`` it is ``infonce(s=alpha) / alpha``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlcontrast.errors import LossOptionError
from vlcontrast.losses.base import ContrastiveLoss, LogSumExp, PairBatch, RowContext
from vlcontrast.losses.registry import register_loss


FLOAT32_MAX = torch.finfo(torch.float32).max


@register_loss
class BalancedLoss(ContrastiveLoss):
    """Alignment term plus a ``lam``-weighted uniformity term at its own temperature ``1/alpha``.

    Args:
        alpha: inverse temperature of the negative term (the blocks' logits are ``alpha * c``).
        lam: weight of the negative term, > 0 (1: DCL at scale ``alpha``, divided by ``alpha``).
        include_positive: keep the positive in the logsumexp (InfoNCE-like).
    """

    name = "balanced"

    def __init__(self, alpha: float = 4.0, lam: float = 2.0, include_positive: bool = False, *,
                 chunk_size: int = 0):
        super().__init__(chunk_size=chunk_size)
        # "finite" in float32, which the logits are computed in: 1e300 is inf there.
        if not 0 < alpha <= FLOAT32_MAX:  # NaN too
            raise LossOptionError(self.name, "must be > 0 and finite (at most "
                                  f"{FLOAT32_MAX:.3g}, float32's largest)", alpha=alpha)
        if not 0 < lam <= FLOAT32_MAX:
            raise LossOptionError(self.name, "must be > 0 and finite (the weight of the uniformity "
                                  "term: at 0 only -c_ii is left, which collapsing every "
                                  "embedding minimises; below 0 the loss is unbounded below)",
                                  lam=lam)
        self.alpha = float(alpha)
        self.lam = float(lam)
        self.include_positive = bool(include_positive)

    def scale(self, batch: PairBatch) -> float:
        return self.alpha

    def row_statistic(self) -> LogSumExp:
        return LogSumExp(exclude_positive=not self.include_positive)

    def statistic_terms(self, value: Tensor, positive: Tensor, context: RowContext,
                        num_negatives: int) -> dict[str, Tensor]:
        return {"loss": (self.lam * value - positive) / self.alpha}
