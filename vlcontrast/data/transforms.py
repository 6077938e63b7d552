"""Training images as uint8, normalised per batch on the training device (``data.normalize_on_device``).

open_clip's training transform ends in ``ToTensor`` (uint8 → float / 255) and ``Normalize``; both
run once per image in the loader, and the float32 result is four times the bytes of the image.
:func:`split_normalization` cuts those two steps off: the loader then ships the augmented image as
a uint8 ``C x H x W`` tensor, and :class:`BatchNormalizer` applies the same two operations, in the
same order and in float32, to the whole batch on the device. The values are the ones the full
transform gives, bit for bit (the tests check this), for a fraction of the loader's work.
"""

from __future__ import annotations

import numpy as np
import torch
from torchvision import transforms as T

from vlcontrast.errors import ConfigError


class ToUInt8Tensor:
    """A PIL image (or H x W x C array) as a contiguous uint8 ``C x H x W`` tensor."""

    def __call__(self, image) -> torch.Tensor:
        array = np.asarray(image, dtype=np.uint8)
        if array.ndim == 2:
            array = array[:, :, None]
        # One copy, HWC -> contiguous CHW; always a copy, because the array PIL exposes is read-only.
        return torch.from_numpy(np.array(array.transpose(2, 0, 1), order="C"))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class BatchNormalizer:
    """``(images / 255 - mean) / std`` per channel, in float32, on the batch's device."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]):
        self.mean, self.std = tuple(mean), tuple(std)
        self._constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def constants(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """255, mean and std as float32 tensors on ``device`` (``1 x C x 1 x 1`` for the last
        two), made once: building them from Python lists on a GPU every step would be a pageable
        copy, which waits for the stream (a host sync in the hot loop). The 255 is a tensor too:
        CUDA divides by a Python scalar as a multiplication by its rounded reciprocal, which is
        not bit-identical to ``ToTensor``'s division; a tensor divisor is a true division on
        every device."""
        device = torch.device(device)
        if device not in self._constants:
            shape = (1, -1, 1, 1)
            self._constants[device] = (
                torch.full((), 255.0, dtype=torch.float32, device=device),
                torch.tensor(self.mean, dtype=torch.float32, device=device).view(shape),
                torch.tensor(self.std, dtype=torch.float32, device=device).view(shape))
        return self._constants[device]

    def __call__(self, images: torch.Tensor, device, dtype: torch.dtype) -> torch.Tensor:
        """uint8 ``B x C x H x W`` (host) → normalised ``dtype`` images on ``device``.

        The copy moves uint8 (a quarter of float32's bytes); the arithmetic is float32 whatever
        ``dtype`` is, and the cast to ``dtype`` comes last, as with the per-image transform.
        """
        if images.dtype != torch.uint8:
            raise TypeError(f"data.normalize_on_device: expected uint8 images from the loader, "
                            f"got {images.dtype}")
        scale, mean, std = self.constants(device)
        x = images.to(device=device, non_blocking=True).to(torch.float32).div_(scale)
        return x.sub_(mean).div_(std).to(dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mean={self.mean}, std={self.std})"


def splits_normalization(transform) -> bool:
    """Whether :func:`split_normalization` can cut ``transform`` (not timm's pipeline)."""
    steps = list(getattr(transform, "transforms", []))
    return (len(steps) >= 2 and isinstance(steps[-2], T.ToTensor)
            and isinstance(steps[-1], T.Normalize))


def split_normalization(transform) -> tuple[T.Compose, BatchNormalizer]:
    """(the transform up to uint8, the normaliser of its last two steps) of an open_clip transform.

    The transform must be a ``Compose`` ending in ``ToTensor`` (open_clip's ``MaybeToTensor`` is
    one) and ``Normalize``, which is what open_clip builds unless timm's pipeline is used.
    """
    steps = list(getattr(transform, "transforms", []))
    if not splits_normalization(transform):
        raise ConfigError("data.normalize_on_device=true needs a training transform that ends in "
                         f"ToTensor and Normalize; this model's is {transform!r} (timm's pipeline, "
                         "model.augment.use_timm, is not supported: set data.normalize_on_device=false)")
    normalize = steps[-1]
    normalizer = BatchNormalizer(tuple(float(m) for m in normalize.mean),
                                 tuple(float(s) for s in normalize.std))
    return T.Compose(steps[:-2] + [ToUInt8Tensor()]), normalizer
