"""The resumable position of a run: optimizer steps taken, samples seen, the data epoch.

One small stateful object (``state_dict``/``load_state_dict``) that the loop advances after every
applied step and the checkpointer saves with the others. Plain ints only, so it loads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps applied so far (skipped steps do not count)."""
    samples_seen: int = 0
    """Training pairs consumed by applied steps, over all ranks."""
    epoch: int = 0
    """The data epoch the next step reads from: the last step's, or the one after it when that
    step read its epoch's last batch. A resume with another world size, whose per-rank loader
    positions do not apply, starts this epoch from its beginning, so a state saved at an epoch's
    end resumes at the next epoch (the loader's own state holds the exact position)."""

    def advance(self, global_batch: int, epoch: int) -> None:
        """One applied step of ``global_batch`` samples; the next step reads from ``epoch``."""
        self.step += 1
        self.samples_seen += global_batch
        self.epoch = epoch

    def retract(self, steps: int, global_batch: int) -> None:
        """``steps`` attempts counted by :meth:`advance` turned out skipped."""
        self.step -= steps
        self.samples_seen -= steps * global_batch

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "samples_seen": self.samples_seen, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.epoch = int(state["epoch"])
