"""Batch norms that train under every precision: affine weights follow the running statistics.

DeepSpeed's ``bf16``/``fp16`` modes cast every parameter to the low precision and leave buffers as
they are, so a ResNet tower's batch norms end up with bf16 weights next to fp32 running statistics.
PyTorch's batch-norm kernels accept a low-precision input with fp32 weights and statistics (the
"mixed type" path, CPU and CUDA), but not low-precision weights with fp32 statistics: the forward
fails. :func:`keep_batch_norm_statistics_fp32` gives each batch norm a forward that hands the
kernel its weights in the statistics' dtype (fp32), which is also the more accurate choice: the
normalisation and the running averages stay fp32 (apex's ``keep_batchnorm_fp32``). The output keeps
the input's dtype. Frozen batch norms (``model.lock_image_freeze_bn_stats``) hold everything in fp32
buffers; theirs is cast back to the input's dtype so the next bf16 convolution accepts it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchvision.ops.misc import FrozenBatchNorm2d


def _batch_norm(module: torch.nn.modules.batchnorm._BatchNorm, x: torch.Tensor,
                weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """torch's ``_BatchNorm.forward`` with the affine parameters passed in."""
    module._check_input_dim(x)
    factor = 0.0 if module.momentum is None else module.momentum
    if module.training and module.track_running_stats and module.num_batches_tracked is not None:
        module.num_batches_tracked.add_(1)
        factor = (1.0 / float(module.num_batches_tracked) if module.momentum is None
                  else module.momentum)
    use_batch_stats = module.training or (module.running_mean is None and module.running_var is None)
    keep_stats = not module.training or module.track_running_stats
    return F.batch_norm(x, module.running_mean if keep_stats else None,
                        module.running_var if keep_stats else None,
                        weight, bias, use_batch_stats, factor, module.eps)


class _StatisticsDtypeBatchNorm:
    """Mixin: run the kernel with the weights cast to the running statistics' dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = self.running_mean
        if self.weight is None or stats is None or self.weight.dtype == stats.dtype:
            return super().forward(x)
        bias = None if self.bias is None else self.bias.to(stats.dtype)
        return _batch_norm(self, x, self.weight.to(stats.dtype), bias)


class StatisticsDtypeBatchNorm1d(_StatisticsDtypeBatchNorm, torch.nn.BatchNorm1d):
    pass


class StatisticsDtypeBatchNorm2d(_StatisticsDtypeBatchNorm, torch.nn.BatchNorm2d):
    pass


class StatisticsDtypeBatchNorm3d(_StatisticsDtypeBatchNorm, torch.nn.BatchNorm3d):
    pass


class InputDtypeFrozenBatchNorm2d(FrozenBatchNorm2d):
    """torchvision's frozen batch norm (fp32 buffers), returning the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to(x.dtype)


_REPLACEMENTS = {
    torch.nn.BatchNorm1d: StatisticsDtypeBatchNorm1d,
    torch.nn.BatchNorm2d: StatisticsDtypeBatchNorm2d,
    torch.nn.BatchNorm3d: StatisticsDtypeBatchNorm3d,
    FrozenBatchNorm2d: InputDtypeFrozenBatchNorm2d,
}


def keep_batch_norm_statistics_fp32(model: torch.nn.Module) -> int:
    """Give every plain batch norm of ``model`` the forward above; returns how many changed.

    Only the class changes (same parameters, buffers and state-dict keys), so it is safe before or
    after loading weights and leaves checkpoints as they were. Subclasses with forwards of their own
    (timm's ``BatchNormAct2d``, ``SyncBatchNorm``) are left alone.
    """
    changed = 0
    for module in model.modules():
        replacement = _REPLACEMENTS.get(type(module))
        if replacement is not None:
            module.__class__ = replacement
            changed += 1
    return changed
