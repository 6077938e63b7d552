"""What every command that builds a model does first: fix DeepSpeed's accelerator and the
tokenizers' threads before anything imports them."""

from __future__ import annotations

import os


def prepare_environment(device: str = "auto") -> None:
    """Fix DeepSpeed's accelerator before anything imports DeepSpeed (it locks it at import).

    An explicit device (``train.device=cpu`` or ``--device cpu`` on a GPU host, ``cuda``/``cuda:N``)
    decides here, at the entry point; ``auto`` means the CPU without a usable GPU, and otherwise
    waits for ``init_distributed``, which chooses before the engine imports DeepSpeed."""
    from vlcontrast.distributed import choose_accelerator, usable_cuda_devices

    kind = "cpu" if device == "cpu" else "cuda" if str(device).startswith("cuda") else "auto"
    if kind != "auto":
        choose_accelerator(kind)
    elif "DS_ACCELERATOR" not in os.environ and usable_cuda_devices() == 0:
        choose_accelerator("cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
