"""Each training image's random crop, drawn the same way whichever device decodes the image.

Augmentation is a function of (run seed, epoch, image): :func:`augment_key` folds the run seed and
the epoch into the CRC-32 of the image's *encoded* bytes (the tar member), and that key seeds the
random draws of the image's transform. The encoded bytes, not the decoded pixels, because the GPU
path (``data.decode=gpu``) must know a sample's crop before the image is decoded, in a loader
worker that never decodes it, and because nvJPEG and libjpeg-turbo do not give bit-identical
pixels.

:func:`crop_box` is torchvision's ``RandomResizedCrop.get_params`` with its generator named: the
CPU path draws it from the default generator (seeded with the key by
:class:`~vlcontrast.train.batches.SeededTransform`) through :class:`SeededResizedCrop`; the GPU
path draws it in the loader worker from a generator seeded with the same key
(:func:`draw_crop`). Both give the same box, flip and following draws for the same key.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Sequence

import torch
from torchvision import transforms as T
from torchvision.transforms import functional as TF


def image_digest(encoded: bytes) -> int:
    """The CRC-32 of an image's encoded bytes: what identifies the image to its augmentation."""
    return zlib.crc32(encoded)


def augment_key(seed: int, epoch: int, digest: int) -> int:
    """The seed of one image's augmentation in one epoch of one run."""
    return zlib.crc32(f"{seed}/{epoch}".encode(), digest)


def crop_box(width: int, height: int, scale: Sequence[float], ratio: Sequence[float],
             generator: torch.Generator | None = None) -> tuple[int, int, int, int]:
    """``(top, left, height, width)`` of a random resized crop of a ``width x height`` image.

    The draws of torchvision's ``RandomResizedCrop.get_params``, in the same order and from the
    same distributions, from ``generator`` (None: the default generator, as torchvision does):
    with the same generator state both give the same box (tests/data/test_crops.py)."""
    area = height * width
    log_ratio = _log_ratio(float(ratio[0]), float(ratio[1]))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1],
                                                     generator=generator).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1],
                                                         generator=generator)).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = torch.randint(0, height - h + 1, size=(1,), generator=generator).item()
            left = torch.randint(0, width - w + 1, size=(1,), generator=generator).item()
            return int(top), int(left), h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


@functools.lru_cache(maxsize=64)
def _log_ratio(low: float, high: float) -> tuple[float, float]:
    """torchvision's ``torch.log(torch.tensor(ratio))`` (float32), made once per ratio: the two
    tensor operations cost more than the draws themselves."""
    values = torch.log(torch.tensor((low, high)))
    return float(values[0]), float(values[1])


def flip_drawn(p: float, generator: torch.Generator | None = None) -> bool:
    """torchvision's ``RandomHorizontalFlip`` draw, from ``generator``."""
    return bool(torch.rand(1, generator=generator) < p)


class SeededResizedCrop(T.RandomResizedCrop):
    """torchvision's ``RandomResizedCrop`` whose box comes from :func:`crop_box` (the same draws
    from the default generator, so the same output as the class it replaces)."""

    def forward(self, img):
        _, height, width = TF.get_dimensions(img)
        top, left, h, w = crop_box(width, height, self.scale, self.ratio)
        return TF.resized_crop(img, top, left, h, w, self.size, self.interpolation,
                               antialias=self.antialias)

    @classmethod
    def like(cls, crop: T.RandomResizedCrop) -> "SeededResizedCrop":
        return cls(crop.size, scale=crop.scale, ratio=crop.ratio, interpolation=crop.interpolation,
                   antialias=crop.antialias)


def with_shared_crop(transform):
    """``transform`` (a ``Compose``) with each ``RandomResizedCrop`` drawing its box through
    :func:`crop_box`; any other transform is returned as it is."""
    steps = getattr(transform, "transforms", None)
    if not isinstance(transform, T.Compose) or steps is None:
        return transform
    return T.Compose([SeededResizedCrop.like(s) if type(s) is T.RandomResizedCrop else s
                      for s in steps])


def draw_crop(key: int, width: int, height: int, scale: Sequence[float], ratio: Sequence[float],
              flip_p: float, generator: torch.Generator | None = None
              ) -> tuple[int, int, int, int, int]:
    """``(top, left, height, width, flipped)`` of an image with augmentation key ``key``: the
    draws the CPU path makes for it (crop, then flip when the transform flips)."""
    generator = generator if generator is not None else torch.Generator()
    generator.manual_seed(key)
    top, left, h, w = crop_box(width, height, scale, ratio, generator)
    flipped = flip_drawn(flip_p, generator) if flip_p > 0 else False
    return top, left, h, w, int(flipped)


def seeded_call(transform, image, key: int):
    """``transform(image)`` with the default generator seeded with ``key`` for the call only.

    Only the CPU generator the transforms draw from: ``torch.manual_seed`` would also queue a lazy
    CUDA seed, which formats the whole Python stack on every call (a CUDA build on a machine
    without a GPU: +0.35-0.4 ms per image, more than a 32 px train transform)."""
    generator = torch.default_generator
    state = generator.get_state()
    generator.manual_seed(key)
    try:
        return transform(image)
    finally:
        generator.set_state(state)
