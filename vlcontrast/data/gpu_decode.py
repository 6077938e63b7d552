"""``data.decode=gpu``: JPEGs decoded (nvJPEG) and augmented on the training device.

Loader workers do I/O and cheap parsing only. For each usable sample whose image is a JPEG the GPU
can take (:func:`probe_jpeg`: baseline or progressive, RGB or grey, whole), a worker reads the
header for the size, draws the crop box and flip from the sample's augmentation key
(:func:`~vlcontrast.data.crops.draw_crop`, the draws the CPU path makes) and ships the encoded
bytes. Every other image (PNG, WebP, CMYK or cut-off JPEGs, JPEGs with an EXIF orientation other
than 1, which the CPU path turns upright) is decoded and cropped on the CPU in
the worker, as ``data.decode=cpu`` would, and shipped as uint8 at the final size; it is counted
by reason in the loader's fallback statistics (:data:`FALLBACK_REASONS`).

A batch then carries :class:`EncodedImages` (one flat byte tensor, so the DataLoader's queue
moves one buffer instead of one per image). :class:`GpuBatchTransform`, in the training process,
decodes the JPEGs in one batched ``torchvision.io.decode_jpeg(..., device="cuda")`` call, crops,
resizes (open_clip's interpolation, antialiased, rounded to 8 bits as PIL does), flips and
normalises each image, and returns the batch in the compute dtype. A JPEG nvJPEG rejects is
decoded with PIL in the training process instead (``gpu_decode_failed``); one PIL rejects too
is counted ``undecodable_image`` and enters the batch as a mean-colour image (zeros after
normalisation): the batch size cannot change after the worker formed the batch.
"""

from __future__ import annotations

import io
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
from PIL import Image
from torchvision import transforms as T

from vlcontrast.errors import ConfigError
from .crops import SeededResizedCrop, seeded_call, with_shared_crop
from .samples import exif_orientation, open_image
from .transforms import BatchNormalizer, split_normalization

logger = logging.getLogger(__name__)

FALLBACK_REASONS = ("not_jpeg", "jpeg_cpu_only", "exif_orientation", "downscale_too_large",
                    "gpu_decode_failed")
"""Why an image of ``data.decode=gpu`` was decoded on the CPU: not a JPEG (PNG, WebP); a JPEG the
GPU path does not take (CMYK, no end-of-image marker, unreadable header); a JPEG whose EXIF
orientation is not 1 (nvJPEG gives the stored pixels; the CPU path turns them upright,
:func:`~vlcontrast.data.samples.upright`); a crop shrunk more than the GPU's antialiased resize
can take (:func:`gpu_can_resize`); nvJPEG failed on it."""

_AA_SHARED_BYTES = 48 * 1024 * 0.9
"""The antialiased ``interpolate`` kernel on CUDA keeps its filter weights in shared memory: at
most 48 KiB a block (the default without opt-in on every CUDA GPU), kept 10% clear."""
_AA_TAPS = {"bicubic": 4, "bilinear": 2}

_JPEG_START = b"\xff\xd8\xff"
_JPEG_END = b"\xff\xd9"
_GPU_MODES = ("RGB", "L")


