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


class _Metrics:
    def __init__(self):
        self.records = []

    def log(self, step, values, kind="train"):
        self.records.append((step, kind, values))

    def close(self):
        pass


class _Engine:
    def get_lr(self):
        return [1e-3]

    def get_global_grad_norm(self):
        return None

    module = torch.nn.Module()


def test_mfu_is_logged_beside_samples_per_s_on_cuda_only(monkeypatch):
    from types import SimpleNamespace

    from vlcontrast.train.steplog import StepLogger

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    state = SimpleNamespace(samples_seen=64)
    data = SimpleNamespace(epoch=0, bad_samples={})
    result = {"loss": torch.tensor(1.0)}
    records = {}
    for kind in ("cuda", "cpu"):
        metrics = _Metrics()
        log = StepLogger(metrics, every=1, total_steps=10, device=torch.device(kind),
                         flops_per_sample=1e9, peak_flops=1e12)
        log._window_start = time.perf_counter() - 1.0  # a 1 s window of 64 samples
        log.count(64)
        log.record(1, state=state, engine=_Engine(), result=result, data=data, counts={})
        records[kind] = metrics.records[-1][2]
    cuda = records["cuda"]
    # 64 samples/s x 1 GFLOP / 1 TFLOP/s = 6.4%, a little less for the window's extra time.
    assert cuda["mfu"] == pytest.approx(cuda["samples_per_s"] * 1e9 / 1e12)
    assert 0.05 < cuda["mfu"] <= 0.064
    assert "mfu" not in records["cpu"]


@pytest.mark.parametrize("override, peak", [(0.0, 989e12), (500.0, 500e12)])
def test_the_loop_gives_the_logger_the_models_flops_and_the_gpus_peak(tmp_path, monkeypatch,
                                                                      override, peak):
    """On a CUDA device (mocked: only its name is asked) the loop's step logger gets the model's
    training FLOPs per pair and the peak of the GPU named, or ``train.peak_tflops``."""
    from types import SimpleNamespace

    from tests.train.helpers import tiny_config
    from vlcontrast.models import resolve_model_config
    from vlcontrast.models.flops import train_flops_per_sample
    from vlcontrast.train.loop import _step_logger
    from vlcontrast.train.precision import Precision

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    config = tiny_config(tmp_path, tmp_path / "run", train__peak_tflops=override)
    (tmp_path / "run").mkdir()
    env = SimpleNamespace(device=torch.device("cuda", 0), rank=0, world_size=1)
    _, model_cfg = resolve_model_config("vlc-micro")
    log = _step_logger(config, env, 10, Precision("fp32"), resumed_at=0,
                       model_config={"model_name": "vlc-micro", "model_cfg": model_cfg})
    try:
        assert log.flops_per_sample == pytest.approx(train_flops_per_sample(model_cfg))
        assert log.peak_flops == peak
    finally:
        log.close()
