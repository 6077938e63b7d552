"""FastCLIP: the global contrastive loss with per-sample moving averages (docs/losses.md, ``fastclip``).

Per direction (image→text shown), with ``tau = 1/s`` and the difference form of the negatives'
mass, ``d_ij = c_ij - c_ii``::

    g_i = (1/K) sum_{j != i} exp(d_ij / tau) = exp(logsumexp_{j != i} L_ij - log K - L_ii)
    u_i <- (1 - gamma_t) u_i + gamma_t g_i        per sample id, first visit u_i = g_i
    objective   F = mean_i tau * log(u_i)         (the global contrastive objective, g estimated by u)
    surrogate   l_i = tau_d * g_i / u_i  [+ tau * (log u_i + rho)]

``u`` is detached: the gradient with respect to the features is ``tau * grad(g_i) / u_i``, the
estimator of FastCLIP and SogCLR. ``tau_d`` is ``tau`` detached. The bracket is present only with
``temperature="global"`` (FastCLIP-v3 / RGCL-g): with it the gradient with respect to ``tau`` is
``log u_i + rho + tau * (d g_i / d tau) / u_i``, the gradient of ``tau * log u_i + tau * rho``.
``temperature="fixed"`` uses the model's ``logit_scale`` without gradient (set it with
``model.init_logit_scale``).

``gamma_t``: constant, or FastCLIP's cosine decay from 1 to ``gamma`` over ``gamma_decay_steps``
optimizer steps, ``gamma`` afterwards. ``u`` lives in the per-sample log-space buffer DeCL uses
(replicated or sharded by id, checkpointed, restored by ``rollback`` on a skipped step); a
non-finite stored value is treated as a first visit (reset), as FastCLIP and LibAUC guard it.

With ``gamma = 1`` the average is the current batch's ``g_i`` and the gradient is that of DCL:
``tau * grad(g_i) / g_i = tau * grad(log g_i) = tau * grad(logsumexp_{j != i} L_ij - L_ii)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from vlcontrast.distributed import gather_no_grad
from vlcontrast.losses.base import PairBatch
from vlcontrast.losses.decl import DeCLLoss, DeCLRows, DeCLStep
from vlcontrast.losses.registry import register_loss

TEMPERATURES = ("fixed", "global")
GAMMA_SCHEDULES = ("constant", "cosine")


@dataclass(kw_only=True)
class GlobalContrastiveRows(DeCLRows):
    """The rows of one direction: the buffer's old ``log u`` and the step's temperature."""

    tau: Tensor | None = None


@register_loss
class FastCLIPLoss(DeCLLoss):
    """FastCLIP's global contrastive loss (u per sample and direction, difference form).

    Args:
        gamma: weight of the batch estimate in the moving average (the floor ``gamma_min`` of the
            cosine schedule).
        gamma_schedule: ``constant`` or ``cosine`` (from 1 down to ``gamma`` over
            ``gamma_decay_steps`` optimizer steps).
        gamma_decay_steps: length of the cosine decay in optimizer steps (FastCLIP's
            ``gamma_decay_epochs`` times the steps per epoch).
        temperature: ``fixed`` (the model's ``logit_scale``, not trained) or ``global`` (one
            learnable temperature, FastCLIP-v3's objective with ``rho``).
        rho: FastCLIP-v3's ``rho`` (global temperature only).
        shard_buffer: shard ``u`` by sample id across ranks.
    """

    name = "fastclip"

    def __init__(self, gamma: float = 0.8,
                 gamma_schedule: Literal["constant", "cosine"] = "constant",
                 gamma_decay_steps: int = 0,
                 temperature: Literal["fixed", "global"] = "fixed", rho: float = 8.5,
                 shard_buffer: bool = False, *, chunk_size: int = 0, id_space: int = 0):
        if gamma_schedule not in GAMMA_SCHEDULES:
            raise ValueError(f"{self.name}: gamma_schedule={gamma_schedule!r} is not one of "
                             f"{list(GAMMA_SCHEDULES)}")
        if temperature not in TEMPERATURES:
            raise ValueError(f"{self.name}: temperature={temperature!r} is not one of "
                             f"{list(TEMPERATURES)} (per-sample temperatures are not built yet)")
        if gamma_schedule == "cosine" and gamma_decay_steps < 1:
            raise ValueError(f"{self.name}: gamma_schedule='cosine' needs gamma_decay_steps >= 1 "
                             f"(got {gamma_decay_steps})")
        super().__init__(estimator="buffer", u_mode="mean", gamma=gamma, schedule="loss1",
                         shard_buffer=shard_buffer, chunk_size=chunk_size, id_space=id_space)
        self.gamma_schedule = gamma_schedule
        self.gamma_decay_steps = int(gamma_decay_steps)
        self.temperature = temperature
        self.rho = float(rho)
        self._gamma_now = self.gamma

    def gamma_at(self, step: int | None) -> float:
        """``gamma_t`` of 1-based optimizer step ``step`` (the floor when unknown)."""
        if self.gamma_schedule == "constant" or step is None:
            return self.gamma
        progress = min(1.0, (step - 1) / self.gamma_decay_steps)
        return self.gamma + (1 - self.gamma) * 0.5 * (1 + math.cos(math.pi * progress))

    def scale(self, batch: PairBatch) -> Tensor:
        return batch.logit_scale.detach() if self.temperature == "fixed" else batch.logit_scale

    def prepare(self, batch: PairBatch) -> DeCLStep:
        self._gamma_now = self.gamma_at(batch.step)
        state = super().prepare(batch)
        state.scale = self.scale(batch)
        return state

    def update_rule(self, log_u_old: Tensor, log_mean: Tensor) -> Tensor:
        """``log((1 - gamma_t) u + gamma_t g)``; a first visit or a non-finite ``u`` takes ``g``."""
        gamma = self._gamma_now
        log_mean = log_mean.to(torch.promote_types(log_mean.dtype, log_u_old.dtype))
        keep = (math.log1p(-gamma) + log_u_old if gamma < 1
                else torch.full_like(log_mean, -math.inf))
        blended = torch.logaddexp(keep, math.log(gamma) + log_mean)
        usable = torch.isfinite(log_u_old) & torch.isfinite(blended)
        return torch.where(usable, blended, log_mean)

    def row_context(self, batch: PairBatch, direction: str,
                    state: DeCLStep) -> GlobalContrastiveRows:
        base = super().row_context(batch, direction, state)
        return GlobalContrastiveRows(old_log_u=base.old_log_u, log_u=base.log_u,
                                     tau=1.0 / state.scale)

    def log_g(self, negative: Tensor, positive: Tensor, num_negatives: int) -> Tensor:
        """``log g_i`` from the rows' ``logsumexp_{j != i} L_ij`` and ``L_ii``."""
        return negative - math.log(num_negatives) - positive

    def statistic_terms(self, negative: Tensor, positive: Tensor, context: GlobalContrastiveRows,
                        num_negatives: int) -> dict[str, Tensor]:
        log_g = self.log_g(negative, positive, num_negatives)
        if context.old_log_u is not None:
            log_u = self.update_rule(context.old_log_u, log_g.detach())
        else:  # eval mode: the batch's own estimate
            log_u = log_g.detach()
        log_u = log_u.to(log_g.dtype)
        tau = context.tau.to(log_g.dtype)
        # g / u = exp(log g - log u): bounded by 1/gamma_t, never overflows.
        surrogate = tau.detach() * torch.exp(log_g - log_u)
        if self.temperature == "global":
            surrogate = surrogate + tau * (log_u.detach() + self.rho)
        return {"loss": surrogate, "objective": (tau * log_u).detach(), "log_u": log_u.detach()}

    def reduce(self, batch: PairBatch, terms: list[dict[str, Tensor]], state: DeCLStep) -> dict:
        loss = torch.stack([t["loss"].mean() for t in terms]).mean()
        result = {"loss": loss,
                  "objective": torch.stack([t["objective"].mean() for t in terms]).mean(),
                  "gamma": self._gamma_now}
        if state.estimator == "buffer":
            new_log_u = torch.stack([terms[0]["log_u"], terms[1]["log_u"]], dim=1).detach()
            self.buffer.write(state.ids, gather_no_grad(new_log_u), state.old_log_u)
            result["buffer_coverage"] = self.buffer_coverage()
        return result

