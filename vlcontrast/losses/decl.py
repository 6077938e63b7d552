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
``shard_buffer`` saving is a collective: call ``state_dict()`` on every rank. A step never makes
the host wait for the device (no ``unique``, boolean indexing or ``int()``; diagnostics stay
tensors), and ``rollback()`` puts back exactly the rows the last step wrote (a skipped step).

In eval mode (``loss_fn.eval()``) the estimator is ``batch``, the buffer is neither read nor
written, and without a ``step`` the loss is ``loss_2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from vlcontrast.distributed import all_reduce_sum, gather_no_grad, get_rank, get_world_size
from vlcontrast.losses.base import (IMAGE_TO_TEXT, ContrastiveLoss, LogSumExp, PairBatch,
                                    RowContext, negatives_logsumexp, row_dtype)
from vlcontrast.losses.registry import register_loss

Estimator = Literal["buffer", "momentum", "batch"]
UMode = Literal["mean", "sample"]
Schedule = Literal["alternate", "weighted", "loss1", "loss2"]
ESTIMATORS, U_MODES, SCHEDULES = get_args(Estimator), get_args(UMode), get_args(Schedule)


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
        lambda_c: ``c`` of the ``weighted`` schedule ``lam_t = min(1, c / t)``.
        ema_decay: decay of the EMA towers the trainer keeps for ``momentum``.
        shard_buffer: shard the buffer by id across ranks (LAION-scale id spaces).
        seed: seed of the ``sample`` draws (a function of ``seed`` and the step, equal on all ranks).
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
                raise ValueError(f"decl: {option}={value!r} is not one of {list(choices)}")
        if not 0 < gamma <= 1:
            raise ValueError(f"decl: gamma must be in (0, 1], got {gamma}")
        if not 0 <= ema_decay < 1:
            raise ValueError(f"decl: ema_decay must be in [0, 1), got {ema_decay}")
        if id_space < 0:
            raise ValueError(f"decl: id_space must be >= 0, got {id_space}")
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
        if self.needs_sample_ids:
            self._layout = self._current_layout()
            length = self._shard_length(self._layout[1])
            self.register_buffer("log_u", torch.full((length, 2), -math.inf))
            self.register_buffer("visited", torch.zeros((), dtype=torch.long))

    # ---- schedule and sampling --------------------------------------------------------------

    def schedule_weight(self, step: int | None) -> float:
        """``lam_t``: the weight of ``loss_1``."""
        if self.schedule == "loss1":
            return 1.0
        if self.schedule == "loss2":
            return 0.0
        if step is None:
            if self.training:
                raise ValueError(f"decl: schedule {self.schedule!r} needs step= (the 1-based "
                                 "optimizer step) in training mode")
            return 0.0
        if step < 1:
            raise ValueError(f"decl: step is 1-based, got {step}")
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
        generator = torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + counter)
        noise = torch.empty(batch.global_size, 2, dtype=torch.float64, device=device)
        return batch.local_rows(noise.exponential_(generator=generator))

    # ---- the buffer -------------------------------------------------------------------------

    def _current_layout(self) -> tuple[int, int]:
        return (get_rank(), get_world_size()) if self.shard_buffer else (0, 1)

    def _shard_length(self, world_size: int) -> int:
        return -(-self.id_space // world_size)

    def _shard_start(self) -> int:
        rank, world_size = self._layout
        return rank * self._shard_length(world_size)

    def _ensure_layout(self) -> None:
        """Re-slice a buffer built before the process group existed (world size 1 then)."""
        layout = self._current_layout()
        if layout == self._layout:
            return
        if self._layout[1] != 1:
            raise RuntimeError(f"decl: buffer sharded for {self._layout} but now running as "
                               f"{layout}; save and reload the state_dict to change world size")
        full = self.log_u
        self._layout = layout
        start, length = self._shard_start(), self._shard_length(layout[1])
        shard = full.new_full((length, 2), -math.inf)
        shard[:max(0, min(length, self.id_space - start))] = full[start:start + length]
        self.log_u = shard

    def full_buffer(self) -> Tensor:
        """``log u`` over the whole id space, ``[id_space, 2]`` (a collective when sharded)."""
        if self._layout[1] == 1:
            return self.log_u
        return gather_no_grad(self.log_u)[:self.id_space]

    def buffer_coverage(self) -> Tensor:
        """Fraction of the id space visited at least once (a 0-dim tensor on the buffer's device;
        converting it to a number is the caller's choice, e.g. only when it is logged)."""
        return self.visited.double() / max(1, self.id_space)

    def _owned_rows(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """``(owned, row)``: whether this rank's shard holds each id, and its row there (0 when
        not owned). Computed without boolean indexing, whose data-dependent size would make the
        host wait for the device."""
        start = self._shard_start()
        owned = (ids >= start) & (ids < start + self.log_u.shape[0])
        return owned, torch.where(owned, ids - start, torch.zeros_like(ids))

    def _lookup(self, ids: Tensor) -> Tensor:
        if self._layout[1] == 1:
            return self.log_u[ids]
        owned, rows = self._owned_rows(ids)
        values = torch.where(owned[:, None], self.log_u[rows], 0.0)
        # Exactly one rank owns each id and the others add 0 (-inf + 0 stays -inf).
        return all_reduce_sum(values)

    def _write(self, ids: Tensor, new_log_u: Tensor, old_log_u: Tensor) -> None:
        """Store ``new_log_u`` at ``ids``; a sample id seen twice in one global batch takes the
        value of its last occurrence. Runs on the device with no host sync (no ``unique``, no
        boolean indexing, no ``int()``): every write position gets a value, and positions that
        land on one row carry the same value, so the scatter is deterministic."""
        count = ids.shape[0]
        positions = torch.arange(count, device=ids.device)
        # A stable sort groups equal ids with their positions in order: the last of a run is the
        # last occurrence. Each position then takes the position of its run's last element.
        sorted_ids, order = torch.sort(ids, stable=True)
        run_end = torch.ones(count, dtype=torch.bool, device=ids.device)
        run_end[:-1] = sorted_ids[1:] != sorted_ids[:-1]
        end_index = torch.where(run_end, positions, count)
        end_index = end_index.flip(0).cummin(0).values.flip(0)  # the next run end at or after
        last_position = torch.empty_like(order).scatter_(0, order, order[end_index])
        values = new_log_u[last_position].to(self.log_u.dtype)
        # One count per distinct id that had never been visited.
        first_visits = (run_end & ~torch.isfinite(old_log_u[order, 0])).sum()
        if self._layout[1] == 1:
            rows = ids
        else:
            owned, rows = self._owned_rows(ids)
            # An id of another shard writes nothing: it is redirected to the row (and value) of
            # one owned position, or to row 0 with row 0's current value when none is owned.
            anchor = torch.argmax(owned.to(torch.uint8))
            anchor_owned = owned[anchor]
            anchor_row = torch.where(anchor_owned, rows[anchor], torch.zeros_like(rows[anchor]))
            anchor_value = torch.where(anchor_owned, values[anchor], self.log_u[0])
            rows = torch.where(owned, rows, anchor_row)
            values = torch.where(owned[:, None], values, anchor_value)
        if self._undo is None:  # a write outside forward (tests, tools)
            self._undo = {"draws": self._unstepped_draws}
        self._undo.update(rows=rows, previous=self.log_u[rows],
                          visited=self.visited.clone())
        self.log_u.index_put_((rows,), values)
        self.visited += first_visits

    def rollback(self) -> None:
        """Undo the last forward: restore the buffer rows it wrote (their previous values, read
        before the write), the visit count and the ``sample`` draw counter."""
        undo, self._undo = self._undo, None
        if undo is None:
            return
        self._unstepped_draws = undo["draws"]
        if "rows" in undo:
            with torch.no_grad():
                # Repeated rows carry the same previous value, so the restore is deterministic.
                self.log_u.index_put_((undo["rows"],), undo["previous"])
                self.visited.copy_(undo["visited"])

    def _global_ids(self, batch: PairBatch) -> Tensor:
        if batch.sample_ids is None:
            raise ValueError("decl: estimator 'buffer' needs sample_ids (global dataset ids)")
        if self.id_space <= 0:
            raise ValueError("decl: estimator 'buffer' needs id_space > 0 (the number of distinct "
                             "sample ids): build_loss('decl', id_space=...)")
        local = batch.sample_ids.to(device=batch.image.device, dtype=torch.long).reshape(-1)
        if local.shape[0] != batch.local_size:
            raise ValueError(f"decl: {local.shape[0]} sample_ids for {batch.local_size} pairs")
        ids = gather_no_grad(local)
        # Checked on the device without making the host wait: on CPU this raises at once, on a
        # GPU it is a device-side assertion (an out-of-range index would be one anyway).
        message = (f"decl: a sample id is outside the declared id space [0, {self.id_space}); "
                   "was the loss built with the dataset's id_space?")
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
        if self.needs_sample_ids and self._layout[1] > 1:
            destination[prefix + "log_u"] = self.full_buffer()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "log_u"
        if not (self.needs_sample_ids and key in state_dict):
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                                 missing_keys, unexpected_keys, error_msgs)
        full = state_dict[key]
        if tuple(full.shape) != (self.id_space, 2):
            error_msgs.append(f"decl: checkpoint buffer {key} has shape {tuple(full.shape)}, but "
                              f"this loss has id_space {self.id_space} (expected "
                              f"({self.id_space}, 2))")
            return
        self._ensure_layout()
        start, length = self._shard_start(), self.log_u.shape[0]
        shard = full.new_full((length, 2), -math.inf)
        shard[:max(0, min(length, self.id_space - start))] = full[start:start + length]
        state_dict[key] = shard
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
        finally:
            state_dict[key] = full

    # ---- the loss ---------------------------------------------------------------------------

    def prepare(self, batch: PairBatch) -> dict:
        self._undo = {"draws": self._unstepped_draws}
        estimator = self.estimator if self.training else "batch"
        state = {"lambda": self.schedule_weight(batch.step), "estimator": estimator}
        if estimator == "buffer":
            self._ensure_layout()
            state["ids"] = self._global_ids(batch)
            state["old_log_u"] = self._lookup(state["ids"])
        elif estimator == "momentum":
            state["log_u"] = self.momentum_log_means(batch)
        if self.u_mode == "sample":
            state["noise"] = self.exponential_noise(batch)
        return state

    @torch.no_grad()
    def momentum_log_means(self, batch: PairBatch) -> Tensor:
        """``log m_i`` of the local anchors from the EMA towers' features, ``[B_local, 2]``."""
        if batch.momentum_features is None:
            raise ValueError("decl: estimator 'momentum' needs momentum_features=(image, text) "
                             "from the EMA towers")
        image, text = batch.momentum_features
        if image.shape != batch.image.shape or text.shape != batch.text.shape:
            raise ValueError("decl: momentum_features must have the shape of the features")
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

    def row_context(self, batch: PairBatch, direction: str, state: dict) -> DeCLRows:
        column = 0 if direction == IMAGE_TO_TEXT else 1
        context = DeCLRows()
        if state["estimator"] == "buffer":
            context.old_log_u = batch.local_rows(state["old_log_u"])[:, column]
        elif state["estimator"] == "momentum":
            context.log_u = state["log_u"][:, column]
        if "noise" in state:
            context.noise = state["noise"][:, column]
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

    def reduce(self, batch: PairBatch, terms: list[dict[str, Tensor]], state: dict) -> dict:
        loss_1 = torch.stack([t["loss_1"].mean() for t in terms]).mean()
        loss_2 = torch.stack([t["loss_2"].mean() for t in terms]).mean()
        weight = state["lambda"]
        if weight == 1.0:
            loss = loss_1
        elif weight == 0.0:
            loss = loss_2
        else:
            loss = weight * loss_1 + (1 - weight) * loss_2
        result = {"loss": loss, "loss_1": loss_1.detach(), "loss_2": loss_2.detach(),
                  "lambda": weight,
                  "U": torch.cat([t["U"] for t in terms]).detach().mean().float()}
        if state["estimator"] == "buffer":
            new_log_u = torch.stack([terms[0]["log_u"], terms[1]["log_u"]], dim=1).detach()
            self._write(state["ids"], gather_no_grad(new_log_u), state["old_log_u"])
            result["buffer_coverage"] = self.buffer_coverage()
        return result

