"""Fixtures for the training tests: one tiny synthetic dataset per session.

The dataset is the package's synthetic world at 32x32 pixels: 256 training pairs in 4 shards of 64
(enough shards for 2 ranks x 1 reader in epoch mode), 32 validation pairs, a 2-per-class zero-shot
set. Every multi-process test trains ``vlc-micro`` on it for a handful of steps.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("VLC_TEST_BACKEND", "gloo") != "nccl":  # under nccl DeepSpeed uses the GPUs
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def synthetic_data(tmp_path_factory):
    from vlcontrast.data.prep.synthetic import write_synthetic

    root = tmp_path_factory.mktemp("synthetic")
    write_synthetic(root, train=256, val=32, zeroshot_per_class=2, seed=0, image_size=32,
                    shard_size=64, workers=1, progress=False)
    return root