def probe_jpeg(data: bytes, max_image_pixels: int) -> tuple[int, int] | str:
    """``(width, height)`` of a JPEG the GPU path takes, read from its header; otherwise
    ``decompression_bomb`` (a skip reason) or the fallback reason (``not_jpeg``,
    ``jpeg_cpu_only``, ``exif_orientation``: an EXIF orientation other than 1, read from the
    APP1 segment PIL parsed with the header, so that the CPU path turns it upright)."""
    if not data.startswith(_JPEG_START):
        return "not_jpeg"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            mode, kind = image.mode, image.format
            orientation = exif_orientation(image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return "decompression_bomb"
    except Exception:  # noqa: BLE001 - the CPU path decides whether it is decodable at all
        return "jpeg_cpu_only"
    if width * height > max_image_pixels:
        return "decompression_bomb"
    # A file cut short decodes on the CPU (PIL raises) but may give nvJPEG's partial output.
    if kind != "JPEG" or mode not in _GPU_MODES or not data.rstrip(b"\0").endswith(_JPEG_END):
        return "jpeg_cpu_only"
    if orientation != 1:
        return "exif_orientation"
    return width, height


def gpu_can_resize(height: int, width: int, size: tuple[int, int], interpolation: str) -> bool:
    """Whether CUDA's antialiased resize takes a ``height x width`` crop down to ``size``.

    Its kernel (``upsample_gen2d_aa`` in PyTorch) holds, per block of 32 output columns and at
    least one output row, ``taps(w) * 32 + taps(h) * 33`` float32 weights in shared memory, where
    ``taps = 2 * ceil(support * scale) + 1`` and the support is 2 (bicubic) or 1 (bilinear); it
    raises "Too much shared memory required" past 48 KiB: a bicubic shrink of about 47x (94x
    bilinear), which training small towers on photos meets (3,000 px to 64). Kept 10% clear, crops
    shrunk more than 42x (84x bilinear) go to the CPU.
    """
    import math

    support = _AA_TAPS.get(interpolation, 4) / 2
    taps_h = 2 * math.ceil(support * max(height / size[0], 1.0)) + 1
    taps_w = 2 * math.ceil(support * max(width / size[1], 1.0)) + 1
    return 4 * (taps_w * 32 + taps_h * 33) <= _AA_SHARED_BYTES


@dataclass(frozen=True)
class GpuPlan:
    """What the GPU does to each image: open_clip's plain training transform, read from it."""
    size: tuple[int, int]
    scale: tuple[float, float]
    ratio: tuple[float, float]
    interpolation: str
    """``bicubic`` or ``bilinear`` (``torch.nn.functional.interpolate`` modes)."""
    antialias: bool
    flip_p: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def from_transform(cls, transform) -> "GpuPlan":
        """The plan of a ``Compose`` of ``RandomResizedCrop``, RGB conversion, an optional
        ``RandomHorizontalFlip``, ``ToTensor`` and ``Normalize``; a one-line ConfigError for
        anything else (colour jitter, grey-scale, timm's pipeline)."""
        steps = list(getattr(transform, "transforms", []))
        crop = steps[0] if steps else None
        modes = {T.InterpolationMode.BICUBIC: "bicubic", T.InterpolationMode.BILINEAR: "bilinear"}
        flip_p = 0.0
        unsupported = []
        for step in steps[1:-2]:
            if isinstance(step, T.RandomHorizontalFlip):
                flip_p = float(step.p)
            elif type(step).__name__ not in ("MaybeConvertMode", "_convert_to_rgb", "function"):
                unsupported.append(type(step).__name__)
        if (not isinstance(crop, T.RandomResizedCrop) or crop.interpolation not in modes
                or len(steps) < 3 or not isinstance(steps[-2], T.ToTensor)
                or not isinstance(steps[-1], T.Normalize) or unsupported):
            raise ConfigError(
                "data.decode=gpu: the GPU applies open_clip's plain training transform (random "
                "resized crop, flip, normalise); this one has "
                f"{', '.join(unsupported) or type(crop).__name__ + ' first'} (model.augment's "
                "colour jitter, grey-scale and timm options need the CPU): set data.decode=cpu")
        size = tuple(crop.size) if len(crop.size) == 2 else (crop.size[0], crop.size[0])
        return cls(size=size, scale=tuple(crop.scale), ratio=tuple(crop.ratio),  # type: ignore
                   interpolation=modes[crop.interpolation], antialias=bool(crop.antialias),
                   flip_p=flip_p, mean=tuple(float(m) for m in steps[-1].mean),
                   std=tuple(float(s) for s in steps[-1].std))


class GpuDecodeTransform:
    """The loader workers' transform under ``data.decode=gpu``: carries the :class:`GpuPlan`
    (``gpu_plan``; the stream draws crops from it instead of decoding) and, called on a decoded
    image, is the CPU path up to uint8 (crop, flip, no normalisation) for the images the GPU
    does not take."""

    def __init__(self, transform):
        self.gpu_plan = GpuPlan.from_transform(transform)
        head, _ = split_normalization(transform)
        self.head = with_shared_crop(head)

    def __call__(self, image) -> torch.Tensor:
        return self.head(image)

    def batch_transform(self) -> "GpuBatchTransform":
        """The training process's half: decode and augment batches on the device."""
        return GpuBatchTransform(self.gpu_plan, self.head)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.gpu_plan})"


