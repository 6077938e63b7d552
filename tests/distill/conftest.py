"""The training tests of distillation run DeepSpeed on the CPU (as tests/train); the synthetic
shards and the teacher's weights they share."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("VLC_TEST_BACKEND", "gloo") != "nccl":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """96 synthetic training samples in 2 shards (32 px)."""
    from tests.conftest import synthetic_world

    return synthetic_world(tmp_path_factory, "distill-data", train=96, val=16,
                           zeroshot_per_class=1, shard_size=48)


@pytest.fixture(scope="session")
def teacher_file(tmp_path_factory):
    """A seeded vlc-tiny's weights: the teacher (``distill.teacher=vlc-tiny``)."""
    from vlcontrast.config import ModelConfig
    from vlcontrast.models import build_model

    torch.manual_seed(7)
    model = build_model(ModelConfig(name="vlc-tiny")).model
    path = tmp_path_factory.mktemp("teacher") / "teacher.pt"
    torch.save(model.state_dict(), path)
    return path
