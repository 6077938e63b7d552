"""The study's statistics: mean with a t confidence interval, paired comparisons, the
Holm-Bonferroni correction over a family of comparisons, and the smallest difference a paired
design of n seeds can detect (at a single test's level or at the family's Bonferroni level).

Everything here is plain arithmetic on lists of floats (no numpy, no scipy at run time: scipy is
not a dependency of the package): the Student-t CDF comes from the regularised incomplete beta
function, its inverse from bisection, and both, the paired-t p-values and the Holm adjustment are
checked against ``scipy.stats`` (and ``statsmodels`` where installed) in ``tests/study/test_study.py``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def _t_cdf(t: float, df: int) -> float:
    """Student-t CDF through the regularised incomplete beta function (Lentz continued fraction)."""
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2.0, 0.5, x)
    return 1.0 - tail if t > 0 else tail


def t_two_sided_p(t: float, df: int) -> float:
    """Two-sided p-value of a Student-t statistic, ``P(|T_df| >= |t|)``, computed as the tail
    ``I_{df/(df+t^2)}(df/2, 1/2)`` directly (no ``1 - cdf`` cancellation for small p)."""
    if df < 1:
        raise ValueError(f"t_two_sided_p(df={df}): need df >= 1")
    if math.isnan(t):
        return float("nan")
    if math.isinf(t):
        return 0.0
    return min(1.0, _betainc(df / 2.0, 0.5, df / (df + t * t)))


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) (Numerical Recipes' betacf, 1e-14 tolerance)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1.0) / (a + b + 2.0):  # the continued fraction converges fast on this side only
        return 1.0 - _betainc(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-14:
            break
    return math.exp(log_front) * result / a


def t_quantile(p: float, df: int) -> float:
    """Inverse Student-t CDF (bisection on the CDF; df >= 1)."""
    if not 0.0 < p < 1.0 or df < 1:
        raise ValueError(f"t_quantile(p={p}, df={df}): need 0 < p < 1 and df >= 1")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while _t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        middle = 0.5 * (low + high)
        if _t_cdf(middle, df) < p:
            low = middle
        else:
            high = middle
        if high - low < 1e-12:
            break
    return 0.5 * (low + high)


@dataclass
class Interval:
    mean: float
    low: float
    high: float
    n: int
    sd: float
    """Sample standard deviation (0 for a single value)."""

    @property
    def half_width(self) -> float:
        return 0.5 * (self.high - self.low)


def mean_interval(values: list[float], confidence: float = 0.95) -> Interval:
    """Mean and its two-sided t confidence interval (``scipy.stats.t.interval`` with the standard
    error ``sd / sqrt(n)``); a single value gives a zero-width interval and sd 0."""
    if not values:
        raise ValueError("mean_interval: no values")
    n = len(values)
    mean = statistics.fmean(values)
    if n == 1:
        return Interval(mean, mean, mean, 1, 0.0)
    sd = statistics.stdev(values)
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, sd)


@dataclass
class PairedComparison:
    difference: Interval
    """Mean of (candidate - baseline) over the paired seeds, with its t interval."""
    p_value: float
    """Two-sided paired t test (``scipy.stats.ttest_rel``); nan with fewer than 2 pairs or no
    spread (:data:`NO_SPREAD`): then the comparison is not testable (:attr:`testable`)."""
    detectable: float
    """Smallest true difference the paired t test at this n detects with the requested power
    (two-sided, alpha = 1 - confidence), from the observed SD of the differences; nan when the
    comparison is not testable (a test without a p-value detects nothing, not "≥ 0")."""

    @property
    def testable(self) -> bool:
        """Whether the t test gave a p-value (at least 2 pairs whose differences vary)."""
        return not math.isnan(self.p_value)

    @property
    def untestable_reason(self) -> str:
        """Why the comparison is not testable, as the reports word it ('' when it is)."""
        if self.testable:
            return ""
        if self.difference.n < 2:
            return f"{self.difference.n} paired seed{'s' if self.difference.n != 1 else ''}; 2 needed"
        return ZERO_VARIANCE


def minimum_detectable_difference(sd: float, n: int, confidence: float = 0.95,
                                  power: float = 0.8, tests: int = 1) -> float:
    """Smallest mean paired difference detectable with ``power`` by a two-sided paired t test of
    ``n`` pairs whose differences have standard deviation ``sd``.

    The usual approximation (t quantiles at df = n - 1): ``(t_{1-alpha/2} + t_{power}) sd / sqrt(n)``
    with ``alpha = 1 - confidence``. With ``tests = m > 1`` the test is made at the Bonferroni
    level ``alpha / m``: the first, strictest step of Holm's procedure over a family of ``m``
    comparisons, so a difference this large is detected with ``power`` after Holm's correction
    whatever the family's other p-values are (Holm can only do better).
    """
    if tests < 1:
        raise ValueError(f"minimum_detectable_difference(tests={tests}): need tests >= 1")
    if n < 2:
        return float("nan")
    alpha = (1.0 - confidence) / tests
    return (t_quantile(1.0 - alpha / 2.0, n - 1) + t_quantile(power, n - 1)) * sd / math.sqrt(n)


ZERO_VARIANCE = "zero variance across seeds"
"""Why a comparison whose paired differences are all equal is not testable (the reports' words:
"not testable (zero variance across seeds)")."""

NO_SPREAD = 1e-12
"""Differences whose SD is at most this are equal up to float rounding: the metrics are fractions
counted over a fixed test set (R@1 over 1,000 pairs moves in steps of 0.0005), so two seeds can
give the same difference, and ``c - b`` rounds it to values 1e-17 apart. A t statistic over that
rounding would be astronomically large; the comparison has no spread and no p-value instead."""


def paired_comparison(candidate: list[float], baseline: list[float], confidence: float = 0.95,
                      power: float = 0.8) -> PairedComparison:
    """Paired t comparison of two equally long lists (element i of each comes from the same seed)."""
    if len(candidate) != len(baseline) or not candidate:
        raise ValueError(f"paired_comparison: {len(candidate)} vs {len(baseline)} values; "
                         "need the same non-zero number of pairs")
    differences = [c - b for c, b in zip(candidate, baseline)]
    interval = mean_interval(differences, confidence)
    n = len(differences)
    if n < 2 or interval.sd <= NO_SPREAD:
        p_value = float("nan")
    else:
        p_value = t_two_sided_p(interval.mean / (interval.sd / math.sqrt(n)), n - 1)
    detectable = (float("nan") if math.isnan(p_value)
                  else minimum_detectable_difference(interval.sd, n, confidence, power))
    return PairedComparison(interval, p_value, detectable)


def holm_adjust(p_values: Sequence[float]) -> list[float]:
    """Holm-Bonferroni step-down adjusted p-values, in the input's order.

    With the ``m`` p-values sorted, ``p_(1) <= ... <= p_(m)``, the adjusted value of the k-th is
    ``max_{j <= k} min(1, (m - j + 1) p_(j))``: monotone in the raw p and capped at 1. A
    comparison survives the correction at level alpha exactly when its adjusted p is below
    alpha, which controls the family-wise error rate at alpha (Holm 1979). A NaN p-value (a
    comparison that is not testable: no spread, or fewer than 2 pairs) still counts in ``m`` and
    stays NaN: the others' adjusted values are exactly those of the family with p = 1 in its
    place (a p of 1 sorts last and changes no earlier step), so the family size stays honest.
    """
    m = len(p_values)
    order = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    adjusted = [float("nan")] * m
    running = 0.0
    for rank, (p, index) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[index] = running
    return adjusted
