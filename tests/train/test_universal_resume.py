"""Resuming a ZeRO 1-3 checkpoint with another world size, through DeepSpeed's universal checkpoint
(``<checkpoint>/universal``, converted once): the weights, the Adam moments, the optimizer groups'
settings and the lr schedule come back as saved; the data loader restarts the saved epoch, as at
ZeRO 0. Two ranks -> one for ZeRO 1, 2 and 3 (fp32 and bf16), one -> two for ZeRO 3."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.distributed import default_backend, run_distributed
from tests.train.helpers import latest_step

SHRINK = {  # written by 2 ranks, resumed by 1
    "zero2_fp32": {"deepspeed__zero_stage": 2},
    "zero1_bf16": {"deepspeed__zero_stage": 1, "train__precision": "bf16"},
    "zero3_bf16": {"deepspeed__zero_stage": 3, "train__precision": "bf16"},
}
GROW = {"zero3_fp32": {"deepspeed__zero_stage": 3}}  # written by 1 rank, resumed by 2
STEPS, STOP_AT = 4, 2


def _optimizer_view(engine) -> dict:
    """Every trainable parameter's fp32 master and Adam moments, whole (a collective: each rank
    contributes its partition), and the optimizer groups' settings and schedule position."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    optimizer, moments = engine.optimizer, {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        if hasattr(param, "ds_id"):  # ZeRO 3
            moments[name] = [safe_get_full_fp32_param(param).float().cpu().clone()] + [
                safe_get_full_optimizer_state(param, key).float().cpu().clone()
                for key in ("exp_avg", "exp_avg_sq")]
            continue
        # ZeRO 1-2 from the flat partitions themselves: DeepSpeed 0.19 links the optimizer state
        # of the first group only before a resume, so safe_get_full_optimizer_state fails there.
        mapping, whole = param._hp_mapping, []
        for key in (None, "exp_avg", "exp_avg_sq"):
            buffer = torch.zeros(param.numel())
            if mapping is not None:
                flat = optimizer.single_partition_of_fp32_groups[mapping.param_group_index]
                source = flat if key is None else optimizer.optimizer.state[flat][key]
                hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
                buffer.narrow(0, lp.start, lp.numel).copy_(source.narrow(0, hp.start, hp.numel))
            dist.all_reduce(buffer)
            whole.append(buffer.reshape(param.shape))
        moments[name] = whole
    groups = [{key: group[key] for key in ("lr", "weight_decay")}
              for group in optimizer.param_groups]
    return {"moments": moments, "groups": groups, "global_steps": engine.global_steps,
            "schedule": engine.lr_scheduler.last_epoch}


def _train(rank, out, cases, **extra):
    """Train each case with the checkpointer watched: what it saved and what it resumed (rank
    0's view, written to ``out/<case>/``) and the warnings it gave."""
    from vlcontrast.train import StopRequested, train
    from vlcontrast.train.checkpoint import Checkpointer, full_fp32_state_dict
    from tests.train.helpers import tiny_config

    save, resume = Checkpointer.save, Checkpointer.resume
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("vlcontrast.train.checkpoint").addHandler(handler)

    def watched_save(self, step):
        path = save(self, step)
        view = _optimizer_view(self.engine)
        if rank == 0:
            torch.save(view, path.parent.parent.parent / f"saved_{step}.pt")
        return path

    def watched_resume(self, path):
        resumed = resume(self, path)
        if path is None:  # a fresh start
            return resumed
        view = _optimizer_view(self.engine)
        view["weights"] = full_fp32_state_dict(self.engine)
        if rank == 0:
            torch.save(view, path.parent.parent.parent / "resumed.pt")
        return resumed

    Checkpointer.save, Checkpointer.resume = watched_save, watched_resume
    try:
        for name, case in cases.items():
            try:
                train(tiny_config(data_dir(out), out / name / "run", train__steps=STEPS,
                                  **extra, **case))
            except StopRequested:
                pass
    finally:
        Checkpointer.save, Checkpointer.resume = save, resume
    return warnings


def data_dir(out):
    return out / "data"


def _two_then_one(rank, world_size, out):
    if world_size == 2:
        _train(rank, out, SHRINK, train__stop_at_step=STOP_AT)
        return []
    warnings = _train(rank, out, SHRINK, train__resume="latest")
    _train(rank, out, GROW, train__stop_at_step=STOP_AT)  # the checkpoint for the other way
    return warnings


def _grow(rank, world_size, out):
    return _train(rank, out, GROW, train__resume="latest")


