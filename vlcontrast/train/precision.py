"""Training precision as one value: what each ``train.precision`` means for dtypes and DeepSpeed.

``fp32``: everything fp32. ``amp_bf16`` (open_clip's choice): fp32 parameters, gradients and
reductions, the forward computed under bf16 autocast (DeepSpeed's ``torch_autocast`` with no
"lower-precision-safe" modules, so no parameter gets a bf16 communication dtype). ``bf16`` and
``fp16``: DeepSpeed's own modes, parameters and gradients in 16 bits with an fp32 master copy in
the optimizer; fp16 adds dynamic loss scaling. Components ask a :class:`Precision` what they need
instead of testing the name (docs/training.md, "Precision").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vlcontrast.config import PRECISIONS, PrecisionName
from vlcontrast.errors import ConfigError

_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """``train.precision`` as a value (``Precision("amp_bf16").compute_dtype`` ...)."""

    name: PrecisionName = "fp32"

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ConfigError(f"train.precision={self.name!r}: must be one of "
                              f"{', '.join(PRECISIONS)}")

    @property
    def parameter_dtype(self) -> torch.dtype:
        """The dtype of the working parameters, and so of the images fed to the towers (fp32 and
        amp_bf16 keep fp32 parameters: autocast casts per op)."""
        return _HALF.get(self.name, torch.float32)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the forward's matrix products run in."""
        return torch.bfloat16 if self.name == "amp_bf16" else self.parameter_dtype

    @property
    def autocast(self) -> bool:
        """The forward runs under ``torch.autocast`` (parameters stay fp32)."""
        return self.name == "amp_bf16"

    @property
    def master_copy(self) -> bool:
        """DeepSpeed's mixed-precision optimizer holds an fp32 master copy of 16-bit parameters
        (and checks the reduced gradients for inf/NaN itself, at every ZeRO stage)."""
        return self.name in _HALF

    @property
    def loss_scaling(self) -> bool:
        """Dynamic loss scaling: a skipped step with a lowered scale is routine, not a fault."""
        return self.name == "fp16"

    def deepspeed_entries(self) -> dict[str, Any]:
        """The ``bf16``/``fp16``/``torch_autocast`` entries of the DeepSpeed config."""
        entries: dict[str, Any] = {
            "bf16": {"enabled": self.name == "bf16"},
            "fp16": {"enabled": self.name == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                     "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        }
        if self.autocast:
            entries["torch_autocast"] = {"enabled": True, "dtype": "bfloat16",
                                         "lower_precision_safe_modules": []}
        return entries

    def autocast_context(self, device: torch.device):
        """The autocast context the training forward runs under, for evaluation to match."""
        import contextlib

        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)

    def check_supported(self, device: torch.device) -> None:
        """Fail at start, not deep inside DeepSpeed, when the device cannot train this way."""
        if self.name == "fp32":
            return
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        supported = (accelerator.is_fp16_supported() if self.name == "fp16"
                     else accelerator.is_bf16_supported())
        if not supported:
            raise ConfigError(f"train.precision={self.name!r}: DeepSpeed's "
                              f"{accelerator.device_name()} accelerator does not support "
                              f"{self.name} on this {device.type} device; use "
                              "train.precision=bf16, amp_bf16 or fp32")
