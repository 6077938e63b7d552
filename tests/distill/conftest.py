"""The training tests of distillation run DeepSpeed on the CPU (as tests/train)."""

from __future__ import annotations

import os

if os.environ.get("VLC_TEST_BACKEND", "gloo") != "nccl":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
