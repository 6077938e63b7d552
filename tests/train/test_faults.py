"""Faults: non-finite steps skipped alike on every rank and a clear stop after too many; a signal
finishes the step, checkpoints and stops; checkpoint write failures leave the previous checkpoint
intact; an unwritable output directory fails at start. The dead-rank test is in test_launch.py
(it needs real processes)."""

from __future__ import annotations

import errno
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.train.helpers import latest_step, read_metrics, tiny_config


def test_unwritable_output_dir_is_a_clear_error_at_start(synthetic_data, tmp_path):
    from vlcontrast.config import ConfigError
    from vlcontrast.train.loop import preflight

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="output_dir=.*a_file/run.*cannot write there .*"
                                          "a file stands where a folder should be"):
        preflight(tiny_config(synthetic_data, blocker / "run"))



@pytest.mark.parametrize("under", ["a_file", "read_only"])
def test_train_into_an_unwritable_output_dir_is_one_line_from_the_cli(
        synthetic_data, tmp_path, capsys, monkeypatch, under):
    """The command's own first write (clearing an old preemption marker) used to raise before
    the preflight could say what is wrong."""
    import errno

    from vlcontrast import cli, requeue
    from tests.train.helpers import tiny_overrides

    monkeypatch.delenv("VLCONTRAST_DEBUG", raising=False)
    if under == "a_file":
        blocker = tmp_path / "a_file"
        blocker.write_text("not a directory")
        output_dir, reason = blocker / "run", "a file stands where a folder should be"
    else:
        output_dir, reason = tmp_path / "ro", "the file system is read-only"
        output_dir.mkdir()
        # an old preemption marker that the refused run must neither clear nor trip over
        (output_dir / requeue.PREEMPTED_MARKER).write_text("{}")
        real_unlink = Path.unlink

        def unlink(self, missing_ok=False):
            if self.parent == output_dir:
                raise OSError(errno.EROFS, "Read-only file system", str(self))
            return real_unlink(self, missing_ok=missing_ok)

        real_mkdir = Path.mkdir

        def mkdir(self, *args, **kwargs):
            if self == output_dir or output_dir in self.parents:
                if self == output_dir and kwargs.get("exist_ok"):
                    return None
                raise OSError(errno.EROFS, "Read-only file system", str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "unlink", unlink)
        monkeypatch.setattr(Path, "mkdir", mkdir)
    code = cli.main(["train", *tiny_overrides(synthetic_data, output_dir)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "output_dir=" in lines[0] and "cannot write there" in lines[0] and reason in lines[0]
    if under == "read_only":
        assert (output_dir / requeue.PREEMPTED_MARKER).read_text() == "{}"


# --------------------------------------------------------------------------------------------
# Injection: the loss of this rank returns NaN, or NaN gradients, on chosen attempts.


class _NaNGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def _inject(plan):
    """Make ``build_loss`` return losses that fail as ``plan(attempt)`` says on this rank:
    ``"loss"`` (NaN loss), ``"gradients"`` (finite loss, NaN gradients) or None."""
    import vlcontrast.losses as losses
    import vlcontrast.train.loop as loop

    real_build = getattr(losses, "_uninjected_build_loss", losses.build_loss)
    losses._uninjected_build_loss = real_build

    def build(name, **kwargs):
        loss_fn = real_build(name, **kwargs)
        forward, calls = loss_fn.forward, [0]

        def injected(image, text, *args, **kw):
            calls[0] += 1
            fault = plan(calls[0])
            if fault == "gradients":
                image = _NaNGradient.apply(image)
            out = forward(image, text, *args, **kw)
            if fault == "loss":
                out["loss"] = out["loss"] * float("nan")
            return out

        loss_fn.forward = injected
        return loss_fn

    losses.build_loss = loop.build_loss = build  # the loop's own reference too


def _skip_then_diverge(rank, world_size, data_dir, out_root, cases):
    from vlcontrast.train import TrainingDiverged, train

    messages = {}
    for name, extra in cases.items():
        # Attempt 3: NaN loss on rank 1; attempt 5: NaN gradients on rank 0. Both are skipped.
        _inject(lambda attempt: {(3, 1): "loss", (5, 0): "gradients"}.get((attempt, rank)))
        train(tiny_config(data_dir, out_root / name / "skips", train__steps=6,
                          optim__warmup_steps=10, train__max_bad_steps=2, **extra))
        # From attempt 3 on, rank 1's gradients are always NaN: stop after 3 in a row.
        _inject(lambda attempt: "gradients" if attempt >= 3 and rank == 1 else None)
        try:
            train(tiny_config(data_dir, out_root / name / "diverges", train__steps=6,
                              checkpoint__every=2, train__max_bad_steps=3, **extra))
            messages[name] = None
        except TrainingDiverged as err:
            messages[name] = str(err)
    return messages


FAULT_CASES = {"zero0_gradcache": {"deepspeed__zero_stage": 0, "train__accum_steps": 2},
               "zero3": {"deepspeed__zero_stage": 3}}


@pytest.mark.slow
def test_non_finite_steps_are_skipped_on_every_rank_then_stop_with_a_clear_error(
        synthetic_data, tmp_path):
    from vlcontrast.train.optimizer import cosine_with_warmup

    messages = run_distributed(_skip_then_diverge, 2, synthetic_data, tmp_path, FAULT_CASES,
                               timeout=400)
    for name in FAULT_CASES:
        run = tmp_path / name / "skips"
        skips = read_metrics(run, "skip")
        assert [(r["step"], r["skipped"]) for r in skips] == [(3, "loss"), (4, "gradients")], name
        train_records = read_metrics(run, "train")
        assert [r["step"] for r in train_records] == [1, 2, 3, 4, 5, 6]
        last = train_records[-1]
        assert last["skipped_steps"] == 2
        # Skipped steps did not advance the schedule: step 6, the 6th applied, trained at its
        # value after 5.
        assert last["lr"] == pytest.approx(5e-4 * cosine_with_warmup(10, 6)(5))
        weights = torch.load(run / "checkpoints" / "step_00000006" / "model.pt", weights_only=True)
        assert all(torch.isfinite(w).all() for w in weights.values())

        # Both ranks stopped, at the same attempt, naming the step and the last good checkpoint.
        for by_rank in messages:
            message = by_rank[name]
            assert message and "3 consecutive steps (last at step 3" in message, message
            assert "step_00000002" in message, message
        assert latest_step(tmp_path / name / "diverges") == 2


def _signal_then_resume(rank, world_size, data_dir, out_dir):
    from vlcontrast.train import StopRequested, train

    # Rank 0 receives SIGTERM during step 2 (as from a scheduler); rank 1 receives nothing.
    _inject(lambda attempt: os.kill(os.getpid(), signal.SIGTERM)
            if attempt == 2 and rank == 0 else None)
    try:
        train(tiny_config(data_dir, out_dir, train__steps=4))
        stopped = None
    except StopRequested as stop:
        stopped = str(stop)
    _inject(lambda attempt: None)
    results = train(tiny_config(data_dir, out_dir, train__steps=4, train__resume="latest"))
    return stopped, results["step"]


@pytest.mark.slow
def test_sigterm_finishes_the_step_checkpoints_and_stops_every_rank(synthetic_data, tmp_path):
    outcomes = run_distributed(_signal_then_resume, 2, synthetic_data, tmp_path, timeout=300)
    (stopped_0, final_0), (stopped_1, final_1) = outcomes
    assert f"stopped by signal {int(signal.SIGTERM)} at step 2" in stopped_0
    assert "stopped by a signal to another rank at step 2" in stopped_1
    assert final_0 == final_1 == 4
    events = read_metrics(tmp_path, "event")
    assert events[0]["stopped"] == f"signal {int(signal.SIGTERM)}" and events[0]["step"] == 2
    assert events[1]["resumed_from"].endswith("step_00000002")
    assert [r["step"] for r in read_metrics(tmp_path, "train")] == [1, 2, 3, 4]


# --------------------------------------------------------------------------------------------
# Checkpoint write failures.


def _failing_checkpoints(rank, world_size, data_dir, out_root):
    from vlcontrast.config import ConfigError
    from vlcontrast import checkpoints as ckpt
    from vlcontrast.train import train
    from vlcontrast.train.checkpoint import CheckpointError

    outcome = {}
    real_free_bytes, real_save = ckpt.free_bytes, ckpt.save_file
    # A disk that is already full: refused at start.
    ckpt.free_bytes = lambda path: 0
    try:
        train(tiny_config(data_dir, out_root / "full_disk"))
    except ConfigError as err:
        outcome["start"] = str(err)
    ckpt.free_bytes = real_free_bytes

    # The disk fills up while rank 0 writes the checkpoint of step 4.
    def save_file(obj, path):
        if rank == 0 and path.parent.name == "step_00000004.tmp" and path.name == "trainer_state.pt":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_save(obj, path)

    ckpt.save_file = save_file
    try:
        train(tiny_config(data_dir, out_root / "fills_up", train__steps=6, checkpoint__every=2))
    except CheckpointError as err:
        outcome["midway"] = str(err)
    ckpt.save_file = real_save
    # The previous checkpoint is intact: resume from it.
    outcome["resumed"] = train(tiny_config(data_dir, out_root / "fills_up", train__steps=6,
                                           train__resume="latest"))["step"]
    return outcome


@pytest.mark.slow
def test_checkpoint_write_failures_are_clear_and_keep_the_previous_checkpoint(
        synthetic_data, tmp_path):
    outcomes = run_distributed(_failing_checkpoints, 2, synthetic_data, tmp_path, timeout=300)
    for rank, outcome in enumerate(outcomes):
        assert "has 0.00 GB free, one checkpoint needs about" in outcome["start"]
        assert "checkpoint at step 4 could not be written" in outcome["midway"]
        assert "No space left on device" in outcome["midway"]
        assert "step_00000002) is intact" in outcome["midway"]
        assert ("reported by rank 0" in outcome["midway"]) == (rank == 1)
        assert outcome["resumed"] == 6
    events = read_metrics(tmp_path / "fills_up", "event")
    assert events[-1]["resumed_from"].endswith("step_00000002")
    assert not list((tmp_path / "fills_up" / "checkpoints").glob("*.tmp"))
