"""vlcontrast.progress.Progress: a tqdm bar on a terminal, plain log lines elsewhere."""

from __future__ import annotations

import io

import pytest
import torch

from vlcontrast import progress as progress_module
from vlcontrast.progress import Progress, format_duration


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class TerminalStream(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(progress_module.time, "monotonic", fake)
    return fake


def test_non_tty_writes_plain_lines_every_n(clock):
    stream = io.StringIO()
    with Progress(400, "train", every_n=40, every_s=0, stream=stream) as bar:
        assert not bar.is_bar
        for _ in range(120):
            clock.now += 0.5
            bar.set_postfix(loss=torch.tensor(2.3125), **{"samples/s": 812})
            bar.update()
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    # 40, 80, 120; close adds nothing new (no progress since the last line).
    assert len(lines) == 3
    assert lines[0].startswith("train 40/400 (10%) | loss 2.312 | 812 samples/s | 2 step/s")
    # 280 steps left at 2 steps/s: 140 s.
    assert lines[2] == "train 120/400 (30%) | loss 2.312 | 812 samples/s | 2 step/s | ETA 2m20s"


def test_non_tty_writes_every_s_and_a_final_line(clock):
    stream = io.StringIO()
    bar = Progress(10, "eval", unit="batch", every_s=30.0, stream=stream)
    for _ in range(7):
        clock.now += 10
        bar.update()
    bar.close()
    lines = stream.getvalue().splitlines()
    # Lines at 30 s, 60 s, and the final one at 70 s.
    assert [line.split(" |")[0] for line in lines] == ["eval 3/10 (30%)", "eval 6/10 (60%)",
                                                      "eval 7/10 (70%)"]
    assert lines[0].endswith("ETA 1m10s")
    assert "0.1 batch/s" in lines[0]
    bar.update()  # after close: ignored
    assert len(stream.getvalue().splitlines()) == 3


def test_resume_rate_counts_only_new_units(clock):
    stream = io.StringIO()
    bar = Progress(100, "train", initial=50, every_n=10, every_s=0, stream=stream)
    for _ in range(10):
        clock.now += 1
        bar.update()
    assert stream.getvalue().splitlines() == ["train 60/100 (60%) | 1 step/s | ETA 40s"]


def test_unknown_total_and_disable(clock):
    stream = io.StringIO()
    bar = Progress(None, "embed", every_n=2, every_s=0, stream=stream)
    clock.now += 1
    bar.update(5)
    bar.update(5)
    assert stream.getvalue() == "embed 10 | 10 step/s\n"
    silent = io.StringIO()
    with Progress(10, "x", every_n=1, stream=silent, disable=True) as quiet:
        quiet.update()
        quiet.write("hello")
    assert silent.getvalue() == ""


def test_tty_uses_tqdm():
    stream = TerminalStream()
    with Progress(10, "train", stream=stream) as bar:
        assert bar.is_bar
        from tqdm import tqdm
        assert isinstance(bar._bar, tqdm)
        bar.update(3)
        bar.set_postfix(loss=1.5)
        assert bar._bar.n == 3
    assert "\r" in stream.getvalue()  # a live bar redraws in place


def test_bad_arguments():
    with pytest.raises(ValueError, match="every_s"):
        Progress(1, "x", every_s=-1, stream=io.StringIO())


def test_format_duration():
    assert format_duration(12) == "12s"
    assert format_duration(250) == "4m10s"
    assert format_duration(3720) == "1h02m"
    assert format_duration(float("inf")) == "?"


def test_values_measured_at_an_earlier_count_are_labelled_with_it(clock):
    """A line between logged steps, or the last of a run that stopped short, showed the last
    logged values as current; now they carry the count they were measured at, and a report
    closed short of its total has no ETA."""
    stream = io.StringIO()
    bar = Progress(40, "train", every_n=0, every_s=30.0, stream=stream)
    clock.now += 10
    bar.update(10)
    bar.set_postfix(loss=torch.tensor(2.3125), **{"samples/s": 812}, at=10)
    bar.mark()
    clock.now += 30
    bar.update(2)  # a time line at 12
    bar.update(1)
    bar.close()  # stopped at 13
    assert stream.getvalue().splitlines() == [
        "train 10/40 (25%) | loss 2.312 | 812 samples/s | 1 step/s | ETA 30s",
        "train 12/40 (30%) | step 10: loss 2.312, 812 samples/s | 0.3 step/s | ETA 1m33s",
        "train 13/40 (32%) | step 10: loss 2.312, 812 samples/s | 0.325 step/s"]


def test_a_bar_stopped_between_logged_steps_labels_its_values():
    stream = TerminalStream()
    bar = Progress(40, "train", stream=stream)
    bar.update(10)
    bar.set_postfix(loss="2.312", at=10)
    bar.update(3)
    bar.close()
    assert stream.getvalue().rstrip().endswith("step 10: loss 2.312]")
