"""SigLIP, the pairwise sigmoid loss (docs/losses.md, row ``siglip``; Zhai et al. 2023).

With ``x_ij = s * c_ij + b`` and labels ``z_ii = +1``, ``z_ij = -1`` otherwise::

    loss = -(1/N) sum_i sum_j log sigmoid(z_ij * x_ij)

One direction covers every pair, so only image rows are scored. Since
``-log sigmoid(x) + log sigmoid(-x) = -x``, a row's term is ``-sum_j log sigmoid(-x_ij) - x_ii``: no
label matrix. (``F.softplus`` would be one pass cheaper, but its linear cut-off above 20 is off by
up to ``e^{-20}`` per entry, visible in float64 gradients at scale 100.) Equal to open_clip ``SigLipLoss``.
"""

from __future__ import annotations

from torch import Tensor
from torch.nn import functional as F

from vlcontrast.losses.base import IMAGE_TO_TEXT, ContrastiveLoss, PairBatch, RowContext, RowStatistic
from vlcontrast.losses.registry import register_loss


class SoftplusSum(RowStatistic):
    """``sum_j -log sigmoid(-x_ij)`` (i.e. ``sum_j softplus(x_ij)``) of the biased logits ``x``."""

    def dense(self, logits, positives):
        return -F.logsigmoid(logits.neg_()).sum(dim=1)  # in place: the block is fresh

    def forward(self, logits, positives):
        return self.dense(logits, positives), ()

    def backward(self, logits, positives, value, aux, grad):
        return logits.sigmoid_().mul_(grad[:, None])


@register_loss
class SigLIPLoss(ContrastiveLoss):
    """Sigmoid loss with a learnable bias (pass ``logit_bias``; ``None`` means no bias)."""

    name = "siglip"
    directions = (IMAGE_TO_TEXT,)
    uses_logit_bias = True

    def __init__(self, *, chunk_size: int = 0):
        super().__init__(chunk_size=chunk_size)

    def row_context(self, batch: PairBatch, direction: str, state: dict) -> RowContext:
        if batch.logit_bias is None:
            return RowContext()
        # The base adds the per-row offset to the block (dense) or inside the chunked Function,
        # which also returns its gradient; expanded to one entry per row as the contract says.
        return RowContext(offset=batch.logit_bias.reshape(()).expand(batch.local_size))

    def row_statistic(self) -> RowStatistic:
        return SoftplusSum()

    def statistic_terms(self, value: Tensor, positive: Tensor, context: RowContext,
                        num_negatives: int) -> dict[str, Tensor]:
        if context.offset is not None:
            positive = positive + context.offset.to(value.dtype)
        return {"loss": value - positive}
