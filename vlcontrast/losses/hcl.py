"""HCL, hard-negative contrastive loss (docs/losses.md, row ``hcl``; Robinson et al. 2021).

As :mod:`debiased`, with the negative mass replaced by its hardness-reweighted estimate::

    sum_{j != i} e^{L_ij}  ->  K * sum_{j != i} e^{(1+beta) L_ij} / sum_{j != i} e^{beta L_ij}

computed in log space as ``log K + logsumexp((1+beta) L) - logsumexp(beta L)``. The importance
weights are not detached. ``beta = 0`` gives ``debiased``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vlcontrast.losses.base import ContrastiveLoss, negatives_logsumexp
from vlcontrast.losses.debiased import debiased_row_loss


class HCLLoss(ContrastiveLoss):
    """Debiased loss whose negatives are importance-weighted towards the hard ones.

    Args:
        tau_plus: class prior, as in ``debiased``.
        beta: hardness concentration (0: uniform, i.e. ``debiased``).
    """

    name = "hcl"

    def __init__(self, tau_plus: float = 0.1, beta: float = 1.0, *, chunk_size: int = 0,
                 id_space: int = 0):
        super().__init__(chunk_size=chunk_size)
        if not 0 <= tau_plus < 1:
            raise ValueError(f"hcl: tau_plus must be in [0, 1), got {tau_plus}")
        self.tau_plus = float(tau_plus)
        self.beta = float(beta)

    def row_context(self, batch, direction, state):
        return {"scale": batch.logit_scale.detach().expand(batch.local_size)}

    def row_terms(self, logits: Tensor, positive: Tensor, positives: Tensor,
                  context: dict[str, Tensor], num_negatives: int) -> dict[str, Tensor]:
        tilted = negatives_logsumexp((1 + self.beta) * logits, positives)
        # The block itself becomes beta * L (in place: nothing saved it), saving a copy.
        scaled = logits if self.beta == 1 else logits.mul_(self.beta)
        normaliser = negatives_logsumexp(scaled, positives)
        log_negative_mass = math.log(num_negatives) + tilted - normaliser
        return {"loss": debiased_row_loss(positive, log_negative_mass, num_negatives,
                                          self.tau_plus, context["scale"].to(logits.dtype))}
