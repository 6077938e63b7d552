"""Progress reporting that suits both a terminal and a log file.

:class:`Progress` is a live tqdm bar when its stream is a terminal. When it is not (a SLURM log
file, CI, a pipe), a bar would write thousands of carriage-return updates into the log, so it
prints instead one plain line every ``every_n`` updates or ``every_s`` seconds, and one when it is
closed::

    train 120/400 (30%) | loss 2.31 | 812 samples/s | ETA 4m10s

Postfix values may be tensors: they are converted to numbers only when a line is written, so a
caller can hand over a loss every step without forcing a device sync every step. Values measured at
one count (a logged step's loss) are labelled with it on a line written at another (between logged
steps, or the last line of a run that stopped)::

    train 127/400 (32%) | step 120: loss 2.31, 812 samples/s | 3.1 step/s | ETA 1m28s
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO, Any


def format_duration(seconds: float) -> str:
    """``4m10s``, ``1h02m``, ``12s``: short and fixed-format for log lines."""
    if not math.isfinite(seconds):
        return "?"
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{seconds:02d}s"
    return f"{seconds}s"


def _format_value(value: Any) -> str:
    if hasattr(value, "item") and callable(value.item):  # a tensor or numpy scalar
        value = value.item()
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _is_terminal(stream: IO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed stream
        return False


class Progress:
    """A progress report over ``total`` units (``None``: unknown total).

    Args:
        total: number of units expected (``None`` if unknown: no percentage or ETA).
        desc: what is being counted, the first word of every line.
        unit: name of one unit (the rate is printed as ``<rate> <unit>/s``).
        initial: units already done (a resumed run), not counted in the rate.
        every_s: outside a terminal, write a line at least this many seconds apart (0: off).
        every_n: outside a terminal, write a line every this many updates (0: off). With both
            off, every update writes a line.
        stream: where to write (default ``sys.stderr``); a terminal gets a tqdm bar.
        disable: write nothing (non-zero ranks).
    """

    def __init__(self, total: int | None, desc: str, unit: str = "step", initial: int = 0,
                 every_s: float = 30.0, every_n: int = 0, stream: IO | None = None,
                 disable: bool = False):
        if every_s < 0 or every_n < 0:
            raise ValueError(f"Progress: every_s and every_n must be >= 0, got {every_s}, "
                             f"{every_n}")
        self.total = total
        self.desc = desc
        self.unit = unit
        self.n = initial
        self.initial = initial
        self.every_s = every_s
        self.every_n = every_n
        self.stream = stream if stream is not None else sys.stderr
        self.disable = disable
        self.postfix: dict[str, Any] = {}
        self.postfix_at: int | None = None  # the count the postfix was measured at, if one
        self._start = time.monotonic()
        self._last_time = self._start
        self._last_n = initial
        self._updates_since_line = 0
        self._closed = False
        self._bar = None
        if not disable and _is_terminal(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, initial=initial,
                             file=self.stream, dynamic_ncols=True)

    @property
    def is_bar(self) -> bool:
        """Whether this report is a live tqdm bar (the stream is a terminal)."""
        return self._bar is not None

    def update(self, n: int = 1) -> None:
        """Count ``n`` more units done."""
        if self.disable or self._closed:
            return
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
            return
        self._updates_since_line += 1
        now = time.monotonic()
        due_by_count = self.every_n > 0 and self._updates_since_line >= self.every_n
        due_by_time = self.every_s > 0 and now - self._last_time >= self.every_s
        if due_by_count or due_by_time or (self.every_n == 0 and self.every_s == 0):
            self._write_line(now)

    def set_postfix(self, *, at: int | None = None, **values: Any) -> None:
        """Values shown after the count (``loss=2.31``); a key ending in ``/s`` is a rate
        written value first (``samples/s`` -> ``812 samples/s``). ``at``: the count they were
        measured at; a line at another count says so (``step 120: loss 2.31``)."""
        if self.disable or self._closed:
            return
        self.postfix, self.postfix_at = dict(values), at
        if self._bar is not None:
            self._bar.set_postfix({key: _format_value(value) for key, value in values.items()},
                                  refresh=False)

    def write(self, message: str) -> None:
        """Print a message without breaking the bar."""
        if self.disable:
            return
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def line(self, now: float | None = None) -> str:
        """The plain line for the current state."""
        now = time.monotonic() if now is None else now
        parts = []
        if self.total:
            percent = 100.0 * self.n / self.total
            parts.append(f"{self.desc} {self.n}/{self.total} ({percent:.0f}%)")
        else:
            parts.append(f"{self.desc} {self.n}")
        parts.extend(self._postfix_parts())
        elapsed = now - self._start
        done = self.n - self.initial
        rate = done / elapsed if elapsed > 0 else 0.0
        if done > 0:
            parts.append(f"{rate:.3g} {self.unit}/s")
        if self.total and not (self._closed and self.n < self.total):  # none once stopped short
            remaining = max(0, self.total - self.n)
            eta = remaining / rate if rate > 0 else (0.0 if remaining == 0 else math.inf)
            parts.append(f"ETA {format_duration(eta)}")
        return " | ".join(parts)

    def _postfix_parts(self) -> list[str]:
        """``["loss 2.31", "812 samples/s"]``, or ``["step 120: loss 2.31, 812 samples/s"]``
        where they were measured at another count than the current one."""
        parts = []
        for key, value in self.postfix.items():
            text = _format_value(value)
            parts.append(f"{text} {key}" if key.endswith("/s") else f"{key} {text}")
        if parts and self.postfix_at is not None and self.postfix_at != self.n:
            return [f"{self.unit} {self.postfix_at}: " + ", ".join(parts)]
        return parts

    def _write_line(self, now: float) -> None:
        print(self.line(now), file=self.stream, flush=True)
        self._last_time = now
        self._last_n = self.n
        self._updates_since_line = 0

    def mark(self) -> None:
        """Outside a terminal, write a line now (a milestone: a logged training step), unless the
        last line already shows this count; a bar shows the state anyway."""
        if self.disable or self._closed or self._bar is not None:
            return
        if self.n == self._last_n and self._updates_since_line == 0:
            return
        self._write_line(time.monotonic())

    def close(self) -> None:
        """End the report: closes the bar, or writes a last line if there is news since the last."""
        if self._closed:
            return
        self._closed = True
        if self.disable:
            return
        if self._bar is not None:
            if self.postfix_at is not None and self.postfix_at != self.n:  # its last state says so
                self._bar.set_postfix_str(", ".join(self._postfix_parts()), refresh=False)
            self._bar.close()
        elif self.n != self._last_n:
            self._write_line(time.monotonic())

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
