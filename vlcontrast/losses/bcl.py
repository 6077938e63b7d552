"""BCL, Bayesian contrastive learning (docs/losses.md, row ``bcl`` and "BCL weights"; Liu & Wang).

Per anchor (image→text shown)::

    l_i = -log(e^{L_ii} / (e^{L_ii} + sum_{j != i} w_ij e^{L_ij}))
        = -L_ii + logaddexp(L_ii, logsumexp_{j != i}(L_ij + log w_ij))

with the importance weights ``w`` (no gradient) built from the rank-based eCDF of each negative
among the anchor's ``K`` negatives, ``F_k = #{k': x_k' <= x_k} / K`` (the authors' released rule)::

    a = (1 - 2 alpha)(tau_minus - tau_plus) + 1e-3,   b = 2 (alpha tau_minus + (1 - alpha) tau_plus)
    Phi_k = (-b + sqrt(b^2 + 4 a F_k)) / (2 a)        (computed as 2 F_k / (b + sqrt(b^2 + 4 a F_k)))
    phi1 = 2 (1 - Phi), phi2 = 2 Phi
    x_tn = alpha phi1 + (1 - alpha) phi2,   x_fn = (1 - alpha) phi1 + alpha phi2
    x_htn = (alpha (1 - beta) phi1 + (1 - alpha) beta phi2) / (alpha (1 - beta) + (1 - alpha) beta + 1e-3)
    w_k = x_htn / (tau_minus x_tn + tau_plus x_fn),   tau_minus = 1 - tau_plus

Ranks are taken on the logits (ranking ``exp`` would create false ties by overflow) and over the
anchor's full global row, so they do not depend on how the batch is split across ranks.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

from vlcontrast.errors import LossOptionError
from vlcontrast.losses.base import (ContrastiveLoss, LogSumExp, RowContext, RowStatistic,
                                    fill_positives_)
from vlcontrast.losses.registry import register_loss

# The eCDF needs a sort of each row; sorting in sub-blocks of this many entries bounds the
# memory of the sort order and sorted values even in dense mode.
_RANK_BLOCK_ELEMENTS = 1 << 23


def _rows_in_parallel(array: np.ndarray, work) -> None:
    """``work(rows slice)`` over row slices of ``array`` on torch's intra-op threads (numpy's
    sorts release the GIL, so the slices run in parallel)."""
    threads = min(torch.get_num_threads(), array.shape[0])
    if threads < 2 or array.size < (1 << 20):
        work(slice(None))
        return
    step = -(-array.shape[0] // threads)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda start: work(slice(start, start + step)),
                      range(0, array.shape[0], step)))


def _argsort_rows(values: Tensor) -> Tensor:
    if values.device.type != "cpu":
        return values.argsort(dim=1)
    # numpy's SIMD argsort is several times faster than torch's CPU sort (the loss's hot spot).
    array = values.numpy()
    order = np.empty(array.shape, dtype=np.int64)

    def argsort(rows: slice) -> None:
        order[rows] = np.argsort(array[rows], axis=1)
    _rows_in_parallel(array, argsort)
    return torch.from_numpy(order)


def _sort_rows_(values: Tensor) -> Tensor:
    """Sort each row of ``values`` in place (a value sort is ~4x faster than an argsort;
    ``bench/bench_bcl_sort.py``)."""
    if values.device.type != "cpu":
        return values.copy_(values.sort(dim=1).values)
    array = values.numpy()

    def sort(rows: slice) -> None:
        array[rows].sort(axis=1)
    _rows_in_parallel(array, sort)
    return values


def _sync_free_ranks(values: Tensor) -> bool:
    """Whether to rank without a host sync (on an accelerator; the CPU path is faster on CPU)."""
    return values.device.type != "cpu"


def _tie_run_ends(ties: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Sorted positions that share their value with the next one, and where each such run ends.

    ``ties[r, p]`` says ``sorted[r, p] == sorted[r, p + 1]``. Tied entries must all get the rank
    of the run's last position (``#{k': x_k' <= x_k}`` counts the whole run). Ties are rare and
    runs short, so the ends are found by stepping the few tied positions forward.
    """
    rows, positions = ties.nonzero(as_tuple=True)
    ends = positions + 1
    last = ties.shape[1]  # the last sorted position; it never starts a tie
    while True:
        extend = ends < last
        extend[extend.clone()] = ties[rows[extend], ends[extend]]
        if not bool(extend.any()):
            return rows, positions, ends
        ends = ends + extend.long()


