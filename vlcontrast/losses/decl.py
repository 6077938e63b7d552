"""DeCL, decomposable contrastive learning (docs/losses.md, section "DeCL"; the paper's Algorithm 1).

Per direction (image→text shown), with the mean over the ``K = N_global - 1`` negatives
``m_i = (1/K) sum_{j != i} e^{L_ij}``::

    loss_1 = mean_i [ U_i * m_i - L_ii ]           U_i = 1/u_i (detached), or U_i ~ Exponential(rate u_i)
    loss_2 = mean_i [ log(K m_i) - L_ii ]          (= DCL)
    loss   = lam_t * loss_1 + (1 - lam_t) * loss_2

Estimators of ``u_i`` (the rate of the Gamma posterior of the auxiliary variable):

- ``buffer``: a per-sample moving average per direction, indexed by the global dataset id,
  ``u <- (1 - gamma) u + gamma m`` (first visit: ``u = m``), stored as ``log u`` and updated with
  ``logaddexp``, so ``U m = exp(log m - log u)`` never overflows. Updated *before* use, so
  ``gamma = 1`` gives ``grad loss_1 = grad dcl`` and ``loss_1 = 1 - mean L_ii``.
- ``momentum``: ``m_i`` of the current batch computed from an EMA copy of the towers, whose
  features the trainer passes as ``momentum_features``.
- ``batch``: ``u_i = m_i`` of the current batch (detached).

Schedules of ``lam_t`` (``t`` = 1-based optimizer step): ``alternate`` (odd ``t``: loss_1, even:
loss_2), ``weighted`` (``min(1, lambda_c / t)``), ``loss1``, ``loss2``.

The buffer holds ``id_space x 2`` float32 values of ``log u`` (``-inf``: never visited). Each step
every rank all-gathers ``(ids, new log u)`` and applies the same writes, so replicas stay equal;
``shard_buffer=True`` keeps only ``[rank * S, (rank + 1) * S)`` of the id space per rank and
resolves look-ups with one all-reduce. ``state_dict()`` always holds the full buffer (gathered on
save, re-sliced on load), so a checkpoint can be resumed with another world size; with
``shard_buffer`` saving is a collective: call ``state_dict()`` on every rank. With
``u_mode=sample`` it also holds the count of forwards made without ``step=`` (Python API use; their
draws are seeded by it), so a restored loss continues the draws instead of repeating them. A
step never makes the host wait for the device (no ``unique``, boolean indexing or ``int()``;
diagnostics stay tensors), and ``rollback()`` puts back exactly the rows the last step wrote (a
skipped step).

In eval mode (``loss_fn.eval()``) the estimator is ``batch``, the buffer is neither read nor
written, and without a ``step`` the loss is ``loss_2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from vlcontrast.distributed import gather_no_grad
from vlcontrast.errors import LossOptionError
from vlcontrast.losses.base import (IMAGE_TO_TEXT, ContrastiveLoss, LogSumExp, PairBatch,
                                    RowContext, negatives_logsumexp, row_dtype)
from vlcontrast.losses.buffer import SampleBuffer
from vlcontrast.losses.registry import register_loss

Estimator = Literal["buffer", "momentum", "batch"]
UMode = Literal["mean", "sample"]
Schedule = Literal["alternate", "weighted", "loss1", "loss2"]
ESTIMATORS, U_MODES, SCHEDULES = get_args(Estimator), get_args(UMode), get_args(Schedule)
SEED_STRIDE = 1_000_003
"""The ``u_mode=sample`` draws of step ``t`` come from a generator seeded
``seed * SEED_STRIDE + t``."""
SEED_RANGE = (-2**43, 2**43 - 1)
"""``seed``'s range: ``seed * SEED_STRIDE + t`` stays within what ``torch``'s ``manual_seed`` takes
(``[-2**63, 2**64 - 1]``) for every step ``t`` below ``4e17``; beyond it the number is refused with
a traceback. A non-negative seed's numbers stay in ``[0, 2**63)`` and a negative seed's are taken
by torch as ``2**64`` plus them, in ``[2**63, 2**64)``, so a negative seed's draws never
repeat a non-negative seed's within the first ``SEED_STRIDE`` steps (negative seeds are kept
for runs that used them)."""
DRAWS_KEY = "unstepped_draws"
"""``state_dict`` key (``u_mode=sample``) of the number of forwards made without ``step=``, whose
draws are seeded by that count instead of the step."""


def seed_range_rule() -> str:
    """Why a ``seed`` outside :data:`SEED_RANGE` is refused, in one clause."""
    return (f"must be an integer in [-2**43, 2**43 - 1 = {SEED_RANGE[1]}] (the u_mode=sample draws of "
            f"step t seed a 64-bit generator with seed * {SEED_STRIDE} + t)")


@dataclass
class DeCLStep:
    """What one forward of DeCL computes once for the whole global batch (before any block).

    ``weight``: ``lam_t``, the weight of ``loss_1``. ``estimator``: the one in use (``batch`` in
    eval mode). ``ids`` and ``old_log_u`` (``buffer``): the global batch's sample ids and the
    buffer's ``log u`` for them before this step, ``[N_global, 2]``. ``log_u`` (``momentum``): the
    EMA towers' estimate for the local anchors. ``noise`` (``u_mode=sample``): ``E ~ Exp(1)``.
    ``scale``: the logits' scale as the loss uses it (FastCLIP's temperature).
    """

    weight: float
    estimator: str
    ids: Tensor | None = None
    old_log_u: Tensor | None = None
    log_u: Tensor | None = None
    noise: Tensor | None = None
    scale: Tensor | None = None


@dataclass(kw_only=True)
class DeCLRows(RowContext):
    """DeCL's rows of one direction, each ``[B_local]`` or ``None``.

    ``old_log_u``: the buffer's ``log u`` before this step (``buffer`` estimator; updated with the
    rows' own ``m`` before use). ``log_u``: the estimate to use as is (``momentum``). Neither: the
    batch's own ``m`` (``batch``). ``noise``: ``E ~ Exponential(1)`` (``u_mode=sample``).
    """

    old_log_u: Tensor | None = None
    log_u: Tensor | None = None
    noise: Tensor | None = None


@register_loss
class DeCLLoss(ContrastiveLoss):
    """Decomposable contrastive loss with a per-sample estimate of the negatives' mean.

    Args:
        estimator: ``buffer`` | ``momentum`` | ``batch`` (how ``u_i`` is estimated).
        u_mode: ``mean`` (``U = 1/u``) or ``sample`` (``U ~ Exponential(rate u)``).
        gamma: weight of the current ``m_i`` in the buffer's moving average (``buffer`` only).
        schedule: ``alternate`` | ``weighted`` | ``loss1`` | ``loss2``.
        lambda_c: ``c >= 0`` of the ``weighted`` schedule ``lam_t = min(1, c / t)``.
        ema_decay: decay of the EMA towers the trainer keeps for ``momentum``.
        shard_buffer: shard the buffer by id across ranks (LAION-scale id spaces).
        seed: seed of the ``sample`` draws (a function of ``seed`` and the step, equal on all ranks),
            in ``[0, 2**43 - 1]``.
        id_space: number of distinct sample ids (set by ``build_loss``; required by ``buffer``).
    """

    name = "decl"

    def __init__(self, estimator: Estimator = "buffer", u_mode: UMode = "mean", gamma: float = 0.9,
                 schedule: Schedule = "alternate",
                 lambda_c: float = 1.0, ema_decay: float = 0.999,
                 shard_buffer: bool = False, seed: int = 0, *, chunk_size: int = 0,
                 id_space: int = 0):
        super().__init__(chunk_size=chunk_size)
        for option, value, choices in (("estimator", estimator, ESTIMATORS),
                                       ("u_mode", u_mode, U_MODES),
                                       ("schedule", schedule, SCHEDULES)):
            if value not in choices:
                raise LossOptionError(self.name, f"must be one of {list(choices)}", **{option: value})
        if not 0 < gamma <= 1:
            raise LossOptionError(self.name, "must be in (0, 1]", gamma=gamma)
        if not 0 <= ema_decay < 1:
            raise LossOptionError(self.name, "must be in [0, 1)", ema_decay=ema_decay)
        if not lambda_c >= 0:  # NaN too
            raise LossOptionError(self.name, "must be >= 0 (lam_t = min(1, lambda_c / t) weighs "
                                  "loss_1 against loss_2; below 0 it leaves [0, 1])",
                                  lambda_c=lambda_c)
        if id_space < 0:
            raise LossOptionError(self.name, "must be >= 0", id_space=id_space)
        if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
            raise LossOptionError(self.name, seed_range_rule(), seed=seed)
        self.estimator = estimator
        self.u_mode = u_mode
        self.gamma = float(gamma)
        self.schedule = schedule
        self.lambda_c = float(lambda_c)
        self.ema_decay = float(ema_decay)
        self.shard_buffer = bool(shard_buffer)
        self.seed = int(seed)
        self.id_space = int(id_space)
        self.needs_sample_ids = estimator == "buffer"
        self.needs_momentum_features = estimator == "momentum"
        self._unstepped_draws = 0
        # What the last forward changed, so that rollback() can undo exactly that: the buffer rows
        # it wrote with their previous values, the visit count and the draw counter before it.
        self._undo: dict | None = None
        self.buffer = (SampleBuffer(self, self.id_space, shard=self.shard_buffer, name=self.name)
                       if self.needs_sample_ids else None)

    # ---- schedule and sampling --------------------------------------------------------------

    def schedule_weight(self, step: int | None) -> float:
        """``lam_t``: the weight of ``loss_1``."""
        if self.schedule == "loss1":
            return 1.0
        if self.schedule == "loss2":
            return 0.0
        if step is None:
            if self.training:
                raise ValueError(f"{self.name}: schedule {self.schedule!r} needs step= (the "
                                 "1-based optimizer step) in training mode")
            return 0.0
        if step < 1:
            raise ValueError(f"{self.name}: step is 1-based (the optimizer step, starting at "
                             f"1), got step={step}")
        if self.schedule == "alternate":
            return 1.0 if step % 2 == 1 else 0.0
        return min(1.0, self.lambda_c / step)

    def exponential_noise(self, batch: PairBatch) -> Tensor:
        """``E ~ Exponential(1)`` per local anchor and direction, so ``U = E / u``.

        Drawn for the whole global batch from a generator seeded by ``(seed, step)`` and sliced, so
        a sample's draw does not depend on the world size.
        """
        if batch.step is None:
            self._unstepped_draws += 1
            counter = self._unstepped_draws
        else:
            counter = batch.step
        # Drawn on the features' device: a host draw copied over would block the step.
        device = batch.image.device
        generator = torch.Generator(device=device).manual_seed(self.seed * SEED_STRIDE + counter)
        noise = torch.empty(batch.global_size, 2, dtype=torch.float64, device=device)
        return batch.local_rows(noise.exponential_(generator=generator))

    # ---- the buffer -------------------------------------------------------------------------

    def rollback(self) -> None:
        """Undo the last forward: the buffer rows it wrote and the ``sample`` draw counter."""
        undo, self._undo = self._undo, None
        if undo is not None:
            self._unstepped_draws = undo["draws"]
        if self.buffer is not None:
            self.buffer.rollback()

    def rollback_where(self, skipped: torch.Tensor) -> None:
        """:meth:`rollback` of the buffer rows decided on the device by the 0-dim flag
        ``skipped`` (the trainer's skip decision, never read on the host). The draw counter only
        moves for forwards without ``step=``, which training never makes."""
        if self.buffer is not None:
            self.buffer.rollback_where(skipped)

    def buffer_coverage(self) -> Tensor:
        """Fraction of the id space visited at least once (a 0-dim tensor on the device)."""
        return self.buffer.coverage()

    def _global_ids(self, batch: PairBatch) -> Tensor:
        if batch.sample_ids is None:
            raise ValueError(f"{self.name}: its per-sample buffer needs the batch's dataset ids: "
                             "call the loss with sample_ids= (a [B] tensor of global sample "
                             "ids, e.g. batch.sample_ids)")
        if self.id_space <= 0:
            raise ValueError(f"{self.name}: its per-sample buffer needs id_space > 0 (the number "
                             f"of distinct sample ids): build_loss({self.name!r}, "
                             "id_space=loader.id_space)")
        local = batch.sample_ids.to(device=batch.image.device, dtype=torch.long).reshape(-1)
        if local.shape[0] != batch.local_size:
            raise ValueError(f"{self.name}: {local.shape[0]} sample_ids for "
                             f"{batch.local_size} pairs; give sample_ids= one id per pair")
        ids = gather_no_grad(local)
        # Checked on the device without making the host wait: on CPU this raises at once, on a
        # GPU it is a device-side assertion (an out-of-range index would be one anyway).
        message = (f"{self.name}: a sample id is outside the declared id space "
                   f"[0, {self.id_space}); build the loss with the dataset's id_space= "
                   f"(build_loss({self.name!r}, id_space=loader.id_space))")
        try:
            torch._assert_async(((ids >= 0) & (ids < self.id_space)).all(), message)
        except RuntimeError as error:  # raised at once only where the host is the device (CPU)
            if message not in str(error):
                raise
            raise ValueError(message) from None
        return ids

    def update_rule(self, log_u_old: Tensor, log_mean: Tensor) -> Tensor:
        """``log((1 - gamma) u + gamma m)``, or ``log m`` on a first visit (``log u = -inf``)."""
        log_mean = log_mean.to(torch.promote_types(log_mean.dtype, log_u_old.dtype))
        blended = torch.logaddexp(math.log1p(-self.gamma) + log_u_old if self.gamma < 1
                                  else torch.full_like(log_mean, -math.inf),
                                  math.log(self.gamma) + log_mean)
        return torch.where(torch.isfinite(log_u_old), blended, log_mean)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.buffer is not None:
            self.buffer.save_full(destination, prefix)
        if self.u_mode == "sample":
            destination[prefix + DRAWS_KEY] = torch.tensor(self._unstepped_draws, dtype=torch.long)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + DRAWS_KEY
        if key in state_dict:  # absent from state dicts written before it was saved
            draws = state_dict[key]
            if (torch.is_tensor(draws) and draws.numel() == 1 and not draws.is_floating_point()
                    and int(draws) >= 0):
                self._unstepped_draws = int(draws)
            else:
                error_msgs.append(f"{key}: expected a non-negative integer count of forwards "
                                  f"without step=, got {draws!r}")
        self._load_buffer(state_dict, prefix, local_metadata, strict, missing_keys,
                          unexpected_keys, error_msgs)
        if key in unexpected_keys:
            unexpected_keys.remove(key)

    def _load_buffer(self, state_dict, prefix, local_metadata, strict, missing_keys,
                     unexpected_keys, error_msgs):
        key = prefix + "log_u"
        if self.buffer is None or key not in state_dict:
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                                 missing_keys, unexpected_keys, error_msgs)
        full = state_dict[key]
        try:
            state_dict[key] = self.buffer.local_part(full, key)
        except ValueError as error:
            error_msgs.append(str(error))
            return
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
        finally:
            state_dict[key] = full

    # ---- the loss ---------------------------------------------------------------------------

    def prepare(self, batch: PairBatch) -> DeCLStep:
        self._undo = {"draws": self._unstepped_draws}
        if self.buffer is not None:
            self.buffer.undo = None  # only this forward's writes are undone by rollback()
        estimator = self.estimator if self.training else "batch"
        state = DeCLStep(weight=self.schedule_weight(batch.step), estimator=estimator)
        if estimator == "buffer":
            self.buffer.ensure_layout()
            state.ids = self._global_ids(batch)
            state.old_log_u = self.buffer.lookup(state.ids)
        elif estimator == "momentum":
            state.log_u = self.momentum_log_means(batch)
        if self.u_mode == "sample":
            state.noise = self.exponential_noise(batch)
        return state

    @torch.no_grad()
    def momentum_log_means(self, batch: PairBatch) -> Tensor:
        """``log m_i`` of the local anchors from the EMA towers' features, ``[B_local, 2]``."""
        if batch.momentum_features is None:
            raise ValueError(f"{self.name}: estimator 'momentum' needs "
                             "momentum_features=(image, text) from the EMA towers")
        image, text = batch.momentum_features
        if image.shape != batch.image.shape or text.shape != batch.text.shape:
            raise ValueError(f"{self.name}: momentum_features must have the shape of the "
                             "features")
        all_image, all_text = gather_no_grad(image), gather_no_grad(text)
        scale = batch.logit_scale.detach()
        positives = batch.positives()
        rows_per_block = self.chunk_size or batch.local_size
        columns = []
        for anchors, candidates in ((image, all_text), (text, all_image)):
            parts = []
            for start in range(0, batch.local_size, rows_per_block):
                block = slice(start, start + rows_per_block)
                logits = (scale * anchors[block]) @ candidates.T
                logits = logits.to(row_dtype(logits.dtype))
                parts.append(negatives_logsumexp(logits, positives[block]))
            columns.append(torch.cat(parts) - math.log(batch.num_negatives))
        return torch.stack(columns, dim=1)

    def row_context(self, batch: PairBatch, direction: str, state: DeCLStep) -> DeCLRows:
        column = 0 if direction == IMAGE_TO_TEXT else 1
        context = DeCLRows()
        if state.estimator == "buffer":
            context.old_log_u = batch.local_rows(state.old_log_u)[:, column]
        elif state.estimator == "momentum":
            context.log_u = state.log_u[:, column]
        if state.noise is not None:
            context.noise = state.noise[:, column]
        return context

    def row_statistic(self) -> LogSumExp:
        return LogSumExp(exclude_positive=True)

    def statistic_terms(self, negative: Tensor, positive: Tensor, context: DeCLRows,
                        num_negatives: int) -> dict[str, Tensor]:
        log_mean = negative - math.log(num_negatives)
        if context.old_log_u is not None:
            log_u = self.update_rule(context.old_log_u, log_mean.detach())
        elif context.log_u is not None:
            log_u = context.log_u
        else:
            log_u = log_mean.detach()
        log_u = log_u.to(log_mean.dtype)
        # U * m = exp(log m - log u): bounded by 1/gamma for the buffer, never overflows.
        u_times_mean = torch.exp(log_mean - log_u)
        inverse_rate = torch.exp(-log_u.double())
        if context.noise is not None:
            u_times_mean = u_times_mean * context.noise.to(log_mean.dtype)
            inverse_rate = inverse_rate * context.noise
        return {"loss_1": u_times_mean - positive, "loss_2": negative - positive,
                "log_u": log_u.detach(), "U": inverse_rate.detach()}

    def reduce(self, batch: PairBatch, terms: list[dict[str, Tensor]], state: DeCLStep) -> dict:
        loss_1 = torch.stack([t["loss_1"].mean() for t in terms]).mean()
        loss_2 = torch.stack([t["loss_2"].mean() for t in terms]).mean()
        weight = state.weight
        if weight == 1.0:
            loss = loss_1
        elif weight == 0.0:
            loss = loss_2
        else:
            loss = weight * loss_1 + (1 - weight) * loss_2
        result = {"loss": loss, "loss_1": loss_1.detach(), "loss_2": loss_2.detach(),
                  "lambda": weight,
                  "U": torch.cat([t["U"] for t in terms]).detach().mean().float()}
        if state.estimator == "buffer":
            new_log_u = torch.stack([terms[0]["log_u"], terms[1]["log_u"]], dim=1).detach()
            self.buffer.write(state.ids, gather_no_grad(new_log_u), state.old_log_u)
            result["buffer_coverage"] = self.buffer_coverage()
        return result

