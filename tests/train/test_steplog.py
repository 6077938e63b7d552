"""The step-time split: CUDA events on a GPU, read (and synchronised) once per logged window,
never per step; ``perf_counter`` on CPU. ``torch.cuda.Event`` is replaced by a fake that records
what the timer asks of it."""

from __future__ import annotations

import time

import pytest
import torch

from vlcontrast.train.steplog import PHASES, StepTimer


class FakeEvent:
    clock = 0.0
    synchronized = 0
    recorded = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self, stream=None):
        FakeEvent.recorded += 1
        FakeEvent.clock += 2.0  # every phase "takes" 2 ms on the device
        self.at = FakeEvent.clock

    def synchronize(self):
        FakeEvent.synchronized += 1

    def elapsed_time(self, end):  # milliseconds, like CUDA's
        return end.at - self.at


def _attempt(timer):
    timer.start()
    for phase in PHASES:
        timer.mark(phase)


def test_gpu_split_comes_from_events_read_once_per_window(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(FakeEvent, "synchronized", 0)
    monkeypatch.setattr(FakeEvent, "recorded", 0)
    timer = StepTimer(torch.device("cuda", 0))
    for _ in range(3):
        _attempt(timer)
    assert FakeEvent.synchronized == 0  # nothing waits for the device during the steps
    assert FakeEvent.recorded == 3 * (1 + len(PHASES))
    totals = timer.read()
    assert FakeEvent.synchronized == 1
    assert totals == {phase: pytest.approx(3 * 0.002) for phase in PHASES}
    assert timer.read() == dict.fromkeys(PHASES, 0.0)  # a new window starts empty


def test_cpu_split_uses_the_host_clock():
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    time.sleep(0.02)
    timer.mark("data")
    timer.mark("forward")
    totals = timer.read()
    assert totals["data"] >= 0.02 and totals["forward"] < 0.02
    assert set(totals) == set(PHASES)
