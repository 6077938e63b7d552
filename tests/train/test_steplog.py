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



def _applied(log, step, global_batch, **record):
    """What the training loop does after an applied step: count it, record it at log steps."""
    log.count(global_batch, step)
    if log.should_log(step):
        log.record(step, **record)

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


def test_progress_lines_in_a_log_fall_on_the_logged_steps_with_their_loss(monkeypatch, capsys):
    """Outside a terminal: a line at every logged step (13, 26, 39 and the last, 40) with its
    loss, and between them one every 30 s; a time line does not shift the logged ones (they used
    to come every 13 updates after the last line of any kind: 10, 20 ...)."""
    from types import SimpleNamespace

    from vlcontrast import progress as progress_module
    from vlcontrast.train.steplog import StepLogger

    now = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    state, data = SimpleNamespace(samples_seen=64), SimpleNamespace(epoch=0, bad_samples={})
    log = StepLogger(_Metrics(), every=13, total_steps=40, device=torch.device("cpu"),
                     progress=True)
    for step in range(1, 41):
        now[0] += 31.0 if step == 5 else 1.0  # a slow step 5: a time line
        log.attempt()
        _applied(log, step, 64, state=state, engine=_Engine(),
                    result={"loss": torch.tensor(2.0 - step / 100)}, data=data, counts={})
    log.progress.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train ")]
    counts = [int(line.split()[1].split("/")[0]) for line in lines]
    assert counts == [5, 13, 26, 39, 40], lines
    assert "loss 1.870" in lines[1] and "loss 1.610" in lines[3] and "loss 1.600" in lines[4]


def test_the_progress_line_shows_fastclips_objective_beside_its_surrogate_loss(capsys):
    from types import SimpleNamespace

    from vlcontrast.train.steplog import StepLogger

    log = StepLogger(_Metrics(), every=1, total_steps=2, device=torch.device("cpu"), progress=True)
    log.attempt()
    _applied(log, 1, 8, state=SimpleNamespace(samples_seen=8), engine=_Engine(),
                result={"loss": torch.tensor(1.0), "objective": torch.tensor(2.3456)},
                data=SimpleNamespace(epoch=0, bad_samples={}), counts={})
    log.close()
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train 1/2")][0]
    assert "loss 1.000 | objective 2.346 |" in line


def test_the_last_line_of_a_run_stopped_between_logged_steps_dates_its_loss(monkeypatch, capsys):
    """A run stopped at step 7 (a signal, train.stop_at_step) after its record at step 5 printed
    ``train 7/40 (18%) | loss 1.950 | 64 samples/s | ... | ETA 33s``: step 5's loss and rate as
    if they were step 7's, and the time to a total it will not reach."""
    from types import SimpleNamespace

    from vlcontrast import progress as progress_module
    from vlcontrast.train.steplog import StepLogger

    now = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    state, data = SimpleNamespace(samples_seen=64), SimpleNamespace(epoch=0, bad_samples={})
    log = StepLogger(_Metrics(), every=5, total_steps=40, device=torch.device("cpu"),
                     progress=True)
    for step in range(1, 8):
        now[0] += 1.0
        log.attempt()
        _applied(log, step, 64, state=state, engine=_Engine(),
                    result={"loss": torch.tensor(2.0 - step / 100)}, data=data, counts={})
    log.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train ")]
    assert lines == ["train 5/40 (12%) | loss 1.950 | 64 samples/s | 1 step/s | ETA 35s",
                     "train 7/40 (18%) | step 5: loss 1.950, 64 samples/s | 1 step/s"]
