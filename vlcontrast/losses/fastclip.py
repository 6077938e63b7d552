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

``temperature="individual"`` (iSogCLR, FastCLIP-v2): a temperature ``tau_i`` per sample and
direction, stored in the buffer beside ``u`` (so sharded, checkpointed and rolled back with it),
starting at ``tau_init`` (0: the model's ``1 / logit_scale`` at the first visit). Row ``i``'s
logits use ``tau_i``; the features' surrogate is ``tau_i * g_i / u_i`` (``tau_i`` a constant), and
after the step ``tau_i`` takes one Adam step on the gradient of ``tau_i * log u_i + tau_i * rho``::

    grad_i = log u_i + rho - (g_i / u_i) * (sum_j w_ij L_ij - L_ii)      w_i. = softmax over j != i

clipped to ``[-5, 5]``, with Adam's moments per sample and direction (bias-corrected by the
sample's own number of visits), learning rate ``tau_lr``, and ``tau_i`` kept in
``[tau_min, tau_max]``. ``sum_j w_ij L_ij`` costs one extra no-grad matmul per direction.

``gamma_t``: constant, or FastCLIP's cosine decay from 1 to ``gamma`` over ``gamma_decay_steps``
optimizer steps, ``gamma`` afterwards. ``u`` lives in the per-sample log-space buffer DeCL uses
(replicated or sharded by id, checkpointed, restored by ``rollback`` on a skipped step); a
non-finite stored value is treated as a first visit (reset), as FastCLIP and LibAUC guard it.

With ``gamma = 1`` the average is the current batch's ``g_i`` and the gradient is that of DCL:
``tau * grad(g_i) / g_i = tau * grad(log g_i) = tau * grad(logsumexp_{j != i} L_ij - L_ii)``.

``recipe="paper"`` (the default) is all of the above. ``recipe="fast_clip"`` computes what
fast_clip's training code computes, so that its published recipes run unchanged (docs/losses.md,
"The fast_clip recipe"): ``g / (u + eps)`` instead of ``g / u``; a stored ``u`` below 1e-35 is
reset like a first visit; ``gamma_t`` is a per-epoch staircase with ``gamma_t = 1`` for the whole
first epoch; without ``multiply_tau`` the surrogate has no factor ``tau`` (its gradient is 1/tau
times the paper's); with ``temperature="global"`` the temperature's gradient through ``g`` is
summed over the two directions (the features' is averaged), and the bracket exists only with
``multiply_tau``; individual temperatures use the model optimizer's betas and epsilon, betas 0 in
the first epoch and bias correction by the epoch, and a surrogate without ``tau_i``. The epoch is
the data's, set by the trainer with :meth:`FastCLIPLoss.set_epoch` before each step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from vlcontrast.distributed import gather_no_grad
from vlcontrast.errors import LossOptionError
from vlcontrast.losses.base import IMAGE_TO_TEXT, PairBatch, fill_positives_, row_dtype
from vlcontrast.losses.buffer import SampleBuffer
from vlcontrast.losses.decl import DeCLLoss, DeCLRows, DeCLStep
from vlcontrast.losses.registry import register_loss

TEMPERATURES = ("fixed", "global", "individual")
# Individual temperatures: the buffer's columns (per direction: i2t, t2i) and Adam's constants.
LOG_U, TAU, MOMENT_1, MOMENT_2, VISITS = (0, 1), (2, 3), (4, 5), (6, 7), 8
INDIVIDUAL_COLUMNS = 9
TAU_BETAS = (0.9, 0.999)
TAU_EPS = 1e-8
TAU_GRAD_CLIP = 5.0
GAMMA_SCHEDULES = ("constant", "cosine")
RECIPES = ("paper", "fast_clip")
# fast_clip's defaults and constants (src/fast_clip/loss.py, src/training/params.py).
FAST_CLIP_EPS = 1e-14
RESET_BELOW = 1e-35


@dataclass(kw_only=True)
class GlobalContrastiveRows(DeCLRows):
    """The rows of one direction: the buffer's old ``log u`` and the step's temperature; with
    individual temperatures also each row's Adam state (``moment_1``, ``moment_2``, ``visits``)
    and ``mean_negative`` (``sum_j w_ij L_ij`` over the negatives, no gradient)."""

    tau: Tensor | None = None
    moment_1: Tensor | None = None
    moment_2: Tensor | None = None
    visits: Tensor | None = None
    mean_negative: Tensor | None = None


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
        temperature: ``fixed`` (the model's ``logit_scale``, not trained), ``global`` (one
            learnable temperature, FastCLIP-v3's objective with ``rho``; its learning rate is
            ``optim.temperature_lr``) or ``individual`` (one per sample and direction, iSogCLR /
            FastCLIP-v2, trained inside the loss with ``tau_lr``).
        rho: the ``rho`` of the temperature's objective (global and individual).
        tau_init: first temperature of every sample (individual; 0: ``1 / logit_scale``).
        tau_lr: Adam learning rate of the individual temperatures.
        tau_min, tau_max: bounds of the individual temperatures.
        shard_buffer: shard ``u`` (and individual temperatures) by sample id across ranks.
        recipe: ``paper`` (the papers' formulas) or ``fast_clip`` (what fast_clip's code computes;
            see the module docstring).
        gamma_decay_epochs: length of the cosine decay in epochs (``fast_clip`` recipe, whose
            schedule is a per-epoch staircase; fast_clip's ``--gamma_decay_epochs``).
        eps: the ``eps`` of ``g / (u + eps)`` (``fast_clip`` recipe; its ``--fastclip_eps``).
        multiply_tau: fast_clip's ``--multiply_tau`` (``fast_clip`` recipe, fixed and global
            temperatures): the surrogate carries the factor ``tau``, and the global temperature
            its ``tau * (log u + rho)`` term; without it the gradient is 1/tau times larger.
        optimizer_betas, optimizer_eps: the model optimizer's Adam constants, which the
            ``fast_clip`` recipe's individual temperatures use (set by the trainer).
    """

    name = "fastclip"

    def __init__(self, gamma: float = 0.8,
                 gamma_schedule: Literal["constant", "cosine"] = "constant",
                 gamma_decay_steps: int = 0,
                 temperature: Literal["fixed", "global", "individual"] = "fixed",
                 rho: float = 8.5, tau_init: float = 0.0, tau_lr: float = 0.01,
                 tau_min: float = 0.01, tau_max: float = 1.0,
                 shard_buffer: bool = False, recipe: Literal["paper", "fast_clip"] = "paper",
                 gamma_decay_epochs: int = 0, eps: float = FAST_CLIP_EPS,
                 multiply_tau: bool = False, *, chunk_size: int = 0, id_space: int = 0,
                 optimizer_betas: tuple[float, float] = TAU_BETAS,
                 optimizer_eps: float = TAU_EPS):
        self.check_recipe(recipe, temperature, gamma_schedule, int(gamma_decay_steps),
                          int(gamma_decay_epochs), float(eps), bool(multiply_tau))
        if gamma_schedule not in GAMMA_SCHEDULES:
            raise LossOptionError(self.name, f"must be one of {list(GAMMA_SCHEDULES)}",
                                  gamma_schedule=gamma_schedule)
        if temperature not in TEMPERATURES:
            raise LossOptionError(self.name, f"must be one of {list(TEMPERATURES)}",
                                  temperature=temperature)
        if gamma_schedule == "cosine" and gamma_decay_steps < 1 and recipe == "paper":
            raise LossOptionError(self.name, "gamma_schedule='cosine' needs gamma_decay_steps >= 1",
                                  gamma_decay_steps=gamma_decay_steps)
        if not 0 < tau_min < tau_max:
            raise LossOptionError(self.name, "need 0 < tau_min < tau_max", tau_min=tau_min,
                                  tau_max=tau_max)
        if tau_init and not tau_min <= tau_init <= tau_max:
            raise LossOptionError(self.name, f"is outside [tau_min, tau_max] = [{tau_min}, {tau_max}] "
                                  "(0: start at the model's temperature)", tau_init=tau_init)
        if not tau_lr >= 0:  # NaN too
            raise LossOptionError(self.name, "must be >= 0", tau_lr=tau_lr)
        if not math.isfinite(rho):
            raise LossOptionError(self.name, "must be a finite number", rho=rho)
        super().__init__(estimator="buffer", u_mode="mean", gamma=gamma, schedule="loss1",
                         shard_buffer=shard_buffer, chunk_size=chunk_size, id_space=id_space)
        self.gamma_schedule = gamma_schedule
        self.gamma_decay_steps = int(gamma_decay_steps)
        self.temperature = temperature
        self.rho = float(rho)
        self.tau_init, self.tau_lr = float(tau_init), float(tau_lr)
        self.tau_min, self.tau_max = float(tau_min), float(tau_max)
        self._gamma_now = self.gamma
        self.recipe = recipe
        self.gamma_decay_epochs = int(gamma_decay_epochs)
        self.eps = float(eps)
        self.multiply_tau = bool(multiply_tau)
        self.optimizer_betas = (float(optimizer_betas[0]), float(optimizer_betas[1]))
        self.optimizer_eps = float(optimizer_eps)
        self.epoch: int | None = None
        if temperature == "individual":
            # u and the temperatures' state share one buffer: one look-up, one write, one undo.
            self.buffer = SampleBuffer(self, self.id_space, columns=INDIVIDUAL_COLUMNS,
                                       shard=self.shard_buffer, name=self.name)

    def check_recipe(self, recipe: str, temperature: str, gamma_schedule: str,
                     gamma_decay_steps: int, gamma_decay_epochs: int, eps: float,
                     multiply_tau: bool) -> None:
        """The options that belong to one recipe only, each refused with the fix."""
        if recipe not in RECIPES:
            raise LossOptionError(self.name, f"must be one of {list(RECIPES)}", recipe=recipe)
        if recipe == "paper":
            for option, value, default in (("gamma_decay_epochs", gamma_decay_epochs, 0),
                                           ("eps", eps, FAST_CLIP_EPS),
                                           ("multiply_tau", multiply_tau, False)):
                if value != default:
                    raise LossOptionError(self.name, "belongs to recipe='fast_clip'; set "
                                          "recipe=fast_clip or drop it", **{option: value})
            return
        if gamma_schedule == "cosine" and gamma_decay_epochs < 1:
            raise LossOptionError(self.name, "recipe='fast_clip' with gamma_schedule='cosine' needs "
                                  "gamma_decay_epochs >= 1", gamma_decay_epochs=gamma_decay_epochs)
        if gamma_decay_steps:
            raise LossOptionError(self.name, "recipe='fast_clip' counts the gamma schedule in "
                                  "epochs: set gamma_decay_epochs instead",
                                  gamma_decay_steps=gamma_decay_steps)
        if not eps >= 0:  # NaN too
            raise LossOptionError(self.name, "must be >= 0", eps=eps)
        if multiply_tau and temperature == "individual":
            raise LossOptionError(self.name, "has no effect with temperature='individual' "
                                  "(fast_clip ignores it there); drop it", multiply_tau=multiply_tau)

    def set_epoch(self, epoch: int) -> None:
        """The data epoch (0-based) of the coming step: the ``fast_clip`` recipe's gamma and
        individual temperatures follow it. Not state: the trainer sets it before every step."""
        self.epoch = int(epoch)

    @property
    def fast_clip(self) -> bool:
        return self.recipe == "fast_clip"

    @property
    def individual(self) -> bool:
        """Per-sample temperatures in use (training mode; eval uses the model's temperature)."""
        return self.temperature == "individual" and self.training

    def gamma_at(self, step: int | None) -> float:
        """``gamma_t`` of 1-based optimizer step ``step`` (the floor when unknown)."""
        if self.gamma_schedule == "constant" or step is None:
            return self.gamma
        progress = min(1.0, (step - 1) / self.gamma_decay_steps)
        return self.gamma + (1 - self.gamma) * 0.5 * (1 + math.cos(math.pi * progress))

    def gamma_in_epoch(self, epoch: int) -> float:
        """fast_clip's ``gamma`` in 0-based ``epoch``: 1 in the first epoch, then ``gamma``, or
        the cosine from 1 at epoch 0 down to ``gamma`` at ``gamma_decay_epochs``."""
        if epoch == 0:
            return 1.0
        if self.gamma_schedule == "constant":
            return self.gamma
        progress = min(1.0, epoch / self.gamma_decay_epochs)
        return self.gamma + (1 - self.gamma) * 0.5 * (1 + math.cos(math.pi * progress))

    def temperature_scale(self, batch: PairBatch) -> Tensor:
        """``1 / tau`` of the fixed and global temperatures (trained only when global)."""
        return batch.logit_scale if self.temperature == "global" else batch.logit_scale.detach()

    def scale(self, batch: PairBatch) -> Tensor | float:
        if self.individual:
            return 1.0  # each row's own 1 / tau_i, see row_context
        scale = self.temperature_scale(batch)
        if self.fast_clip and self.temperature == "global":
            # fast_clip scores every pair twice (its rows against all columns for the features'
            # first half, all rows against its columns for the second) and averages the two for
            # the features, but each half carries the whole gradient of the temperature: the
            # temperature's gradient through the logits is doubled. Same value, twice the
            # gradient (2s - s is exact in floating point).
            scale = scale + (scale - scale.detach())
        return scale

    def prepare(self, batch: PairBatch) -> DeCLStep:
        if not self.fast_clip:
            self._gamma_now = self.gamma_at(batch.step)
        elif self.epoch is not None:
            self._gamma_now = self.gamma_in_epoch(self.epoch)
        elif self.training:
            raise ValueError(f"{self.name}: recipe='fast_clip' follows the data epoch: call "
                             "set_epoch(epoch) before each training step (the trainer does)")
        else:  # eval mode reads no buffer: gamma is only reported
            self._gamma_now = self.gamma
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
        if self.fast_clip:  # fast_clip also resets a stored u below 1e-35
            usable = usable & (log_u_old >= math.log(RESET_BELOW))
        return torch.where(usable, blended, log_mean)

    def row_context(self, batch: PairBatch, direction: str,
                    state: DeCLStep) -> GlobalContrastiveRows:
        base = super().row_context(batch, direction, state)
        if not (self.individual and state.estimator == "buffer"):
            scale = self.temperature_scale(batch) if self.fast_clip else state.scale
            return GlobalContrastiveRows(old_log_u=base.old_log_u, log_u=base.log_u,
                                         tau=1.0 / scale)
        column = 0 if direction == IMAGE_TO_TEXT else 1
        old = batch.local_rows(state.old_log_u)
        tau = old[:, TAU[column]]
        seen = torch.isfinite(tau) & torch.isfinite(old[:, MOMENT_1[column]]) \
            & torch.isfinite(old[:, MOMENT_2[column]]) & torch.isfinite(old[:, VISITS])
        first = (self.tau_init if self.tau_init
                 else (1.0 / batch.logit_scale.detach().to(tau.dtype)).clamp(self.tau_min,
                                                                             self.tau_max))
        zeros = torch.zeros_like(tau)
        tau = torch.where(seen, tau, first)
        rows = GlobalContrastiveRows(
            old_log_u=base.old_log_u, tau=tau, row_scale=1.0 / tau,
            moment_1=torch.where(seen, old[:, MOMENT_1[column]], zeros),
            moment_2=torch.where(seen, old[:, MOMENT_2[column]], zeros),
            visits=torch.where(seen, old[:, VISITS], zeros))
        rows.mean_negative = self.mean_negative_logit(batch, direction, rows.row_scale)
        return rows

    @torch.no_grad()
    def mean_negative_logit(self, batch: PairBatch, direction: str, row_scale: Tensor) -> Tensor:
        """``sum_{j != i} w_ij L_ij`` with ``w_i. = softmax_{j != i}(L_i.)`` for the local anchors
        (blocks of ``chunk_size`` rows when chunked)."""
        anchors, candidates = batch.anchors_and_candidates(direction)
        positives = batch.positives()
        rows_per_block = self.chunk_size or batch.local_size
        parts = []
        for start in range(0, batch.local_size, rows_per_block):
            block = slice(start, start + rows_per_block)
            scaled = anchors[block] * row_scale[block].to(anchors.dtype)[:, None]
            logits = (scaled @ candidates.T).to(row_dtype(anchors.dtype))
            # The positive's weight is exactly 0 (softmax of -inf), so its finite logit adds 0.
            weights = torch.softmax(fill_positives_(logits.clone(), positives[block]), dim=1)
            parts.append((weights * logits).sum(1))
        return torch.cat(parts)

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
        if self.fast_clip:
            return self.fast_clip_terms(log_g, log_u, tau, positive, context)
        # g / u = exp(log g - log u): bounded by 1/gamma_t, never overflows.
        ratio = torch.exp(log_g - log_u)
        surrogate = tau.detach() * ratio
        if self.temperature == "global":
            surrogate = surrogate + tau * (log_u.detach() + self.rho)
        terms = {"loss": surrogate, "objective": (tau * log_u).detach(), "log_u": log_u.detach()}
        if context.mean_negative is not None:
            terms.update(self.temperature_step(context, log_u.detach(), ratio.detach(),
                                               positive.detach()))
        return terms

    def fast_clip_terms(self, log_g: Tensor, log_u: Tensor, tau: Tensor, positive: Tensor,
                        context: GlobalContrastiveRows) -> dict[str, Tensor]:
        """The per-anchor terms as fast_clip computes them (``recipe="fast_clip"``)."""
        log_denominator = log_u if self.eps == 0 else torch.logaddexp(log_u, torch.full_like(
            log_u, math.log(self.eps)))
        ratio = torch.exp(log_g - log_denominator)  # g / (u + eps), at most 1/gamma_t
        surrogate = tau.detach() * ratio if self.multiply_tau else ratio
        if self.temperature == "global" and self.multiply_tau:
            surrogate = surrogate + tau * (log_u.detach() + self.rho)
        terms = {"loss": surrogate, "objective": (tau * log_u).detach(), "log_u": log_u.detach()}
        if context.mean_negative is not None:
            terms.update(self.temperature_step(context, log_denominator.detach(), ratio.detach(),
                                               positive.detach()))
        return terms

    def adam_constants(self, visits: Tensor) -> tuple[float, float, float, Tensor | int]:
        """``(beta_1, beta_2, eps, bias-correction power)`` of the individual temperatures' Adam:
        the paper's per-sample Adam, or fast_clip's (the model optimizer's betas, 0 in the first
        epoch, and epsilon; bias correction by the epoch)."""
        if not self.fast_clip:
            return (*TAU_BETAS, TAU_EPS, visits)
        beta_1, beta_2 = (0.0, 0.0) if self.epoch == 0 else self.optimizer_betas
        return beta_1, beta_2, self.optimizer_eps, self.epoch + 1

    def temperature_step(self, rows: GlobalContrastiveRows, log_u: Tensor, ratio: Tensor,
                         positive: Tensor) -> dict[str, Tensor]:
        """One Adam step of each row's ``tau_i`` on ``d/d tau_i (tau_i log u_i + tau_i rho)``."""
        dtype = log_u.dtype
        tau = rows.tau.to(dtype)
        grad = log_u + self.rho - ratio * (rows.mean_negative.to(dtype) - positive.to(dtype))
        grad = grad.clamp(-TAU_GRAD_CLIP, TAU_GRAD_CLIP)
        visits = rows.visits.to(dtype) + 1
        beta_1, beta_2, eps, power = self.adam_constants(visits)
        moment_1 = beta_1 * rows.moment_1.to(dtype) + (1 - beta_1) * grad
        moment_2 = beta_2 * rows.moment_2.to(dtype) + (1 - beta_2) * grad * grad
        step = (moment_1 / (1 - beta_1 ** power)) / (
            torch.sqrt(moment_2 / (1 - beta_2 ** power)) + eps)
        new_tau = (tau - self.tau_lr * step).clamp(self.tau_min, self.tau_max)
        return {"tau": new_tau, "moment_1": moment_1, "moment_2": moment_2, "visits": visits,
                "tau_used": tau}

    def reduce(self, batch: PairBatch, terms: list[dict[str, Tensor]], state: DeCLStep) -> dict:
        loss = torch.stack([t["loss"].mean() for t in terms]).mean()
        result = {"loss": loss,
                  "objective": torch.stack([t["objective"].mean() for t in terms]).mean(),
                  "gamma": self._gamma_now}
        if state.estimator == "buffer":
            columns = [terms[0]["log_u"], terms[1]["log_u"]]
            if "tau" in terms[0]:
                for key in ("tau", "moment_1", "moment_2"):
                    columns += [terms[0][key], terms[1][key]]
                columns.append(terms[0]["visits"])
                result["temperature"] = torch.cat([t["tau_used"] for t in terms]).mean()
            new_rows = torch.stack([c.to(torch.float32) for c in columns], dim=1).detach()
            self.buffer.write(state.ids, gather_no_grad(new_rows), state.old_log_u)
            result["buffer_coverage"] = self.buffer_coverage()
        return result

