"""Diagnostics that measure what a loss does to training, as opposed to how well a run ends.

``gradient-bias`` (:mod:`vlcontrast.diagnose.gradient_bias`, ``docs/diagnose.md``): at a fixed
model state and ``N`` fixed samples, how far the expected mini-batch gradient of each loss is from
its full-data gradient, per batch size, w.r.t. the features and the tower parameters.
"""

from vlcontrast.diagnose.estimators import DEFAULT_LOSSES, Estimator, Features, expand_losses
from vlcontrast.diagnose.gradient_bias import (DEFAULT_BATCH_SIZES, GradientBiasSettings,
                                               run_gradient_bias)
from vlcontrast.diagnose.montecarlo import BiasStatistics, compare, estimate_cell

__all__ = ["DEFAULT_BATCH_SIZES", "DEFAULT_LOSSES", "BiasStatistics", "Estimator", "Features",
           "GradientBiasSettings", "compare", "estimate_cell", "expand_losses",
           "run_gradient_bias"]
