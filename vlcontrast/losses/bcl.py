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
anchor's full global row, so they do not depend on how the batch is split across ranks. Bitwise
identical candidates (a duplicated caption or image) are ranked on one logit, their first copy's
(:func:`duplicate_columns`): a matmul rounds equal dot products differently by column and by the
shape of the block it computes, so the raw logits of duplicates tie in one block and not in
another, and a rank-based weight jumps where the order changes. One logit per candidate makes the
ties exact whatever the blocking (dense, chunked, any number of ranks).
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


# The candidate hash's multipliers: odd 64-bit Weyl steps (fixed, so every rank finds the same
# columns; made on the features' device, so no tensor is made on the CPU for a GPU run).
_WEYL = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed int64
_WEYL_START = 0x632BE59BD9B4E019


def duplicate_columns(candidates: Tensor) -> Tensor | None:
    """For each candidate row, the first row bitwise equal to it (``-0.0`` counted as ``0.0``);
    ``None`` on the CPU when every row is distinct.

    Sync-free on an accelerator (no data-dependent sizes): rows are hashed to int64, sorted by the
    hash (stable, so a run of equal rows starts at its first index), and a sorted row joins its
    predecessor's run only when the two are equal, so a hash collision can never merge two
    different rows (at worst it leaves a duplicate on its own logit).
    """
    with torch.no_grad():
        rows = candidates.detach()
        n = rows.shape[0]
        bits = (rows + 0.0).contiguous()  # -0.0 + 0.0 = 0.0: equal rows, equal bits
        bits = bits.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[bits.element_size()])
        multipliers = torch.arange(1, rows.shape[1] + 1, dtype=torch.int64, device=rows.device)
        multipliers = multipliers.mul_(_WEYL).add_(_WEYL_START).bitwise_or_(1)
        hashes = torch.zeros(n, dtype=torch.int64, device=rows.device)
        for start in range(0, rows.shape[1], 64):  # int64 wraps: a multiply-add hash
            part = slice(start, start + 64)
            hashes += (bits[:, part].long() * multipliers[part]).sum(1)
        order = torch.sort(hashes, stable=True).indices
        ordered = rows[order]
        joins = (ordered[1:] == ordered[:-1]).all(1)
        positions = torch.arange(n, device=rows.device)
        starts = positions.clone()
        starts[1:].masked_fill_(joins, 0)
        first = order[starts.cummax(0).values]
        columns = torch.empty_like(order).scatter_(0, order, first)
        if not _sync_free_ranks(rows) and bool((columns == positions).all()):
            return None
        return columns


def _rank_keys(values: Tensor, positives: Tensor | None, columns: Tensor | None) -> Tensor:
    """What a block's rows are ranked on: ``values[:, columns]`` (a copy) with each row's positive
    set to ``-inf``; without ``columns`` that is ``values`` itself, its positives overwritten.
    ``positives=None``: ``values``' positives are ``-inf`` already (then a duplicate of a row's
    positive column would be ranked at ``-inf``: pass ``positives`` with ``columns``)."""
    if columns is not None:
        values = values.gather(1, columns.expand(values.shape[0], -1))
    return values if positives is None else fill_positives_(values, positives)