class EncodedSample(NamedTuple):
    """A worker's JPEG sample before collation."""
    data: bytes
    params: tuple[int, int, int, int, int, int]
    """``(top, left, height, width, flipped, augmentation key)``."""


class EncodedImages(NamedTuple):
    """The images of one batch under ``data.decode=gpu``, as the loader ships them."""
    data: torch.Tensor
    """uint8 ``[total bytes]``: the JPEGs, one after the other."""
    lengths: torch.Tensor
    """int64 ``[E]``: bytes of each JPEG."""
    params: torch.Tensor
    """int64 ``[E, 6]``: top, left, height, width, flipped, augmentation key of each JPEG."""
    positions: torch.Tensor
    """int64 ``[E]``: each JPEG's row in the batch."""
    decoded: torch.Tensor
    """uint8 ``[F, 3, H, W]``: the images decoded and cropped on the CPU (fallbacks)."""
    decoded_positions: torch.Tensor
    """int64 ``[F]``: their rows in the batch."""

    @property
    def batch_size(self) -> int:
        return len(self.positions) + len(self.decoded_positions)


def collate_images(images: list) -> EncodedImages:
    """One batch's images (:class:`EncodedSample` or uint8 ``C x H x W`` tensors)."""
    encoded = [(i, s) for i, s in enumerate(images) if isinstance(s, EncodedSample)]
    ready = [(i, s) for i, s in enumerate(images) if not isinstance(s, EncodedSample)]
    joined = bytearray(b"".join(s.data for _, s in encoded))
    data = torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
    return EncodedImages(
        data=data,
        lengths=torch.tensor([len(s.data) for _, s in encoded], dtype=torch.long),
        params=torch.tensor([s.params for _, s in encoded], dtype=torch.long).view(-1, 6),
        positions=torch.tensor([i for i, _ in encoded], dtype=torch.long),
        decoded=(torch.stack([s for _, s in ready]) if ready
                 else torch.empty(0, 3, 1, 1, dtype=torch.uint8)),
        decoded_positions=torch.tensor([i for i, _ in ready], dtype=torch.long))


_DECODE_STREAMS: dict[str, Any] = {}


