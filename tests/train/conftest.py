"""The training tests run DeepSpeed on the CPU.

Their dataset is ``synthetic_data`` (tests/conftest.py), the package's synthetic world at 32x32
pixels: 256 training pairs in 4 shards of 64 (enough shards for 2 ranks x 1 reader in epoch mode),
32 validation pairs, a 2-per-class zero-shot set. Every multi-process test trains ``vlc-micro`` on
it for a handful of steps.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("VLC_TEST_BACKEND", "gloo") != "nccl":  # under nccl DeepSpeed uses the GPUs
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def no_model(monkeypatch):
    """The training loop with a model builder that fails: a test that uses it shows its check
    comes before the model is built."""
    from vlcontrast.train import loop

    def build_model(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(loop, "build_model", build_model)
    return loop