@register_loss
class BCLLoss(ContrastiveLoss):
    """InfoNCE with rank-based importance weights on the negatives (hard/false-negative aware).

    Args:
        tau_plus: class prior (probability that a "negative" is a false negative).
        alpha: confidence that the eCDF separates true from false negatives, in [0, 1].
        beta: concentration on hard negatives, in [0, 1] (not alpha = beta = 0 or 1).
    """

    name = "bcl"

    def __init__(self, tau_plus: float = 0.1, alpha: float = 0.5, beta: float = 1.0, *,
                 chunk_size: int = 0):
        super().__init__(chunk_size=chunk_size)
        if not 0 <= tau_plus < 1:
            raise LossOptionError(self.name, "must be in [0, 1)", tau_plus=tau_plus)
        # alpha and beta weigh the densities 2(1 - x) and 2x in the mixtures t, f and h: outside
        # [0, 1] a mixture goes negative for some ranks and its weight's log is NaN.
        for option, value in (("alpha", alpha), ("beta", beta)):
            if not 0 <= value <= 1:  # NaN too
                raise LossOptionError(self.name, "must be in [0, 1] (a mixture weight of the rank "
                                      "densities: outside it some weights are negative, their log "
                                      "NaN)", **{option: value})
        if alpha == beta and alpha in (0, 1):
            # h's numerator alpha (1 - beta) p + (1 - alpha) beta q is then 0 for every rank.
            raise LossOptionError(self.name, "alpha = beta = 1 (or 0) makes every weight 0, so the "
                                  "loss is 0 and nothing trains; the paper uses alpha in [0.5, 1), "
                                  "beta in [0.5, 1]", alpha=alpha, beta=beta)
        self.tau_plus = float(tau_plus)
        self.alpha = float(alpha)
        self.beta = float(beta)

    @torch.no_grad()
    def log_weights(self, logits: Tensor, positives: Tensor, num_negatives: int) -> Tensor:
        """``log w_ij`` for every entry of the block (the positive's entry is meaningless).

        ``w`` depends on a negative only through its count ``#{k': x_k' <= x_k}`` in ``0..K``, so
        it is a table of ``K + 1`` values scattered through each row's sort order: one argsort
        and one scatter per row, whatever the options.
        """
        values = fill_positives_(logits.clone(), positives)
        out = torch.zeros_like(logits)
        self.add_log_weights_(out, values, num_negatives)
        return out

    def _table(self, num_negatives: int, values: Tensor) -> Tensor:
        """``log w`` for ``0..K`` negatives ``<=`` the entry, in the dtype of ``values``."""
        counts = torch.arange(num_negatives + 1, dtype=torch.float64, device=values.device)
        # A zero weight (the positive's entry F = 0 when alpha = 0 or beta = 1) becomes
        # e^{-10^4}: the same 0, but finite, so adding it to the positive's -inf stays -inf.
        return self.log_weights_from_ecdf(counts / num_negatives).clamp(min=-1e4).to(values.dtype)

    @staticmethod
    def _sub_blocks(values: Tensor):
        """Row slices whose sort order (int64) stays small even for a dense block."""
        rows_per_block = max(1, _RANK_BLOCK_ELEMENTS // values.shape[1])
        for start in range(0, values.shape[0], rows_per_block):
            yield slice(start, start + rows_per_block)

    @torch.no_grad()
    def add_log_weights_(self, target: Tensor, values: Tensor, num_negatives: int,
                         ties: list | None = None) -> list:
        """``target += log w`` of ``values`` (logits whose positives are ``-inf``); ``target`` may
        be ``values`` itself: each row is sorted before it is written.

        Returns the tied sorted positions ``(rows, positions, run ends)`` of each sub-block;
        passing them back as ``ties`` for the same values skips finding them again (the chunked
        backward gets them from :meth:`sort_and_add_log_weights_` in forward).
        """
        table = self._table(num_negatives, values)
        if _sync_free_ranks(values):
            self._add_log_weights_on_device_(target, values, table)
            return []
        found = []
        for index, block in enumerate(self._sub_blocks(values)):
            # The positive is -inf: sorted first, at position 0, below every negative; the
            # negative at sorted position p then has p negatives <= it (ties: see below).
            order = _argsort_rows(values[block])
            if ties is None:
                sorted_values = values[block].gather(1, order)
                ties_here = _tie_run_ends(sorted_values[:, 1:] == sorted_values[:, :-1])
                del sorted_values
            else:
                ties_here = ties[index]
            found.append(ties_here)
            rows, positions, ends = ties_here
            tied = order[rows, positions]  # a tie run fills the same positions in any sort
            part = target[block]
            before = part[rows, tied]  # tied entries are set, not corrected: ties stay exact
            part.scatter_add_(1, order, table.expand(part.shape[0], -1))
            part[rows, tied] = before + table[ends]
        return found

    def _add_log_weights_on_device_(self, target: Tensor, values: Tensor, table: Tensor) -> None:
        """The accelerator path of :meth:`add_log_weights_`, with no host sync.

        Finding tie runs needs ``nonzero`` (a data-dependent size: the host waits for the device
        every block). Instead each entry's count ``#{k': x_k' <= x_k}`` is read off the sorted row
        with a right-sided ``searchsorted``, which counts a whole tie run at once; minus one for
        the positive (``-inf``, first in every sorted row).
        """
        for block in self._sub_blocks(values):
            part = values[block]
            counts = torch.searchsorted(part.sort(dim=1).values, part, right=True).sub_(1)
            target[block] += table[counts]

    @torch.no_grad()
    def sort_and_add_log_weights_(self, values: Tensor, num_negatives: int) -> list:
        """Sort each row of ``values`` (positives ``-inf``) in place and add ``log w`` in sorted
        order: the row's multiset of ``L_ij + log w_ij``, which is all a logsumexp needs, from a
        value sort instead of an argsort and a scatter. Returns the ties as
        :meth:`add_log_weights_` does (same sub-blocks)."""
        table = self._table(num_negatives, values)
        found = []
        for block in self._sub_blocks(values):
            part = _sort_rows_(values[block])
            rows, positions, ends = ties_here = _tie_run_ends(part[:, 1:] == part[:, :-1])
            found.append(ties_here)
            before = part[rows, positions]
            part += table
            part[rows, positions] = before + table[ends]
        return found

    def log_weights_from_ecdf(self, ecdf: Tensor) -> Tensor:
        alpha, beta, tau_plus = self.alpha, self.beta, self.tau_plus
        tau_minus = 1 - tau_plus
        a = (1 - 2 * alpha) * (tau_minus - tau_plus) + 1e-3
        b = 2 * (alpha * tau_minus + (1 - alpha) * tau_plus)
        # Rationalised root: no cancellation when a is small (a = 1e-3 at alpha = 0.5).
        phi = 2 * ecdf / (b + torch.sqrt(b * b + 4 * a * ecdf))
        phi1, phi2 = 2 * (1 - phi), 2 * phi
        true_negative = alpha * phi1 + (1 - alpha) * phi2
        false_negative = (1 - alpha) * phi1 + alpha * phi2
        hard_true_negative = ((alpha * (1 - beta) * phi1 + (1 - alpha) * beta * phi2)
                              / (alpha * (1 - beta) + (1 - alpha) * beta + 1e-3))
        weights = hard_true_negative / (tau_minus * true_negative + tau_plus * false_negative)
        return torch.log(weights)

    def row_statistic(self) -> RowStatistic:
        return WeightedNegativeLogSumExp(self)

    def statistic_terms(self, value: Tensor, positive: Tensor, context: RowContext,
                        num_negatives: int) -> dict[str, Tensor]:
        return {"loss": torch.logaddexp(positive, value) - positive}


class WeightedNegativeLogSumExp(RowStatistic):
    """``logsumexp_{j != i}(L_ij + log w_ij)`` with BCL's weights (no gradient through ``w``).

    The chunked forward needs only each row's values: it sorts the block in place and adds the
    weights in sorted order (no argsort, no scatter). The chunked backward needs ``log w`` at each
    column: it argsorts the recomputed block (bitwise the forward's: same matmul, same inputs) and
    reuses the tie runs that forward found, kept per block.
    """

    def __init__(self, loss: BCLLoss):
        self.loss = loss
        self.negatives = LogSumExp(exclude_positive=True)
        self.ties: dict[int, list] = {}  # first positive column of a block -> its ties

    def _weighted(self, logits: Tensor, positives: Tensor, ties: list | None = None) -> Tensor:
        """``L + log w`` in place (the block is fresh; the matmul's backward does not need it;
        ``w`` has no gradient, so adding it into the detached view leaves autograd's ``L``)."""
        logits = fill_positives_(logits, positives)
        self.loss.add_log_weights_(logits.detach(), logits.detach(), logits.shape[1] - 1, ties)
        return logits

    def dense(self, logits, positives):
        return self.negatives.dense(self._weighted(logits, positives), positives)

    def forward(self, logits, positives):
        if _sync_free_ranks(logits):
            # Keyed caches need the block's first column on the host (a sync): recompute instead.
            return self.negatives.forward(self._weighted(logits, positives), positives)
        logits = fill_positives_(logits, positives)
        self.ties[int(positives[0])] = self.loss.sort_and_add_log_weights_(logits,
                                                                           logits.shape[1] - 1)
        # Sorted rows: every positive (-inf + log w_0) sits in column 0.
        return self.negatives.forward(logits, torch.zeros_like(positives))

    def backward(self, logits, positives, value, aux, grad):
        ties = None if _sync_free_ranks(logits) else self.ties.pop(int(positives[0]), None)
        weighted = self._weighted(logits, positives, ties)
        return self.negatives.backward(weighted, positives, value, aux, grad)
