"""Divergence guard: counts skipped steps and stops a run that keeps producing non-finite ones.

A step is skipped on every rank alike when its loss or its gradients are non-finite on any rank
(the decision itself is made in :mod:`vlcontrast.train.step`). The guard keeps the counts: all
skipped steps, fp16 loss-scale overflows (DeepSpeed's dynamic loss scaling skips those while it
lowers the scale; they are calibration, not divergence), and consecutive bad steps. After
``train.max_bad_steps`` consecutive bad ones it raises :class:`TrainingDiverged`, naming the step
and the last good checkpoint.
"""

from __future__ import annotations

from typing import Callable

from vlcontrast.errors import VlcontrastError


class TrainingDiverged(VlcontrastError, RuntimeError):
    """Too many consecutive steps with a non-finite loss or non-finite gradients (the command line
    prints it as one line: the step, the setting and the last good checkpoint)."""


class DivergenceGuard:
    def __init__(self, max_bad_steps: int, *, loss_scaling: bool, last_good: Callable[[], object]):
        self.max_bad_steps = max_bad_steps
        self.fp16 = loss_scaling
        self.last_good = last_good
        self.bad_in_a_row = 0
        self.skipped = 0
        self.overflows = 0

    def applied(self) -> None:
        self.bad_in_a_row = 0

    def skipped_step(self, step: int, reason: str) -> None:
        """Count a skipped attempt at ``step`` (``reason``: "loss" or "gradients")."""
        self.skipped += 1
        if reason == "gradients" and self.fp16:
            self.overflows += 1
        else:
            self.bad_in_a_row += 1

    def check(self, step: int, reason: str) -> None:
        """Raise :class:`TrainingDiverged` after too many bad steps in a row."""
        if self.bad_in_a_row >= self.max_bad_steps:
            raise TrainingDiverged(
                f"non-finite {reason} for {self.bad_in_a_row} consecutive steps (last at step "
                f"{step}; train.max_bad_steps={self.max_bad_steps}); last good checkpoint: "
                f"{self.last_good() or 'none'}")

    def counts(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped, "overflow_steps": self.overflows}

    def state_dict(self) -> dict[str, int]:
        return {"skipped": self.skipped, "overflows": self.overflows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped = int(state["skipped"])
        self.overflows = int(state["overflows"])