def _check_resumed(out, name, written_by, resumed_by, warnings):
    run = out / name / "run"
    checkpoint = run / "checkpoints" / f"step_{STOP_AT:08d}"
    saved = torch.load(out / name / f"saved_{STOP_AT}.pt", weights_only=True)
    resumed = torch.load(out / name / "resumed.pt", weights_only=True)
    weights = torch.load(checkpoint / "model.pt", weights_only=True)
    assert resumed["weights"].keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(resumed["weights"][key], value), f"{name}: weight {key}"
    assert saved["moments"].keys() == resumed["moments"].keys()
    for key, (master, exp_avg, exp_avg_sq) in saved["moments"].items():
        again = resumed["moments"][key]
        assert torch.equal(again[0], master), f"{name}: fp32 master of {key}"
        assert torch.equal(again[1], exp_avg), f"{name}: exp_avg of {key}"
        assert torch.equal(again[2], exp_avg_sq), f"{name}: exp_avg_sq of {key}"
    assert all(float(moments[2].abs().max()) > 0 for moments in saved["moments"].values())
    # The decayed group keeps its weight decay (DeepSpeed's ZeRO-3 universal load alone gives
    # every group the first group's), and the schedule goes on where it stopped.
    assert [g["weight_decay"] for g in saved["groups"]] == [0.0, 0.2]
    assert resumed["groups"] == saved["groups"], name
    assert resumed["schedule"] == saved["schedule"] == STOP_AT
    assert resumed["global_steps"] == saved["global_steps"] == STOP_AT
    assert latest_step(run) == STEPS
    state = torch.load(run / "checkpoints" / f"step_{STEPS:08d}" / "trainer_state.pt",
                       weights_only=True)
    assert state["train"]["step"] == STEPS and state["world_size"] == resumed_by
    assert (checkpoint / "universal" / "engine" / "zero").is_dir()
    assert not (checkpoint / "universal.tmp").exists()
    said = [w for w in warnings if str(checkpoint) in w]
    assert len(said) == 1, warnings
    assert (f"written by {written_by} rank(s), with {resumed_by} through a universal checkpoint "
            f"({checkpoint / 'universal'}" in said[0]), said[0]
    assert "the data loader restarts the saved epoch" in said[0]


@pytest.mark.slow
def test_zero_1_to_3_resume_with_another_world_size_through_a_universal_checkpoint(
        synthetic_data, tmp_path):
    """It used to be refused before the model was built (DeepSpeed cannot split ZeRO optimizer
    state anew), and DeepSpeed's own universal load alone gives the ZeRO-3 groups one weight
    decay."""
    data_dir(tmp_path).symlink_to(synthetic_data)
    backend = default_backend()
    run_distributed(_two_then_one, 2, tmp_path, timeout=400, backend=backend)
    shrunk = run_distributed(_two_then_one, 1, tmp_path, timeout=400, backend=backend)[0]
    grown = run_distributed(_grow, 2, tmp_path, timeout=400, backend=backend)
    for name in SHRINK:
        _check_resumed(tmp_path, name, 2, 1, shrunk)
    for name in GROW:
        _check_resumed(tmp_path, name, 1, 2, grown[0])
    assert not any("universal" in w for w in grown[1])  # said once, by rank 0


# --------------------------------------------------------------------------------------------
# the conversion: once, atomic, a failure in one line


def _zero_checkpoint(tmp_path):
    folder = tmp_path / "step_00000002"
    (folder / "engine").mkdir(parents=True)
    (folder / "engine" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 10)
    return folder


def _fake_converter(monkeypatch, calls, fail=None):
    import vlcontrast.train.checkpoint as checkpoint

    def convert(source, target):
        calls.append((source, target))
        if fail is not None:
            raise fail
        (target / "zero").mkdir(parents=True)
        (target / "zero" / "optimizer_state.pt").write_bytes(b"converted")

    monkeypatch.setattr(checkpoint, "convert_to_universal", convert)


def test_the_universal_checkpoint_is_converted_once_and_then_reused(tmp_path, monkeypatch):
    from vlcontrast.train.checkpoint import universal_checkpoint

    folder, calls = _zero_checkpoint(tmp_path), []
    _fake_converter(monkeypatch, calls)
    first = universal_checkpoint(folder, 2)
    assert first == folder / "universal" and len(calls) == 1
    assert calls[0] == (folder / "engine", folder / "universal.tmp" / "engine")
    assert (first / "engine" / "zero" / "optimizer_state.pt").read_bytes() == b"converted"
    assert not (folder / "universal.tmp").exists()
    assert universal_checkpoint(folder, 2) == first and len(calls) == 1


