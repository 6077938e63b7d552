"""DCLW, decoupled contrastive learning with a weighted positive (docs/losses.md, row ``dclw``).

Per anchor (image→text shown; the same ``w`` serves both directions)::

    l_i = -w_i L_ii + logsumexp_{j != i} L_ij
    w_i = 2 - N * softmax_k(c_kk / sigma)_i

``c_kk`` is the positive cosine of pair ``k``; the softmax runs over the **global** batch (all ranks)
and ``w`` is detached. ``sigma -> inf`` gives ``w = 1``, i.e. DCL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vlcontrast.errors import LossOptionError
from vlcontrast.losses.base import ContrastiveLoss, LogSumExp, PairBatch, RowContext, row_dtype
from vlcontrast.losses.registry import register_loss


@dataclass(kw_only=True)
class WeightedRows(RowContext):
    """DCLW's rows: ``weights`` is ``w_i`` of each local anchor (detached)."""

    weights: Tensor


@register_loss
class DCLWLoss(ContrastiveLoss):
    """DCL with the positive term reweighted by how easy the pair is within the global batch.

    Args:
        sigma: temperature of the softmax over positive cosines (paper default 0.5).
    """

    name = "dclw"

    def __init__(self, sigma: float = 0.5, *, chunk_size: int = 0):
        super().__init__(chunk_size=chunk_size)
        if not sigma > 0:  # NaN too; inf is DCL
            raise LossOptionError(self.name, "must be > 0", sigma=sigma)
        self.sigma = float(sigma)

    @torch.no_grad()
    def prepare(self, batch: PairBatch) -> dict:
        """``w`` of the global batch, from the gathered features (cheap: ``N x D``)."""
        dtype = row_dtype(batch.all_image.dtype)
        positive_cosines = (batch.all_image.to(dtype) * batch.all_text.to(dtype)).sum(-1)
        weights = 2 - batch.global_size * torch.softmax(positive_cosines / self.sigma, dim=0)
        return {"weights": weights}

    def row_context(self, batch: PairBatch, direction: str, state: dict) -> WeightedRows:
        return WeightedRows(weights=batch.local_rows(state["weights"]))

    def row_statistic(self) -> LogSumExp:
        return LogSumExp(exclude_positive=True)

    def statistic_terms(self, value: Tensor, positive: Tensor, context: RowContext,
                        num_negatives: int) -> dict[str, Tensor]:
        return {"loss": value - context.weights * positive}

    def reduce(self, batch: PairBatch, terms: list[dict[str, Tensor]], state: dict) -> dict:
        result = super().reduce(batch, terms, state)
        weights = state["weights"]
        result.update(weight_min=weights.min(), weight_max=weights.max(), weight_std=weights.std())
        return result
