"""Exact resume: a run stopped at step N and resumed to 2N ends with the weights of an
uninterrupted 2N-step run (2 processes, ZeRO 0, 2 and 3). The backend is the test helper's
(``VLC_TEST_BACKEND``: gloo on CPU, nccl on a machine with 2 GPUs)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.distributed import default_backend, run_distributed
from tests.train.helpers import checkpoint_weights, latest_step, max_difference

CASES = {
    "zero0_infonce": {"deepspeed__zero_stage": 0},
    # DeCL's buffer, GradCache accumulation and an epoch boundary after the resume point
    # (256 samples / (16 x 2 ranks x 2 micro-batches) = 4 steps per epoch).
    "zero2_decl_accum2": {"deepspeed__zero_stage": 2, "loss__name": "decl",
                          "train__accum_steps": 2, "data__batch_size": 16},
    "zero3_siglip_accum2": {"deepspeed__zero_stage": 3, "loss__name": "siglip",
                            "train__accum_steps": 2},
}
STEPS, STOP_AT = 6, 3


def _train_full_and_split(rank, world_size, data_dir, out_root, cases):
    from vlcontrast.train import StopRequested, train
    from tests.train.helpers import tiny_config

    stopped = {}
    for name, extra in cases.items():
        full, split = out_root / name / "full", out_root / name / "split"
        train(tiny_config(data_dir, full, train__steps=STEPS, checkpoint__every=STOP_AT, **extra))
        try:
            train(tiny_config(data_dir, split, train__steps=STEPS, train__stop_at_step=STOP_AT,
                              **extra))
            stopped[name] = None
        except StopRequested as stop:
            stopped[name] = str(stop)
        train(tiny_config(data_dir, split, train__steps=STEPS, train__resume="latest", **extra))
    return stopped


@pytest.mark.slow
def test_resume_at_step_n_ends_like_an_uninterrupted_run(synthetic_data, tmp_path):
    stopped = run_distributed(_train_full_and_split, 2, synthetic_data, tmp_path, CASES,
                              timeout=400, backend=default_backend())
    for name in CASES:
        for rank_result in stopped:
            assert rank_result[name] and f"at step {STOP_AT}" in rank_result[name]
        full, split = tmp_path / name / "full", tmp_path / name / "split"
        assert latest_step(full) == STEPS and latest_step(split) == STEPS
        full_weights, split_weights = checkpoint_weights(full), checkpoint_weights(split)
        midway = torch.load(full / "checkpoints" / f"step_{STOP_AT:08d}" / "model.pt",
                            weights_only=True)
        assert max_difference(full_weights, midway) > 1e-4, f"{name}: training did not move"
        assert max_difference(full_weights, split_weights) <= 1e-6, name
        if "decl" in name:
            full_state = torch.load(full / "checkpoints" / f"step_{STEPS:08d}" / "trainer_state.pt",
                                    weights_only=True)
            split_state = torch.load(split / "checkpoints" / f"step_{STEPS:08d}" / "trainer_state.pt",
                                     weights_only=True)
            assert full_state["train"]["epoch"] == split_state["train"]["epoch"] == 1
            assert torch.equal(full_state["loss"]["log_u"], split_state["loss"]["log_u"])
            assert int(full_state["loss"]["visited"]) > 0


def _written_checkpoint(run, model="vlc-micro", loss="decl", zero_stage=0, precision="fp32"):
    """A run directory whose latest checkpoint's config.yaml names ``model``, ``loss``, the ZeRO
    stage and the precision."""
    import yaml

    from vlcontrast.checkpoints import COMPLETE_MARKER, LATEST

    folder = run / "checkpoints" / "step_00000002"
    folder.mkdir(parents=True)
    (folder / COMPLETE_MARKER).write_bytes(b"")
    (folder / "config.yaml").write_text(yaml.safe_dump({
        "model": {"name": model}, "loss": {"name": loss, "gamma": 0.9},
        "deepspeed": {"zero_stage": zero_stage}, "train": {"precision": precision}}))
    (run / "checkpoints" / LATEST).write_text("step_00000002")
    return folder


@pytest.mark.parametrize("key, now, fix", [
    ("loss.name", "infonce", "resume with loss.name=decl \\(its .*config.yaml\\), or start a new run "
                             "from its weights with model.pretrained=.*step_00000002"),
    ("model.name", "vlc-rn-micro", "resume with model.name=vlc-micro \\(its .*config.yaml\\)$"),
])
def test_resuming_with_another_model_or_loss_is_one_line_before_the_model_is_built(
        synthetic_data, tmp_path, key, now, fix):
    """It used to surface as the loss's load_state_dict traceback, or as an optimizer layout
    message that never named model.name, after the model and engine were built."""
    from vlcontrast.config import ConfigError, load_config
    from vlcontrast.train.loop import preflight

    run = tmp_path / "run"
    _written_checkpoint(run)
    base = ["train.steps=4", f"data.train={synthetic_data}/train", f"output_dir={run}",
            "train.resume=latest", "model.name=vlc-micro", "loss.name=decl"]
    preflight(load_config(None, base))  # the same model and loss: resumable
    with pytest.raises(ConfigError, match=f"^train.resume='latest': .*step_00000002 was written "
                                          f"with {key}='[^']+', this run has {key}='{now}'; {fix}"):
        preflight(load_config(None, base + [f"{key}={now}"]))


@pytest.mark.parametrize("written, now, refused", [
    ((0, "fp32"), (2, "fp32"), "deepspeed.zero_stage=0 \\(ZeRO 0, fp32 parameters\\), this run has "
                               "deepspeed.zero_stage=2 \\(ZeRO 1-2, fp32 parameters\\)"),
    ((2, "fp32"), (3, "fp32"), "resume with deepspeed.zero_stage=2 \\(stages 1 and 2"),
    ((2, "bf16"), (2, "fp32"), "train.precision=bf16 \\(ZeRO 1-2, bf16 parameters\\)"),
    ((2, "fp32"), (3, "bf16"), "resume with deepspeed.zero_stage=2 train.precision=fp32 "),
    ((2, "fp32"), (1, "fp32"), None),  # stages 1 and 2 write one format (resumed in a real run)
    ((0, "fp32"), (0, "amp_bf16"), None),  # fp32 parameters both
])
def test_resuming_in_another_zero_or_parameter_format_is_one_line_before_the_model_is_built(
        synthetic_data, tmp_path, written, now, refused):
    """ZeRO 2 -> 3 used to stop inside DeepSpeed with a bare AssertionError, 0 -> 2 and fp32 ->
    bf16 as a parameter-order mismatch or a missing bf16_* file."""
    from vlcontrast.config import ConfigError, load_config
    from vlcontrast.train.loop import preflight

    run = tmp_path / "run"
    folder = _written_checkpoint(run, zero_stage=written[0], precision=written[1])
    config = load_config(None, [
        "train.steps=4", f"data.train={synthetic_data}/train", f"output_dir={run}",
        "train.resume=latest", "model.name=vlc-micro", "loss.name=decl",
        f"deepspeed.zero_stage={now[0]}", f"train.precision={now[1]}"])
    if refused is None:
        assert preflight(config) == folder
        return
    with pytest.raises(ConfigError, match="^train.resume='latest': .*step_00000002 was written "
                                          "with .*DeepSpeed lays out their optimizer states "
                                          "differently; .*model.pretrained=") as refusal:
        preflight(config)
    assert re.search(refused, str(refusal.value)), str(refusal.value)


def test_a_state_that_does_not_fit_is_a_checkpoint_error_naming_its_entry(tmp_path):
    from vlcontrast.errors import CheckpointError
    from vlcontrast.losses import build_loss
    from vlcontrast.train.checkpoint import _load_states

    saved = {"loss": build_loss("decl", id_space=4).state_dict()}
    with pytest.raises(CheckpointError, match=r"its 'loss' state does not fit this run's "
                                              r"\(InfoNCELoss: .*Unexpected key"):
        _load_states({"loss": build_loss("infonce")}, saved, tmp_path / "trainer_state.pt")


def test_another_world_size_passes_the_check_at_every_zero_stage(synthetic_data, tmp_path):
    """ZeRO 1-3 with another world size used to be refused here; it resumes through a universal
    checkpoint now (tests/train/test_universal_resume.py), ZeRO 0 as it is."""
    from vlcontrast.config import load_config
    from vlcontrast.train.loop import preflight

    for stage in (0, 1, 2, 3):
        run = tmp_path / f"zero{stage}"
        folder = _written_checkpoint(run, zero_stage=stage)
        for rank in range(2):
            (folder / f"rank_{rank:05d}.pt").write_bytes(b"")
        config = load_config(None, [
            "train.steps=4", f"data.train={synthetic_data}/train", f"output_dir={run}",
            "train.resume=latest", "model.name=vlc-micro", "loss.name=decl",
            f"deepspeed.zero_stage={stage}"])
        assert preflight(config) == folder  # one rank, written by two