def _rows(positives: Tensor | None, block: slice) -> Tensor | None:
    return None if positives is None else positives[block]


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
        self._columns: Tensor | None = None  # the duplicate columns of the rows being scored

    @torch.no_grad()
    def log_weights(self, logits: Tensor, positives: Tensor, num_negatives: int,
                    columns: Tensor | None = None) -> Tensor:
        """``log w_ij`` for every entry of the block (the positive's entry is meaningless).

        ``w`` depends on a negative only through its count ``#{k': x_k' <= x_k}`` in ``0..K``, so
        it is a table of ``K + 1`` values scattered through each row's sort order: one argsort
        and one scatter per row, whatever the options. ``columns``: the candidates' duplicate
        columns (:func:`duplicate_columns`), ranked on their first copy's logit.
        """
        out = torch.zeros_like(logits)
        self.add_log_weights_(out, logits.clone(), num_negatives, positives=positives,
                              columns=columns)
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
                         ties: list | None = None, positives: Tensor | None = None,
                         columns: Tensor | None = None) -> list:
        """``target += log w`` of the logits ``values``, ranked on :func:`_rank_keys` (``values``'
        positives are set to ``-inf`` when ``columns`` is ``None``); ``target`` may be ``values``
        itself: each row's keys are sorted before it is written. The positive's entry of
        ``target`` gets ``log w_0`` (meaningless: the caller removes it).

        Returns the tied sorted positions ``(rows, positions, run ends)`` of each sub-block;
        passing them back as ``ties`` for the same values skips finding them again (the chunked
        backward gets them from :meth:`sort_and_add_log_weights_` in forward).
        """
        table = self._table(num_negatives, values)
        if _sync_free_ranks(values):
            self._add_log_weights_on_device_(target, values, table, positives, columns)
            return []
        found = []
        for index, block in enumerate(self._sub_blocks(values)):
            # The positive is -inf: sorted first, at position 0, below every negative; the
            # negative at sorted position p then has p negatives <= it (ties: see below).
            keys = _rank_keys(values[block], _rows(positives, block), columns)
            order = _argsort_rows(keys)
            if ties is None:
                sorted_keys = keys.gather(1, order)
                ties_here = _tie_run_ends(sorted_keys[:, 1:] == sorted_keys[:, :-1])
                del sorted_keys
            else:
                ties_here = ties[index]
            del keys
            found.append(ties_here)
            rows, positions, ends = ties_here
            tied = order[rows, positions]  # a tie run fills the same positions in any sort
            part = target[block]
            before = part[rows, tied]  # tied entries are set, not corrected: ties stay exact
            part.scatter_add_(1, order, table.expand(part.shape[0], -1))
            part[rows, tied] = before + table[ends]
        return found

    def _add_log_weights_on_device_(self, target: Tensor, values: Tensor, table: Tensor,
                                    positives: Tensor | None = None,
                                    columns: Tensor | None = None) -> None:
        """The accelerator path of :meth:`add_log_weights_`, with no host sync.

        Finding tie runs needs ``nonzero`` (a data-dependent size: the host waits for the device
        every block). Instead each entry's count ``#{k': x_k' <= x_k}`` is read off the sorted row
        with a right-sided ``searchsorted``, which counts a whole tie run at once; minus one for
        the positive (``-inf``, first in every sorted row).
        """
        for block in self._sub_blocks(values):
            keys = _rank_keys(values[block], _rows(positives, block), columns)
            counts = torch.searchsorted(keys.sort(dim=1).values, keys, right=True).sub_(1)
            del keys
            target[block] += table[counts]

    @torch.no_grad()
    def sort_and_add_log_weights_(self, values: Tensor, num_negatives: int,
                                  positives: Tensor | None = None,
                                  columns: Tensor | None = None) -> list:
        """Replace each row of the logits ``values`` by its sorted rank keys (:func:`_rank_keys`,
        positive ``-inf``) plus ``log w`` in sorted order: the row's multiset of
        ``L_ij + log w_ij`` (``L`` of a duplicate column: its first copy's, the same number to
        rounding), which is all a logsumexp needs, from a value sort instead of an argsort and a
        scatter. Returns the ties as :meth:`add_log_weights_` does (same sub-blocks)."""
        table = self._table(num_negatives, values)
        found = []
        for block in self._sub_blocks(values):
            part = values[block]
            if columns is not None:
                part.copy_(_rank_keys(part, _rows(positives, block), columns))
            elif positives is not None:
                fill_positives_(part, positives[block])
            part = _sort_rows_(part)
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

    def score_rows(self, anchors: Tensor, candidates: Tensor, scale: Tensor | float,
                   first_positive: int, context: RowContext, num_negatives: int,
                   positive: Tensor | None = None) -> dict[str, Tensor]:
        # The statistic of these rows ranks duplicate candidates on one logit (module docstring).
        self._columns = duplicate_columns(candidates)
        try:
            return super().score_rows(anchors, candidates, scale, first_positive, context,
                                      num_negatives, positive)
        finally:
            self._columns = None

    def row_statistic(self) -> RowStatistic:
        return WeightedNegativeLogSumExp(self, self._columns)

    def statistic_terms(self, value: Tensor, positive: Tensor, context: RowContext,
                        num_negatives: int) -> dict[str, Tensor]:
        return {"loss": torch.logaddexp(positive, value) - positive}


class WeightedNegativeLogSumExp(RowStatistic):
    """``logsumexp_{j != i}(L_ij + log w_ij)`` with BCL's weights (no gradient through ``w``).

    The chunked forward needs only each row's values: it sorts the block in place and adds the
    weights in sorted order (no argsort, no scatter). The chunked backward needs ``log w`` at each
    column: it argsorts the recomputed block (bitwise the forward's: same matmul, same inputs) and
    reuses the tie runs that forward found, kept per block. ``columns``: the candidates' duplicate
    columns (:func:`duplicate_columns`), ranked on their first copy's logit in every mode.
    """

    def __init__(self, loss: BCLLoss, columns: Tensor | None = None):
        self.loss = loss
        self.columns = columns
        self.negatives = LogSumExp(exclude_positive=True)
        self.ties: dict[int, list] = {}  # first positive column of a block -> its ties

    def _weighted(self, logits: Tensor, positives: Tensor, ties: list | None = None) -> Tensor:
        """``L + log w`` in place (the block is fresh; the matmul's backward does not need it;
        ``w`` has no gradient, so adding it into the detached view leaves autograd's ``L``),
        positives ``-inf``."""
        if self.columns is None:
            logits = fill_positives_(logits, positives)  # ranked in place, positives -inf
        self.loss.add_log_weights_(logits.detach(), logits.detach(), logits.shape[1] - 1, ties,
                                   positives, self.columns)
        return fill_positives_(logits, positives) if self.columns is not None else logits

    def dense(self, logits, positives):
        return self.negatives.dense(self._weighted(logits, positives), positives)

    def forward(self, logits, positives):
        if _sync_free_ranks(logits):
            # Keyed caches need the block's first column on the host (a sync): recompute instead.
            return self.negatives.forward(self._weighted(logits, positives), positives)
        self.ties[int(positives[0])] = self.loss.sort_and_add_log_weights_(
            logits, logits.shape[1] - 1, positives, self.columns)
        # Sorted rows: every positive (-inf + log w_0) sits in column 0.
        return self.negatives.forward(logits, torch.zeros_like(positives))

    def backward(self, logits, positives, value, aux, grad):
        ties = None if _sync_free_ranks(logits) else self.ties.pop(int(positives[0]), None)
        weighted = self._weighted(logits, positives, ties)
        return self.negatives.backward(weighted, positives, value, aux, grad)
