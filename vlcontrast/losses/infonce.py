"""InfoNCE, the CLIP loss (docs/losses.md, row ``infonce``).

Per anchor (image→text shown; text→image uses the rows of ``L.T``)::

    l_i = -L_ii + logsumexp_j L_ij          (the positive is in the denominator)

with ``L = logit_scale * cos``; the loss is the mean over anchors, averaged over both directions.
Equal to open_clip ``ClipLoss(gather_with_grad=True)`` in value and gradient.
"""

from __future__ import annotations

from torch import Tensor

from vlcontrast.losses.base import ContrastiveLoss, LogSumExp, RowContext
from vlcontrast.losses.registry import register_loss


@register_loss
class InfoNCELoss(ContrastiveLoss):
    """Symmetric InfoNCE (CLIP); no options."""

    name = "infonce"

    def __init__(self, *, chunk_size: int = 0):
        super().__init__(chunk_size=chunk_size)

    def row_statistic(self) -> LogSumExp:
        return LogSumExp(exclude_positive=False)

    def statistic_terms(self, value: Tensor, positive: Tensor, context: RowContext,
                        num_negatives: int) -> dict[str, Tensor]:
        return {"loss": value - positive}