def decode_jpegs(chunks: list[torch.Tensor], device, *, cuda=torch.cuda) -> list[torch.Tensor]:
    """RGB uint8 ``C x H x W`` images of encoded JPEGs, decoded on ``device`` (nvJPEG on CUDA,
    one batched call); raises RuntimeError when any fails.

    On CUDA the decode runs with a stream of its own as the current stream. torchvision allocates
    the decoder's outputs on the current stream and nvJPEG writes them without waiting for that
    stream's queued work; the caching allocator hands a stream any block freed on it, even one
    its queued kernels will still read (the previous batch's crops on the feed's side stream), so
    decoding on a busy stream can overwrite live data. The decode stream queues nothing else: the
    blocks it is given are free. The caller's stream then waits for it and is recorded as a user
    of every image. ``cuda`` is ``torch.cuda`` (a stand-in in the tests)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    device = torch.device(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchvision 0.29 flags its decoders for TorchCodec
        if device.type != "cuda":
            return decode_jpeg(chunks, mode=ImageReadMode.RGB, device=device)
        consumer = cuda.current_stream(device)
        stream = _DECODE_STREAMS.get(str(device))
        if stream is None:
            stream = _DECODE_STREAMS[str(device)] = cuda.Stream(device=device)
        with cuda.stream(stream):
            images = decode_jpeg(chunks, mode=ImageReadMode.RGB, device=device)
    consumer.wait_stream(stream)
    for image in images:
        image.record_stream(consumer)
    return images


class GpuBatchTransform:
    """:class:`EncodedImages` -> normalised ``B x 3 x H x W`` images on the device.

    Called like :class:`~vlcontrast.data.transforms.BatchNormalizer` (``(images, device,
    dtype)``), so the train step and the prefetcher treat both alike. ``cpu_transform`` is the
    CPU path up to uint8, for JPEGs nvJPEG rejects; ``fallbacks`` counts them here (the workers
    count theirs in the loader)."""

    def __init__(self, plan: GpuPlan, cpu_transform: Callable, *,
                 decoder: Callable[[list[torch.Tensor], Any], list[torch.Tensor]] = decode_jpegs):
        self.plan = plan
        self.cpu_transform = cpu_transform
        self.decoder = decoder
        self.normalizer = BatchNormalizer(plan.mean, plan.std)
        self.fallbacks: dict[str, int] = {}
        self._warned_all_failed = False

    def __call__(self, images: EncodedImages, device, dtype: torch.dtype) -> torch.Tensor:
        if not isinstance(images, EncodedImages):
            raise TypeError(f"data.decode=gpu: expected encoded images from the loader, got "
                            f"{type(images).__name__}")
        device = torch.device(device)
        height, width = self.plan.size
        out = torch.empty((images.batch_size, 3, height, width), dtype=torch.float32,
                          device=device)
        # Host-side lists: params, lengths and positions stay in (pinned) host memory, so reading
        # them costs no device sync.
        params = images.params.tolist()
        lengths = images.lengths.tolist()
        positions = images.positions.tolist()
        chunks = list(torch.split(images.data, lengths)) if lengths else []
        flips = []
        for row, image, (top, left, h, w, flipped, _key) in zip(
                positions, self._decode(chunks, params, device), params):
            if image.shape[-2:] == (height, width) and image.dtype == torch.float32:
                out[row] = image  # decoded and cropped (and flipped) on the CPU already
                continue
            out[row] = self.crop_resize(image, top, left, h, w)
            if flipped:
                flips.append(row)
        # Batch-wide, a few kernels instead of a few per image (the main thread launches them):
        # PIL resizes 8-bit images to 8 bits, so the resized values are clamped and rounded.
        out.clamp_(0, 255).round_()
        if flips:
            index = torch.tensor(flips, dtype=torch.long)
            if device.type == "cuda":
                index = index.pin_memory()  # a pageable source would make the copy wait
            index = index.to(device, non_blocking=True)
            out[index] = out[index].flip(-1)
        if len(images.decoded_positions):
            out[images.decoded_positions.to(device, non_blocking=True)] = (
                images.decoded.to(device, non_blocking=True).to(torch.float32))
        scale, mean, std = self.normalizer.constants(device)
        return out.div_(scale).sub_(mean).div_(std).to(dtype)

    def crop_resize(self, image: torch.Tensor, top: int, left: int, h: int, w: int
                    ) -> torch.Tensor:
        """One decoded uint8 image -> its crop at the output size, float32 (not yet rounded)."""
        crop = image[:, top:top + h, left:left + w].unsqueeze(0).to(torch.float32)
        return torch.nn.functional.interpolate(
            crop, size=self.plan.size, mode=self.plan.interpolation,
            antialias=self.plan.antialias, align_corners=False)[0]

    def _decode(self, chunks: list[torch.Tensor], params: list, device) -> list[torch.Tensor]:
        if not chunks:
            return []
        try:
            return list(self.decoder(chunks, device))
        except torch.OutOfMemoryError:
            raise  # not the image's fault: the CPU path would hide it batch after batch
        except RuntimeError as err:
            # One bad JPEG fails nvJPEG's whole batch: retry image by image.
            logger.debug("data.decode=gpu: batched decode failed (%s); decoding one by one", err)
        decoded, failed = [], 0
        for chunk, (*_, key) in zip(chunks, params):
            try:
                decoded.append(self.decoder([chunk], device)[0])
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:
                failed += 1
                decoded.append(self._decode_on_cpu(chunk, key, device))
        if len(decoded) > 1 and failed == len(decoded) and not self._warned_all_failed:
            self._warned_all_failed = True
            logger.warning("data.decode=gpu: nvJPEG rejected every JPEG of a batch, which were "
                           "decoded with PIL in the training process instead (slow); see "
                           "data/fallback_gpu_decode_failed. If it goes on, set data.decode=cpu")
        return decoded

    def _decode_on_cpu(self, chunk: torch.Tensor, key: int, device) -> torch.Tensor:
        """A JPEG nvJPEG rejected, through the CPU path (PIL, the same seeded crop), as float32
        at the output size; a mean-colour image when PIL rejects it too."""
        image = open_image(chunk.numpy().tobytes())
        height, width = self.plan.size
        if isinstance(image, str):
            self._count("undecodable_image")
            logger.warning("data.decode=gpu: an image in this batch decodes neither on the GPU "
                           "nor with PIL; it is trained as a mean-colour image (counted "
                           "data/fallback_undecodable_image)")
            mean = torch.tensor(self.plan.mean, dtype=torch.float32) * 255
            return mean.view(3, 1, 1).expand(3, height, width).to(device)
        self._count("gpu_decode_failed")
        tensor = seeded_call(self.cpu_transform, image, key)
        return tensor.to(device).to(torch.float32)

    def _count(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1


def check_gpu_decode(data_cfg: Any, device, augment: dict | None = None) -> None:
    """One-line errors for ``data.decode=gpu`` where it cannot work, before anything heavy: the
    device, then :func:`check_gpu_decode_config` (``augment``: ``model.augment``)."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        raise ConfigError(f"data.decode=gpu: the training device is {device}, not CUDA "
                          "(nvJPEG decodes on the GPU only): set data.decode=cpu")
    check_gpu_decode_config(data_cfg, augment)


