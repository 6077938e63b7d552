"""Step logger: when to log, the timing window, what a training record holds, progress output.

:class:`StepTimer` splits each attempt into data / forward / loss / backward / step. On a GPU the
split comes from CUDA events recorded on the stream and read only at log time (one
synchronisation per logged window, none per step); host timestamps would measure when the CPU
*queued* the kernels. On CPU it is ``time.perf_counter``.

:class:`StepLogger` owns the window between two logged steps (wall time, samples, attempts), decides
``should_log`` itself, turns the step's tensors into numbers only at log steps (no ``.item()`` in
between), writes the record through :class:`~vlcontrast.train.metrics.MetricsLogger` and drives the
rank-0 progress display (:class:`vlcontrast.progress.Progress`: a live bar on a terminal, plain
lines in a log file).
"""

from __future__ import annotations

import time
from typing import Any

import torch

PHASES = ("data", "forward", "loss", "backward", "step")


class StepTimer:
    """Time between consecutive :meth:`mark` calls, attributed to the phase each mark names."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, Any]] = []  # (phase, timestamp or event), oldest first
        self._totals = dict.fromkeys(PHASES, 0.0)

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        """The beginning of an attempt (the first phase is measured from here)."""
        self._marks.append(("", self._now()))

    def mark(self, phase: str) -> None:
        """``phase`` ended now."""
        self._marks.append((phase, self._now()))

    def read(self) -> dict[str, float]:
        """Seconds per phase since the last read (synchronises once on a GPU)."""
        marks, self._marks = self._marks, []
        if self.cuda and marks:
            marks[-1][1].synchronize()
        for (_, begin), (phase, end) in zip(marks, marks[1:]):
            if not phase:  # a new attempt started: no phase spans the gap
                continue
            seconds = begin.elapsed_time(end) / 1000 if self.cuda else end - begin
            self._totals[phase] = self._totals.get(phase, 0.0) + seconds
        totals, self._totals = self._totals, dict.fromkeys(PHASES, 0.0)
        return totals


class StepLogger:
    def __init__(self, metrics, *, every: int, total_steps: int, device: torch.device,
                 loss_scaling: bool = False, start_step: int = 0, progress: bool = False,
                 flops_per_sample: float | None = None, peak_flops: float | None = None):
        self.metrics = metrics
        # MFU beside samples_per_s: on CUDA only (a CPU has no meaningful bf16 peak here).
        self.flops_per_sample = flops_per_sample if device.type == "cuda" else None
        self.peak_flops = peak_flops
        self.every = every
        self.total_steps = total_steps
        self.loss_scaling = loss_scaling
        self.timer = StepTimer(device)
        self._window_start = time.perf_counter()
        self._window_samples = 0
        self._window_attempts = 0
        self.progress = None
        self._progress_pending = 0  # attempts whose progress tick waits for their record
        if progress:
            from vlcontrast.progress import Progress

            # Outside a terminal: one plain line at each logged step (``mark``, with its loss),
            # and one every 30 s between them.
            self.progress = Progress(total=total_steps, desc="train", unit="step",
                                     initial=start_step, every_n=0, every_s=30.0)

    def should_log(self, step: int) -> bool:
        return step % self.every == 0 or step == self.total_steps

    def attempt(self) -> None:
        """An attempt (applied or skipped) begins: count it and start its timing."""
        self._window_attempts += 1
        self.timer.start()

    def event(self, step: int, values: dict[str, Any]) -> None:
        self.metrics.log(step, values, kind="event")

    def eval(self, step: int, values: dict[str, Any]) -> None:
        self.metrics.log(step, values, kind="eval")

    def skipped(self, step: int, reason: str, loss: float, bad_in_a_row: int) -> None:
        self.metrics.log(step, {"skipped": reason, "consecutive_bad_steps": bad_in_a_row,
                                "loss": loss}, kind="skip")

    def count(self, global_batch: int, step: int | None = None) -> None:
        """An attempt counted as applied (the loop learns of skips later: :meth:`uncount`). At a
        log step (``step``) the progress line waits for the record's loss and samples/s."""
        self._window_samples += global_batch
        if self.progress is None:
            return
        if step is not None and self.should_log(step):
            self._progress_pending += 1
        else:
            self.progress.update(1)

    def uncount(self, global_batch: int, attempts: int = 1) -> None:
        """``attempts`` counted attempts turned out skipped."""
        self._window_samples -= global_batch * attempts
        if self.progress is not None:
            pending = min(self._progress_pending, attempts)
            self._progress_pending -= pending
            if attempts > pending:
                self.progress.update(pending - attempts)

    def record(self, step: int, *, state, engine, result: dict, data,
               counts: dict[str, int], bad_samples: dict[str, int] | None = None) -> None:
        """At a log step (the loop settled the step first): write the training record.
        ``bad_samples``: the loader's counts summed over every rank and worker (the step's
        collective carried them); None: this rank's own (``data.bad_samples``)."""
        values = self._record(state, engine, result, data, counts, bad_samples)
        self.metrics.log(step, values)
        if self.progress is not None:
            shown = {"loss": f"{values['loss']:.3f}"}
            if "objective" in values:  # FastCLIP/SogCLR: the loss is a surrogate (1.0 at first)
                shown["objective"] = f"{values['objective']:.3f}"
            self.progress.set_postfix(**shown, **{"samples/s": f"{values['samples_per_s']:.0f}"},
                                      at=step)
            if self._progress_pending:
                self.progress.update(self._progress_pending)
                self._progress_pending = 0
            self.progress.mark()

    def _record(self, state, engine, result, data, counts,
                bad_samples: dict[str, int] | None = None) -> dict[str, Any]:
        from vlcontrast.train.engine import read_logit_scale
        from vlcontrast.train.optimizer import trained_lr

        elapsed = time.perf_counter() - self._window_start
        attempts = max(1, self._window_attempts)
        values = {"samples_seen": state.samples_seen, "epoch": data.epoch,
                  "loss": float(result["loss"].detach()), "lr": trained_lr(engine),
                  "logit_scale": read_logit_scale(engine),
                  "samples_per_s": self._window_samples / max(elapsed, 1e-9), **counts}
        if self.flops_per_sample and self.peak_flops:
            # Per GPU: the window's samples are the global batch's, over every rank's device.
            from vlcontrast.distributed import get_world_size

            world = get_world_size()
            values["mfu"] = (values["samples_per_s"] / world * self.flops_per_sample
                             / self.peak_flops)
        grad_norm = engine.get_global_grad_norm()
        if grad_norm is not None:
            values["grad_norm"] = float(grad_norm)
        if self.loss_scaling:
            values["loss_scale"] = float(getattr(engine.optimizer, "cur_scale", 0.0)
                                         or getattr(engine.optimizer, "loss_scale", 0.0))
        values.update({k: float(v) for k, v in result.items() if k != "loss"})
        values.update({f"time/{k}": v / attempts for k, v in self.timer.read().items()})
        bad = data.bad_samples if bad_samples is None else bad_samples
        values.update({f"data/bad_{k}": v for k, v in sorted(bad.items())})
        # data.decode=gpu: images decoded on the CPU instead, per reason.
        values.update({f"data/fallback_{k}": v
                       for k, v in getattr(data, "fallback_samples", {}).items()})
        self._window_start = time.perf_counter()
        self._window_samples = self._window_attempts = 0
        return values

    def close(self) -> None:
        if self.progress is not None:
            if self._progress_pending:
                self.progress.update(self._progress_pending)
            self.progress.close()
            self.progress = None
        self.metrics.close()
