"""Monte-Carlo estimate of the expected mini-batch gradient ``E[g_B]`` and the statistics on it.

Sampling. A *replicate* is one pass over the ``N`` samples: a random permutation cut into
``N // B`` disjoint batches of ``B`` (each batch is marginally a uniform ``B``-subset, so the
batch gradients' mean is an unbiased estimate of ``E[g_B]``). The replicate's estimate is the
mean of its batch gradients. Replicates are independent, so the spread of their estimates gives
the Monte-Carlo error of the overall mean directly, whatever the correlations between the batches
of one replicate. Partitioning helps: for a loss that is a mean of per-sample terms the batch
gradients of one replicate sum to exactly ``g_N`` (every row appears once with weight ``1/B``),
so the Monte-Carlo noise left is only that of the batch-dependent part of the loss.
Every estimator sees the same permutations at a given ``B`` (common random numbers).

Statistics, for a mean estimate ``g`` of ``E[g_B]`` and the target ``g_N``:

- relative bias ``||g - g_N|| / ||g_N||``;
- Monte-Carlo error ``sqrt(tr Cov(g)) / ||g_N||``: the size of ``g``'s own noise, which is what
  ``||g - g_N||`` is on average when there is no bias. A bias is *detected* only when it exceeds
  :data:`DETECTION_FACTOR` times that (and a float-rounding floor); otherwise it is reported as not
  detected. Since ``E||g - g_N||^2 = ||bias||^2 + tr Cov(g)``, the corrected estimate
  ``sqrt(max(0, ||g - g_N||^2 - tr Cov(g))) / ||g_N||`` is reported too;
- ``cos(g, g_N)``;
- relative variance ``tr Cov(g_B) / ||g_N||^2``: the spread of a *single* batch's gradient.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vlcontrast.diagnose.estimators import Estimator, Features, random_batches, setting_name

# A bias counts as detected above this many Monte-Carlo errors: with no bias, ||g - g_N|| is
# about one error, and exceeding two happens with probability < 5% whatever the noise's shape.
DETECTION_FACTOR = 2.0
# Relative differences below this are float rounding (DeCL stores its buffer in float32).
NUMERICAL_FLOOR = 1e-6
SEED_STRIDE = 1_000_003
"""The batch draws at batch size ``B`` come from a generator seeded ``seed * SEED_STRIDE + B``
(a state's warm-up from ``seed * SEED_STRIDE + B + 500_000``)."""
SEED_RANGE = (0, 2**43 - 1)
"""``seed``'s range (DeCL's): ``seed * SEED_STRIDE + B + 500_000`` stays a 64-bit generator seed in
``[0, 2**63)`` for every batch size below ``4e17``. Beyond it ``torch``'s ``manual_seed`` refuses
the number with a traceback, or wraps a negative one to ``2**64`` plus it (another seed's draws)."""


def check_seed(seed: int, flags: bool = False) -> None:
    """A one-line ConfigError for a ``seed`` outside :data:`SEED_RANGE`, naming it as
    :func:`~vlcontrast.diagnose.estimators.setting_name` does (``--seed`` when ``flags``)."""
    from vlcontrast.errors import ConfigError

    try:
        valid = (not isinstance(seed, bool)
                 and SEED_RANGE[0] <= operator.index(seed) <= SEED_RANGE[1])
    except TypeError:  # not an integer
        valid = False
    if not valid:
        raise ConfigError(f"{setting_name('seed', flags)} must be an integer in [0, 2**43 - 1 = "
                          f"{SEED_RANGE[1]}] (the batch draws at batch size B seed a 64-bit "
                          f"generator with seed * {SEED_STRIDE} + B), got {seed!r}")


@dataclass
class CellEstimate:
    """What one (estimator, batch size) cell measured in feature space."""

    batch_size: int
    replicates: int
    batches: int
    mean: Tensor                 # the estimate of E[g_B], [N, 2D]
    mc_variance: float           # tr Cov(mean): the variance of the estimate itself
    batch_variance: float        # tr Cov(g_B): the variance of one batch's gradient
    group_means: Tensor          # [groups, N, 2D]: means of disjoint sets of replicates
    sample_batches: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    info: dict = field(default_factory=dict)


@dataclass
class BiasStatistics:
    relative_bias: float
    relative_mc_error: float
    relative_bias_corrected: float
    detected: bool
    cosine: float
    relative_variance: float

    def as_dict(self, prefix: str) -> dict:
        return {f"{prefix}_{key}": value for key, value in self.__dict__.items()}


def replicate_count(size: int, batch_size: int, batches_per_size: int, min_replicates: int,
                    groups: int) -> int:
    """Replicates for ``batch_size``: at least ``batches_per_size`` batches and
    ``min_replicates`` replicates, rounded up to a multiple of ``groups``."""
    if batch_size == size:
        # Every replicate is the same single batch: only a stateful estimator could vary.
        return groups * math.ceil(2 / groups)
    per_replicate = size // batch_size
    replicates = max(min_replicates, math.ceil(batches_per_size / per_replicate))
    return groups * math.ceil(replicates / groups)


def estimate_cell(estimator: Estimator, features: Features, batch_size: int, *, replicates: int,
                  groups: int = 1, sample_batches: int = 0, seed: int = 0) -> CellEstimate:
    """Estimate ``E[g_B]`` of ``estimator`` at ``batch_size`` from ``replicates`` replicates.

    Replicate ``r`` is added to group ``r % groups`` (group means feed the parameter-space error);
    the first batch of each of the first ``sample_batches`` replicates is kept (for the
    parameter-space variance of a single batch).
    """
    size, width = features.size, features.width
    check_seed(seed)
    if not 2 <= batch_size <= size:
        raise ValueError(f"batch size {batch_size} must be in [2, N={size}]")
    if replicates < 2 or replicates % groups:
        raise ValueError(f"replicates={replicates} must be >= 2 and a multiple of groups={groups}")
    device, dtype = features.image.device, features.image.dtype
    # One stream for the measured batches (identical for every estimator) and one for any
    # state's warm-up, so a warm-up never shifts the measured batches.
    batches_generator = torch.Generator().manual_seed(seed * SEED_STRIDE + batch_size)
    warmup_generator = torch.Generator().manual_seed(seed * SEED_STRIDE + batch_size + 500_000)
    info = estimator.begin(features, batch_size, warmup_generator)
    mean = torch.zeros(size, width, device=device, dtype=dtype)
    squared_deviations = 0.0   # Welford's M2 over the replicate estimates
    group_sums = torch.zeros(groups, size, width, device=device, dtype=dtype)
    batch_squares = 0.0
    batches = 0
    kept: list[tuple[Tensor, Tensor]] = []
    for replicate in range(replicates):
        if replicate:
            estimator.between_replicates(features, batch_size, warmup_generator)
        estimate = torch.zeros(size, width, device=device, dtype=dtype)
        plan = random_batches(size, batch_size, batches_generator, device)
        for position, indices in enumerate(plan):
            gradient = estimator.batch_gradient(features, indices).to(dtype)
            estimate.index_add_(0, indices, gradient)
            batch_squares += float(gradient.square().sum())
            if position == 0 and len(kept) < sample_batches:
                kept.append((indices, gradient.detach()))
        estimate /= len(plan)
        batches += len(plan)
        delta = estimate - mean
        mean += delta / (replicate + 1)
        squared_deviations += float((delta * (estimate - mean)).sum())
        group_sums[replicate % groups] += estimate
    mc_variance = squared_deviations / (replicates - 1) / replicates
    batch_variance = max(0.0, (batch_squares - batches * float(mean.square().sum()))
                         / max(1, batches - 1))
    return CellEstimate(batch_size, replicates, batches, mean, mc_variance, batch_variance,
                        group_sums / (replicates // groups), kept, info)


def compare(mean: Tensor, target: Tensor, mc_variance: float,
            batch_variance: float) -> BiasStatistics:
    """The report's statistics of an estimate ``mean`` of ``E[g_B]`` against ``g_N``."""
    mean, target = mean.double().reshape(-1), target.double().reshape(-1)
    target_norm_sq = float(target.square().sum())
    if target_norm_sq == 0:
        raise ValueError("the full-data gradient is exactly zero; relative bias is undefined")
    target_norm = math.sqrt(target_norm_sq)
    bias_sq = float((mean - target).square().sum())
    relative_bias = math.sqrt(bias_sq) / target_norm
    relative_error = math.sqrt(max(0.0, mc_variance)) / target_norm
    corrected = math.sqrt(max(0.0, bias_sq - mc_variance)) / target_norm
    mean_norm = float(mean.norm())
    cosine = float(mean @ target) / (mean_norm * target_norm) if mean_norm > 0 else float("nan")
    detected = relative_bias > max(DETECTION_FACTOR * relative_error, NUMERICAL_FLOOR)
    return BiasStatistics(relative_bias, relative_error, corrected, bool(detected), cosine,
                          batch_variance / target_norm_sq)


def spread(vectors: list[Tensor]) -> tuple[Tensor, float]:
    """Mean of ``vectors`` and their sample variance ``sum ||v - mean||^2 / (n - 1)``."""
    stacked = torch.stack([v.double() for v in vectors])
    centre = stacked.mean(0)
    if len(vectors) < 2:
        return centre, float("nan")
    return centre, float((stacked - centre).square().sum()) / (len(vectors) - 1)