def check_gpu_decode_config(data_cfg: Any, augment: dict | None = None) -> None:
    """The checks of ``data.decode=gpu`` that need only the config (no device, no model):
    ``data.augment``, ``data.cache_mb`` and ``model.augment`` (:func:`check_gpu_augment`)."""
    if not data_cfg.augment:
        raise ConfigError("data.decode=gpu applies the random training transform; with "
                          "data.augment=false set data.decode=cpu")
    if data_cfg.cache_mb:
        raise ConfigError(f"data.decode=gpu with data.cache_mb={data_cfg.cache_mb}: the cache "
                          "keeps decoded images, which the GPU path never has: set "
                          "data.cache_mb=0 or data.decode=cpu")
    check_gpu_augment(augment)


_CROP_ONLY = ("scale", "ratio")
"""``model.augment`` keys that only shape the random crop (which the GPU path applies)."""


def check_gpu_augment(augment: dict | None) -> None:
    """``model.augment`` under ``data.decode=gpu``, from the config alone: open_clip's training
    transform for these options is built (cheap: no model, no weights) and judged by
    :meth:`GpuPlan.from_transform`, the rule the loader applies to the model's own transform
    later, so there is one rule. A one-line ConfigError names the options and the fix."""
    if not augment:
        return
    import open_clip

    from vlcontrast.models import augment_applied

    with augment_applied():
        transform = open_clip.image_transform(224, is_train=True, aug_cfg=dict(augment))
    try:
        GpuPlan.from_transform(transform)
    except ConfigError:
        keys = [k for k, v in augment.items() if k not in _CROP_ONLY and v] or list(augment)
        named = ", ".join(f"model.augment.{k}={augment[k]!r}" for k in keys)
        raise ConfigError(
            f"data.decode=gpu with {named}: the GPU applies only open_clip's plain training "
            "transform (random resized crop, flip, normalise); colour jitter, grey-scale and "
            "timm's pipeline (use_timm) need the CPU: set data.decode=cpu or drop "
            f"{'this option' if len(keys) == 1 else 'these options'} from model.augment"
        ) from None


__all__ = ["EncodedImages", "EncodedSample", "FALLBACK_REASONS", "GpuBatchTransform",
           "GpuDecodeTransform", "GpuPlan", "SeededResizedCrop", "check_gpu_augment",
           "check_gpu_decode", "check_gpu_decode_config",
           "collate_images", "decode_jpegs", "gpu_can_resize", "probe_jpeg"]
