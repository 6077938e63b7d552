"""SogCLR: the global contrastive loss with constant gamma and a fixed temperature (``sogclr``).

The same estimator as :mod:`vlcontrast.losses.fastclip` (a per-sample moving average ``u_i`` of
``g_i = (1/K) sum_{j != i} exp((c_ij - c_ii) / tau)`` per direction, gradient
``tau * grad(g_i) / u_i``) in SogCLR's original setting: ``gamma`` constant (SogCLR and LibAUC's
``GCLoss`` use 0.9) and ``tau`` the model's ``logit_scale``, not trained. docs/losses.md, ``sogclr``.
"""

from __future__ import annotations

from typing import Literal

from vlcontrast.losses.fastclip import FAST_CLIP_EPS, FastCLIPLoss
from vlcontrast.losses.registry import register_loss


@register_loss
class SogCLRLoss(FastCLIPLoss):
    """SogCLR (Yuan et al. 2022): ``fastclip`` with constant ``gamma`` and a fixed temperature.

    Args:
        gamma: weight of the batch estimate in the moving average.
        shard_buffer: shard ``u`` by sample id across ranks.
        recipe: ``paper`` or ``fast_clip`` (fast_clip's code: ``eps``, the reset of tiny ``u``,
            ``gamma = 1`` in the first epoch, no factor ``tau`` without ``multiply_tau``).
        eps, multiply_tau: as for ``fastclip`` (``fast_clip`` recipe only).
    """

    name = "sogclr"

    def __init__(self, gamma: float = 0.9, shard_buffer: bool = False,
                 recipe: Literal["paper", "fast_clip"] = "paper", eps: float = FAST_CLIP_EPS,
                 multiply_tau: bool = False, *, chunk_size: int = 0, id_space: int = 0):
        super().__init__(gamma=gamma, gamma_schedule="constant", temperature="fixed",
                         shard_buffer=shard_buffer, recipe=recipe, eps=eps,
                         multiply_tau=multiply_tau, chunk_size=chunk_size, id_space=id_space)
