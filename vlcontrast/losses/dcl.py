"""DCL, decoupled contrastive learning (docs/losses.md, row ``dcl``; Yeh et al. 2022).

Per anchor (image→text shown)::

    l_i = -L_ii + logsumexp_{j != i} L_ij    (the positive is removed from the denominator)

Unbounded below as ``logit_scale`` grows; it is not >= 0.
"""

from __future__ import annotations

from torch import Tensor

from vlcontrast.losses.base import ContrastiveLoss, LogSumExp, RowContext
from vlcontrast.losses.registry import register_loss


@register_loss
class DCLLoss(ContrastiveLoss):
    """Symmetric decoupled contrastive loss; no options."""

    name = "dcl"

    def __init__(self, *, chunk_size: int = 0):
        super().__init__(chunk_size=chunk_size)

    def row_statistic(self) -> LogSumExp:
        return LogSumExp(exclude_positive=True)

    def statistic_terms(self, value: Tensor, positive: Tensor, context: RowContext,
                        num_negatives: int) -> dict[str, Tensor]:
        return {"loss": value - positive}
