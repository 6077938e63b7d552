"""``recipe=fast_clip`` in the trainer: the loss follows the data epoch, and a run stopped and
resumed across an epoch boundary ends exactly like an uninterrupted one (2 processes)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.distributed import default_backend, run_distributed
from tests.train.helpers import checkpoint_weights, latest_step, max_difference

if default_backend() != "nccl":  # under nccl DeepSpeed uses the GPUs
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

# 256 samples / (16 per rank x 2 ranks x 2 micro-batches) = 4 steps per epoch: step 5 is the
# first of epoch 1, after the resume point.
OPTIONS = {"loss__name": "fastclip", "loss__recipe": "fast_clip", "loss__gamma": 0.4,
           "loss__temperature": "individual", "loss__tau_lr": 0.05, "loss__rho": 7.0,
           "train__accum_steps": 2, "data__batch_size": 16, "deepspeed__zero_stage": 1}
STEPS, STOP_AT = 6, 3


def _train_full_and_split(rank, world_size, data_dir, out_root):
    from tests.train.helpers import tiny_config
    from vlcontrast.train import StopRequested, train

    full, split = out_root / "full", out_root / "split"
    train(tiny_config(data_dir, full, train__steps=STEPS, checkpoint__every=STOP_AT, **OPTIONS))
    try:
        train(tiny_config(data_dir, split, train__steps=STEPS, train__stop_at_step=STOP_AT,
                          **OPTIONS))
        stopped = None
    except StopRequested as stop:
        stopped = str(stop)
    train(tiny_config(data_dir, split, train__steps=STEPS, train__resume="latest", **OPTIONS))
    return stopped


@pytest.mark.slow
def test_fast_clip_recipe_follows_the_epoch_and_resumes_exactly(synthetic_data, tmp_path):
    stopped = run_distributed(_train_full_and_split, 2, synthetic_data, tmp_path, timeout=400,
                              backend=default_backend())
    assert all(message and f"at step {STOP_AT}" in message for message in stopped)
    full, split = tmp_path / "full", tmp_path / "split"
    assert latest_step(full) == STEPS and latest_step(split) == STEPS
    records = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "gamma" in r]
    assert [r["epoch"] for r in train_records] == [0, 0, 0, 0, 1, 1]
    # fast_clip's staircase: gamma = 1 for the whole first epoch, then the option's value.
    assert [r["gamma"] for r in train_records] == pytest.approx([1.0] * 4 + [0.4] * 2)
    assert max_difference(checkpoint_weights(full), checkpoint_weights(split)) <= 1e-6
    states = [torch.load(run / "checkpoints" / f"step_{STEPS:08d}" / "trainer_state.pt",
                         weights_only=True) for run in (full, split)]
    assert torch.equal(states[0]["loss"]["log_u"], states[1]["loss"]["log_u"])
    temperatures = states[0]["loss"]["log_u"][:, 2:4]
    visited = torch.isfinite(temperatures)
    assert visited.any() and temperatures[visited].std() > 0  # the temperatures trained