def test_an_interrupted_conversion_is_converted_anew_never_used(tmp_path, monkeypatch):
    """A conversion killed midway leaves ``universal.tmp``: never loaded, even when it looks
    complete; the next resume converts again."""
    from vlcontrast.train.checkpoint import universal_checkpoint

    folder, calls = _zero_checkpoint(tmp_path), []
    stale = folder / "universal.tmp" / "engine" / "zero"
    stale.mkdir(parents=True)
    (stale / "optimizer_state.pt").write_bytes(b"half written")
    (stale / "leftover").mkdir()
    _fake_converter(monkeypatch, calls)
    universal = universal_checkpoint(folder, 2)
    assert len(calls) == 1
    assert (universal / "engine" / "zero" / "optimizer_state.pt").read_bytes() == b"converted"
    assert not (universal / "engine" / "zero" / "leftover").exists()
    assert not (folder / "universal.tmp").exists()


def test_a_failed_conversion_is_one_line_naming_the_fix_and_leaves_nothing(tmp_path, monkeypatch):
    from vlcontrast.errors import CheckpointError
    from vlcontrast.train.checkpoint import universal_checkpoint

    folder, calls = _zero_checkpoint(tmp_path), []
    _fake_converter(monkeypatch, calls, fail=AssertionError("Steps [3, 4] are not equal\nmore"))
    with pytest.raises(CheckpointError, match=r"step_00000002: its ZeRO state could not be "
                                              r"converted into a universal checkpoint for another "
                                              r"world size \(AssertionError: Steps \[3, 4\] are "
                                              r"not equal\); resume with 2 ranks \(vlcontrast "
                                              r"train --nproc 2\), or start a new run from its "
                                              r"weights \(model.pretrained=.*step_00000002\)$"):
        universal_checkpoint(folder, 2)
    assert not (folder / "universal").exists() and not (folder / "universal.tmp").exists()


@pytest.mark.parametrize("stage, written_by, world_size, universal", [
    (0, 2, 1, False),  # ZeRO 0: the engine state is whole; resumed as it is
    (1, 2, 1, True), (2, 2, 1, True), (3, 1, 2, True),
    (2, 2, 2, False),  # the same world size: each rank its own partition
    (2, 0, 1, False),  # no rank files to tell
])
def test_which_resumes_go_through_a_universal_checkpoint(tmp_path, stage, written_by, world_size,
                                                         universal):
    import yaml

    from vlcontrast.checkpoints import universal_resume

    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"deepspeed": {"zero_stage": stage}}))
    for rank in range(written_by):
        (tmp_path / f"rank_{rank:05d}.pt").write_bytes(b"")
    assert universal_resume(tmp_path, world_size) is universal
    assert universal_resume(None, world_size) is False


def test_the_engine_is_configured_to_load_universal_checkpoints_only_when_asked():
    from vlcontrast.config import load_config
    from vlcontrast.train.engine import deepspeed_config

    config = load_config(None, ["data.train=x", "train.steps=4", "deepspeed.zero_stage=2"])

    def ds(**kwargs):
        return deepspeed_config(config.train, config.deepspeed, micro_batch_size=2, grad_clip=1.0,
                                world_size=1, accelerator="cpu", **kwargs)

    assert "checkpoint" not in ds()
    assert ds(load_universal=True)["checkpoint"] == {"load_universal": True}


def test_an_engine_not_built_for_it_is_refused_before_deepspeed_reads(tmp_path):
    """A caller of the checkpointer (a notebook) with an engine built without load_universal
    would stop in DeepSpeed's ZeRORuntimeException."""
    import yaml

    from vlcontrast.errors import CheckpointError
    from vlcontrast.train.checkpoint import WORLD_KEY, Checkpointer

    class Engine:
        def load_checkpoint(self, *args, **kwargs):
            raise AssertionError("DeepSpeed's load reached")

    folder = tmp_path / "run" / "checkpoints" / "step_00000002"
    folder.mkdir(parents=True)
    torch.save({"train": {"step": 2}, WORLD_KEY: 2}, folder / "trainer_state.pt")
    for rank in range(2):
        torch.save({}, folder / f"rank_{rank:05d}.pt")
    (folder / "config.yaml").write_text(yaml.safe_dump({"deepspeed": {"zero_stage": 2}}))
    checkpointer = Checkpointer(tmp_path / "run", Engine(), every=0, keep=2, run_states={},
                                rank_states={}, model_config={}, config_yaml="")
    with pytest.raises(CheckpointError, match=r"step_00000002: written by 2 ranks under ZeRO 1-3 "
                                              r"and resumed by 1, which needs an engine built "
                                              r"with load_universal=True"):
        checkpointer.resume(folder)
