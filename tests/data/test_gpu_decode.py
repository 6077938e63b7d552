"""data.decode=gpu: the crop each sample gets, the batch transform, fallbacks and their counts.

The references are independent of the code under test: torchvision's own ``RandomResizedCrop``
(its ``get_params`` drawing from the default generator) and the CPU path's full training
transform (open_clip's, applied by :class:`SeededTransform` in the loader). The batch transform
runs on CPU tensors here, decoding with ``torchvision.io.decode_jpeg(device="cpu")`` as a stand-in
for nvJPEG; the device decode itself is the ``cuda``-marked test at the end.
"""

from __future__ import annotations

import io
import random

import numpy as np
import open_clip
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from PIL import Image

from tests.data.helpers import caption_of, write_shard
from vlcontrast.config import DataConfig
from vlcontrast.data.crops import (augment_key, crop_box, draw_crop, image_digest, seeded_call,
                                   with_shared_crop)
from vlcontrast.data import gpu_decode
from vlcontrast.data.gpu_decode import (EncodedImages, GpuBatchTransform, GpuDecodeTransform,
                                        GpuPlan, check_gpu_decode, decode_jpegs, gpu_can_resize,
                                        probe_jpeg)
from vlcontrast.data.loader import build_train_loader
from vlcontrast.errors import ConfigError
from vlcontrast.train.batches import SeededTransform

SIZE = 32
SEED = 11


def textured(width: int, height: int, seed: int) -> Image.Image:
    """Smooth gradients plus a little noise: crops of different boxes give different images, and
    JPEG keeps it close enough that two decoders agree to a few levels."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 6, size=3)
    channels = [127 + 100 * np.sin(x / (7 + 3 * c) + y / (11 + 2 * c) + phase[c]) for c in range(3)]
    array = np.stack(channels, -1) + rng.normal(0, 4, size=(height, width, 3))
    return Image.fromarray(np.clip(array, 0, 255).astype(np.uint8))


def encode(image: Image.Image, fmt: str = "JPEG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def train_transform(flip: float = 0.0, interpolation: str = "bicubic") -> T.Compose:
    base = open_clip.image_transform(SIZE, is_train=True,
                                     aug_cfg=open_clip.AugmentationCfg(scale=(0.3, 1.0)))
    steps = list(base.transforms)
    if interpolation == "bilinear":
        crop = steps[0]
        steps[0] = T.RandomResizedCrop(crop.size, scale=crop.scale, ratio=crop.ratio,
                                       interpolation=T.InterpolationMode.BILINEAR)
    if flip:
        steps.insert(2, T.RandomHorizontalFlip(flip))
    return T.Compose(steps)


def test_crop_box_draws_what_torchvision_draws():
    rng = random.Random(0)
    for trial in range(300):
        width, height = rng.randint(1, 400), rng.randint(1, 400)
        scale = sorted((rng.uniform(0.05, 1.0), rng.uniform(0.05, 1.0)))
        ratio = sorted((rng.uniform(0.2, 1.0), rng.uniform(1.0, 5.0)))
        torch.manual_seed(trial)
        expected = T.RandomResizedCrop.get_params(Image.new("RGB", (width, height)), scale, ratio)
        after_torchvision = torch.rand(3)
        generator = torch.Generator().manual_seed(trial)
        assert crop_box(width, height, scale, ratio, generator) == expected, (width, height)
        assert torch.equal(torch.rand(3, generator=generator), after_torchvision)


def test_shared_crop_leaves_the_cpu_transform_bit_identical():
    transform = train_transform(flip=0.5)
    shared = with_shared_crop(transform)
    assert type(shared.transforms[0]) is not T.RandomResizedCrop
    for i in range(20):
        image = textured(40 + 3 * i, 70 - 2 * i, i)
        assert torch.equal(seeded_call(transform, image, 1000 + i),
                           seeded_call(shared, image, 1000 + i))


@pytest.mark.parametrize("flip", [0.0, 0.5])
def test_gpu_path_boxes_are_the_cpu_path_boxes(flip):
    """For each image and epoch, the box and flip the worker ships reproduce the CPU path's
    image exactly (torchvision's own crop seeded with the sample's key)."""
    transform = train_transform(flip=flip)
    cpu = SeededTransform(transform, SEED)
    plan = GpuPlan.from_transform(transform)
    for epoch in (0, 3):
        cpu.epoch = epoch
        for i in range(25):
            image = textured(30 + 5 * i, 90 - 2 * i, i)
            data = encode(image)
            decoded = Image.open(io.BytesIO(data)).convert("RGB")
            key = augment_key(SEED, epoch, image_digest(data))
            top, left, h, w, flipped = draw_crop(key, *decoded.size, plan.scale, plan.ratio,
                                                 plan.flip_p)
            rebuilt = TF.resized_crop(decoded, top, left, h, w, [SIZE, SIZE],
                                      T.InterpolationMode.BICUBIC, antialias=True)
            if flipped:
                rebuilt = TF.hflip(rebuilt)
            expected = transform.transforms[-1](TF.to_tensor(rebuilt))
            assert torch.equal(cpu(decoded, digest=image_digest(data)), expected)
            # And the reference: torchvision's class as open_clip builds it, unreplaced.
            assert torch.equal(seeded_call(transform, decoded, key), expected)


def _batch(images: list[bytes], transform) -> tuple[EncodedImages, list[torch.Tensor]]:
    """Encoded images as a worker ships them, and the CPU path's images of the same samples."""
    from vlcontrast.data.gpu_decode import EncodedSample, collate_images

    cpu = SeededTransform(transform, SEED)
    plan = GpuPlan.from_transform(transform)
    samples, expected = [], []
    for data in images:
        decoded = Image.open(io.BytesIO(data)).convert("RGB")
        key = augment_key(SEED, 0, image_digest(data))
        params = draw_crop(key, *decoded.size, plan.scale, plan.ratio, plan.flip_p)
        samples.append(EncodedSample(data, (*params, key)))
        expected.append(cpu(decoded, digest=image_digest(data)))
    return collate_images(samples), expected


@pytest.mark.parametrize("interpolation,flip", [("bicubic", 0.5), ("bilinear", 0.0)])
def test_batch_transform_matches_the_cpu_path_within_decoder_tolerance(interpolation, flip):
    transform = train_transform(flip=flip, interpolation=interpolation)
    gpu = GpuDecodeTransform(transform)
    images = [encode(textured(40 + 7 * i, 100 - 5 * i, i), quality=92) for i in range(12)]
    images.append(encode(textured(60, 60, 99).convert("L"), quality=92))  # grey JPEG -> RGB
    encoded, expected = _batch(images, transform)
    out = gpu.batch_transform()(encoded, "cpu", torch.float32)
    assert out.shape == (len(images), 3, SIZE, SIZE) and out.dtype == torch.float32
    expected = torch.stack(expected)
    std = torch.tensor(gpu.gpu_plan.std).view(1, 3, 1, 1)
    levels = ((out - expected) * std * 255).abs()  # difference in 8-bit levels
    # libjpeg's decode is the same here; the gap is PIL's fixed-point resampling against torch's
    # float resampling (torchvision's antialias follows PIL's filter): measured 0.18 levels on
    # average, at most 1.
    assert levels.mean() < 0.5, levels.mean()
    assert levels.max() <= 2, levels.max()
    # A wrong box or a missed flip would move whole image regions by tens of levels.
    shifted = ((out - expected.flip(-1)) * std * 255).abs().mean()
    assert shifted > 5


def test_batch_transform_keeps_dtype_and_rows_of_cpu_decoded_images():
    transform = train_transform()
    gpu = GpuDecodeTransform(transform)
    from vlcontrast.data.gpu_decode import EncodedSample, collate_images

    png = textured(50, 40, 5)
    ready = gpu(png)  # what a worker ships for a PNG: uint8 at the output size
    assert ready.dtype == torch.uint8 and ready.shape == (3, SIZE, SIZE)
    data = encode(textured(64, 48, 6))
    key = augment_key(SEED, 0, image_digest(data))
    params = draw_crop(key, 64, 48, gpu.gpu_plan.scale, gpu.gpu_plan.ratio, 0.0)
    encoded = collate_images([ready, EncodedSample(data, (*params, key)), ready])
    assert encoded.positions.tolist() == [1] and encoded.decoded_positions.tolist() == [0, 2]
    out = gpu.batch_transform()(encoded, "cpu", torch.bfloat16)
    assert out.dtype == torch.bfloat16
    normalize = transform.transforms[-1]
    assert torch.allclose(out[0].float(), normalize(ready.float() / 255), atol=0.02)
    assert torch.equal(out[0], out[2])


def test_a_jpeg_the_device_decoder_rejects_goes_through_the_cpu_path_and_is_counted():
    transform = train_transform(flip=0.5)
    gpu = GpuDecodeTransform(transform)
    images = [encode(textured(50 + 9 * i, 60, i)) for i in range(4)]
    encoded, expected = _batch(images, transform)
    rejected = images[2]

    def decoder(chunks, device):
        if any(bytes(c.numpy()) == rejected for c in chunks):
            raise RuntimeError("nvjpeg: unsupported")
        return decode_jpegs(chunks, device)

    batch_transform = GpuBatchTransform(gpu.gpu_plan, gpu.head, decoder=decoder)
    out = batch_transform(encoded, "cpu", torch.float32)
    assert batch_transform.fallbacks == {"gpu_decode_failed": 1}
    # The CPU path's own image for that sample: the same seeded crop, PIL all the way.
    assert torch.allclose(out[2], expected[2], atol=1e-6)
    for row in (0, 1, 3):
        std = torch.tensor(gpu.gpu_plan.std).view(3, 1, 1)
        assert ((out[row] - expected[row]) * std * 255).abs().mean() < 1.0


def test_an_image_neither_decoder_takes_is_counted_and_mean_colour():
    transform = train_transform()
    gpu = GpuDecodeTransform(transform)
    good = encode(textured(50, 60, 1))
    broken = good[:300] + b"\x00" * 200 + b"\xff\xd9"
    encoded, _ = _batch([good, good], transform)
    encoded = encoded._replace(data=torch.frombuffer(bytearray(good + broken), dtype=torch.uint8),
                               lengths=torch.tensor([len(good), len(broken)]))

    def decoder(chunks, device):
        return [torch.ones(3, 60, 50, dtype=torch.uint8) for _ in chunks] if all(
            bytes(c.numpy()) == good for c in chunks) else (_ for _ in ()).throw(RuntimeError())

    batch_transform = GpuBatchTransform(gpu.gpu_plan, gpu.head, decoder=decoder)
    out = batch_transform(encoded, "cpu", torch.float32)
    assert batch_transform.fallbacks == {"undecodable_image": 1}
    assert out[1].abs().max() < 0.01  # the mean colour normalises to zero


def test_probe_sorts_images_for_the_gpu_and_the_cpu():
    image = textured(64, 40, 3)
    assert probe_jpeg(encode(image), 10**6) == (64, 40)
    assert probe_jpeg(encode(image.convert("L")), 10**6) == (64, 40)
    assert probe_jpeg(encode(image, progressive=True), 10**6) == (64, 40)
    assert probe_jpeg(encode(image, "PNG"), 10**6) == "not_jpeg"
    assert probe_jpeg(encode(image, "WEBP"), 10**6) == "not_jpeg"
    assert probe_jpeg(encode(image.convert("CMYK")), 10**6) == "jpeg_cpu_only"
    assert probe_jpeg(encode(image)[:-300], 10**6) == "jpeg_cpu_only"  # cut short
    assert probe_jpeg(b"\xff\xd8\xff\xe0 not a jpeg", 10**6) == "jpeg_cpu_only"
    assert probe_jpeg(encode(image), 100) == "decompression_bomb"


def _shards(tmp_path, kinds: list[str]) -> str:
    rows = []
    for i, kind in enumerate(kinds):
        image = textured(48 + i % 5 * 8, 40 + i % 3 * 8, i)
        key = f"{i:09d}"
        row = {"__key__": key, "txt": caption_of(i).encode()}
        if kind == "jpg":
            row["jpg"] = encode(image)
        elif kind == "png":
            row["png"] = encode(image, "PNG")
        elif kind == "cmyk":
            row["jpg"] = encode(image.convert("CMYK"))
        elif kind == "cut":
            row["jpg"] = encode(image)[:-200]
        elif kind == "garbage":
            row["jpg"] = b"\xff\xd8\xff\xe0 not a jpeg at all"
        rows.append(row)
    write_shard(tmp_path / "00000.tar", rows)
    return str(tmp_path / "00000.tar")


def _loader(pattern: str, transform, batch_size: int, workers: int = 0):
    cfg = DataConfig(train=pattern, batch_size=batch_size, workers=workers, shuffle_buffer=0,
                     num_samples=0, mode="epoch", max_bad_fraction=0.5)
    return build_train_loader(cfg, transform, lambda texts: torch.zeros(len(texts), 4,
                                                                        dtype=torch.long),
                              seed=SEED, rank=0, world_size=1, device="cpu")


def test_loader_ships_jpegs_encoded_and_counts_every_fallback(tmp_path):
    kinds = ["jpg"] * 4 + ["png"] + ["jpg"] * 3 + ["cmyk", "cut", "garbage", "png"] + ["jpg"] * 6
    pattern = _shards(tmp_path, kinds)
    transform = train_transform()
    gpu = GpuDecodeTransform(transform)
    loader = _loader(pattern, SeededTransform(gpu, SEED), batch_size=4)
    batches = list(loader)
    assert all(isinstance(b.images, EncodedImages) for b in batches)
    # PNGs (2) are decoded on the CPU, the CMYK JPEG too; the cut JPEG and the garbage one go to
    # the CPU path as well, where PIL fails: skipped as undecodable, as the CPU path skips them.
    assert loader.fallback_samples == {"jpeg_cpu_only": 1, "not_jpeg": 2}
    assert loader.bad_samples == {"undecodable_image": 2}
    assert loader.state_dict()["fallback_samples"] == {"jpeg_cpu_only": 1, "not_jpeg": 2}
    shipped = sum(len(b.images.positions) for b in batches)
    on_cpu = sum(len(b.images.decoded_positions) for b in batches)
    assert (len(batches), shipped, on_cpu) == (4, 13, 3)

    # The decoded batches equal the CPU path's loader batches (same samples, same crops).
    cpu_loader = _loader(pattern, SeededTransform(transform, SEED), batch_size=4)
    batch_transform = gpu.batch_transform()
    std = torch.tensor(gpu.gpu_plan.std).view(1, 3, 1, 1)
    for ours, theirs in zip(batches, cpu_loader):
        assert torch.equal(ours.sample_ids, theirs.sample_ids)
        images = batch_transform(ours.images, "cpu", torch.float32)
        assert ((images - theirs.images) * std * 255).abs().mean() < 1.0
    assert cpu_loader.bad_samples == {"undecodable_image": 2}


def test_worker_processes_ship_encoded_batches(tmp_path):
    pattern = _shards(tmp_path, ["jpg"] * 7 + ["png"])
    gpu = GpuDecodeTransform(train_transform())
    loader = _loader(pattern, SeededTransform(gpu, SEED), batch_size=4, workers=2)
    batches = list(loader)
    assert len(batches) == 2 and all(isinstance(b.images, EncodedImages) for b in batches)
    assert loader.fallback_samples == {"not_jpeg": 1}


def test_plan_refuses_what_the_gpu_does_not_do():
    jitter_cfg = open_clip.AugmentationCfg(color_jitter_prob=0.5, color_jitter=(0.4, 0.4, 0.4, 0.1))
    jitter = open_clip.image_transform(SIZE, is_train=True, aug_cfg=jitter_cfg)
    with pytest.raises(ConfigError, match="data.decode=gpu.*set data.decode=cpu"):
        GpuPlan.from_transform(jitter)
    with pytest.raises(ConfigError, match="data.decode=gpu"):
        GpuPlan.from_transform(open_clip.image_transform(SIZE, is_train=False))
    plan = GpuPlan.from_transform(train_transform(flip=0.25, interpolation="bilinear"))
    assert (plan.size, plan.scale, plan.flip_p, plan.interpolation) == (
        (SIZE, SIZE), (0.3, 1.0), 0.25, "bilinear")


def test_decode_gpu_without_cuda_is_a_one_line_error():
    for device, data in (("cpu", DataConfig(decode="gpu")), (None, DataConfig(decode="gpu")),
                         ("cuda", DataConfig(decode="gpu", augment=False)),
                         ("cuda", DataConfig(decode="gpu", cache_mb=10))):
        with pytest.raises(ConfigError, match="data.decode=gpu") as error:
            check_gpu_decode(data, device)
        assert "\n" not in str(error.value) and "data.decode=cpu" in str(error.value) or \
            "cache_mb=0" in str(error.value)


@pytest.mark.cuda
def test_device_decode_matches_the_cpu_stand_in():
    transform = train_transform(flip=0.5)
    gpu = GpuDecodeTransform(transform)
    images = [encode(textured(80 + 13 * i, 120 - 7 * i, i), quality=90) for i in range(16)]
    images.append(encode(textured(64, 64, 40), progressive=True))
    images.append(encode(textured(72, 56, 41).convert("L")))  # grey: nvJPEG gives RGB
    encoded, expected = _batch(images, transform)
    batch_transform = gpu.batch_transform()
    on_device = batch_transform(encoded, "cuda", torch.float32)
    assert on_device.device.type == "cuda" and batch_transform.fallbacks == {}
    on_cpu = batch_transform(encoded, "cpu", torch.float32)
    std = torch.tensor(gpu.gpu_plan.std).view(1, 3, 1, 1)
    # nvJPEG's IDCT and upsampling differ from libjpeg-turbo's by a level or two per pixel.
    levels = ((on_device.cpu() - on_cpu) * std * 255).abs()
    assert levels.mean() < 1.5 and levels.max() <= 16
    assert ((on_device.cpu() - torch.stack(expected)) * std * 255).abs().mean() < 2.0
    bf16 = batch_transform(encoded, "cuda", torch.bfloat16)
    assert bf16.dtype == torch.bfloat16


@pytest.mark.cuda
def test_device_decode_through_the_feed_under_load_equals_a_quiet_decode():
    """nvJPEG and the side stream while the compute stream is busy, in the loop's order (hand
    over, launch the step, prepare the next batch): each batch the step reads late equals the same
    batch decoded with nothing else running. Decoding onto blocks that queued kernels still read
    would corrupt some (docs/loader.md, "The decode stream")."""
    from vlcontrast.data.loader import Batch
    from vlcontrast.train.batches import DeviceFeed

    transform = train_transform(flip=0.5)
    gpu = GpuDecodeTransform(transform)
    host = []
    for b in range(8):
        images = [encode(textured(80 + 7 * i + b, 96 - 3 * i, 100 * b + i), quality=90)
                  for i in range(16)]
        host.append(Batch(_batch(images, transform)[0], torch.zeros(16, 5, dtype=torch.long),
                          torch.arange(16)))
    quiet_transform = gpu.batch_transform()
    quiet = [quiet_transform(b.images, "cuda", torch.float32).cpu() for b in host]
    torch.cuda.synchronize()

    feed = DeviceFeed("cuda", torch.float32, gpu.batch_transform())
    work = torch.randn(2048, 2048, device="cuda")
    ahead, seen = feed.prepare(host[:1]), []
    for k in range(len(host)):
        ready = feed.hand_over(ahead)
        for _ in range(30):  # the step: a long queue of kernels before it reads the batch
            work = (work @ work).tanh_()
        seen.append(ready[0].images * (1.0 + 0.0 * work[0, 0]))
        del ready
        if k + 1 < len(host):
            ahead = feed.prepare(host[k + 1:k + 2])
    torch.cuda.synchronize()
    for k, image in enumerate(seen):
        assert torch.equal(image.cpu(), quiet[k]), f"batch {k} differs from its quiet decode"


def test_config_refuses_decode_gpu_without_augmentation_or_with_the_cache():
    from vlcontrast.config import load_config

    for overrides in (["data.augment=false"], ["data.cache_mb=16"]):
        with pytest.raises(ConfigError, match=r"^data.decode='gpu': .*data.decode=cpu$"):
            load_config(None, ["train.steps=1", "data.decode=gpu", *overrides])
    assert load_config(None, ["train.steps=1", "data.decode=gpu"]).data.decode == "gpu"


JITTER = {"color_jitter_prob": 0.5, "color_jitter": [0.4, 0.4, 0.4, 0.1]}


@pytest.mark.parametrize("augment, key", [(JITTER, "color_jitter_prob"),
                                          ({"gray_scale_prob": 0.2}, "gray_scale_prob"),
                                          ({"use_timm": True}, "use_timm")])
def test_model_augment_the_gpu_does_not_apply_is_refused_from_the_config_alone(augment, key):
    """No model, no device: the augment options are judged with the cache_mb/augment checks
    (the train loop runs them before build_model), in one line naming the key and the fix."""
    from vlcontrast.data.gpu_decode import check_gpu_decode_config

    for check in (lambda: check_gpu_decode_config(DataConfig(decode="gpu"), augment),
                  lambda: check_gpu_decode(DataConfig(decode="gpu"), "cuda", augment=augment)):
        with pytest.raises(ConfigError, match=rf"data.decode=gpu.*model.augment.{key}") as error:
            check()
        message = str(error.value)
        assert "\n" not in message and "set data.decode=cpu or drop" in message
    check_gpu_decode_config(DataConfig(decode="gpu"), {"scale": [0.5, 1.0]})  # a crop: fine
    check_gpu_decode_config(DataConfig(decode="gpu"), {})
    check_gpu_decode(DataConfig(decode="gpu"), "cuda", augment={"scale": [0.5, 1.0]})


def test_config_command_refuses_decode_gpu_with_colour_jitter(capsys):
    from vlcontrast import cli

    base = ["config", "train.steps=1", "data.decode=gpu"]
    assert cli.main(base + ["model.augment={color_jitter_prob: 0.5, "
                            "color_jitter: [0.4, 0.4, 0.4, 0.1]}"]) == 2
    err = capsys.readouterr().err
    assert "would not train" in err and "model.augment.color_jitter_prob" in err
    assert "data.decode=cpu" in err and len(err.strip().splitlines()) == 1
    assert cli.main(base + ["model.augment={scale: [0.5, 1.0]}"]) == 0
    assert cli.main(["config", "train.steps=1", "model.augment={gray_scale_prob: 0.2}"]) == 0


def test_each_samples_crop_is_the_same_with_any_number_of_workers_and_after_resume(tmp_path):
    pattern = _shards(tmp_path, ["jpg"] * 16)
    gpu = GpuDecodeTransform(train_transform(flip=0.5))

    def crops(loader, epoch=0):
        loader.set_epoch(epoch)
        found = {}
        for batch in loader:
            for row, params in zip(batch.images.positions.tolist(), batch.images.params.tolist()):
                found[int(batch.sample_ids[row])] = params
        return found

    alone = crops(_loader(pattern, SeededTransform(gpu, SEED), batch_size=4))
    pooled = crops(_loader(pattern, SeededTransform(gpu, SEED), batch_size=4, workers=2))
    assert len(alone) == 16 and alone == pooled
    later = crops(_loader(pattern, SeededTransform(gpu, SEED), batch_size=4), epoch=1)
    assert later.keys() == alone.keys() and later != alone  # a new epoch draws new crops
    # Resumed after two batches: the remaining samples get the crops of the uninterrupted run.
    first = _loader(pattern, SeededTransform(gpu, SEED), batch_size=4)
    iterator = iter(first)
    next(iterator), next(iterator)
    cfg = DataConfig(train=pattern, batch_size=4, workers=0, shuffle_buffer=0, mode="epoch",
                     max_bad_fraction=0.5)
    resumed = build_train_loader(cfg, SeededTransform(gpu, SEED),
                                 lambda texts: torch.zeros(len(texts), 4, dtype=torch.long),
                                 seed=SEED, rank=0, world_size=1, device="cpu",
                                 resume_state=first.state_dict())
    rest = crops(resumed)
    assert len(rest) == 8 and all(alone[i] == p for i, p in rest.items())


class _Stream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other: "_Stream") -> None:
        self.log.append(("wait_stream", self.name, other.name))


class _Cuda:
    """The parts of torch.cuda decode_jpegs uses, recording each call."""

    def __init__(self):
        self.log: list = []
        self.active = _Stream("side", self.log)  # a DeviceFeed's side stream is current

    def Stream(self, device=None):  # noqa: N802 - torch.cuda's name
        self.log.append(("new_stream", str(device)))
        return _Stream("decode", self.log)

    def current_stream(self, device=None):
        return self.active

    def stream(self, stream):
        import contextlib

        @contextlib.contextmanager
        def entered():
            previous, self.active = self.active, stream
            try:
                yield
            finally:
                self.active = previous
        return entered()


def test_nvjpeg_decodes_on_a_stream_of_its_own_and_hands_the_images_to_the_callers(monkeypatch):
    """nvJPEG writes its outputs without waiting for the current stream's queued work, and the
    caching allocator gives a stream blocks its queued kernels may still read: decoding on the
    side stream (busy with the previous batch's crops) could overwrite them. The decode must run
    on a stream that queues nothing else; the caller's stream then waits for it and is recorded
    as a user of every image, so the allocator does not recycle an image while a crop reads it."""
    import torchvision.io

    cuda = _Cuda()
    monkeypatch.setattr(gpu_decode, "_DECODE_STREAMS", {})

    def decode_jpeg(chunks, mode=None, device=None):
        assert torch.device(device).type == "cuda"
        cuda.log.append(("decode", cuda.active.name, len(chunks)))
        return [torch.zeros(3, 4, 4, dtype=torch.uint8) for _ in chunks]

    def record_stream(tensor, stream):
        cuda.log.append(("record_stream", stream.name))

    monkeypatch.setattr(torchvision.io, "decode_jpeg", decode_jpeg)
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    chunks = [torch.zeros(10, dtype=torch.uint8)] * 3
    images = decode_jpegs(chunks, "cuda", cuda=cuda)
    assert len(images) == 3 and cuda.active.name == "side"
    assert cuda.log == [("new_stream", "cuda"), ("decode", "decode", 3),
                        ("wait_stream", "side", "decode")] + [("record_stream", "side")] * 3
    cuda.log.clear()
    decode_jpegs(chunks[:1], "cuda", cuda=cuda)  # the stream is made once per device
    assert cuda.log == [("decode", "decode", 1), ("wait_stream", "side", "decode"),
                        ("record_stream", "side")]


def test_the_gpu_resize_limit_is_pytorchs_shared_memory_bound():
    """CUDA's antialiased interpolate raises "Too much shared memory required" when its filter
    weights (taps_w * 32 + taps_h * 33 floats) pass 48 KiB; every crop gpu_can_resize accepts is
    within it, and ordinary ones are accepted."""
    import math

    def pytorch_bytes(h, w, size, taps):
        support = taps / 2
        th = 2 * math.ceil(support * max(h / size[0], 1)) + 1
        tw = 2 * math.ceil(support * max(w / size[1], 1)) + 1
        return 4 * (tw * 32 + th * 33)

    for mode, taps in (("bicubic", 4), ("bilinear", 2)):
        for out in (32, 64, 224):
            for side in range(out, out * 120, max(1, out // 2)):
                for h, w in ((side, side), (side, out), (out, side)):
                    if gpu_can_resize(h, w, (out, out), mode):
                        assert pytorch_bytes(h, w, (out, out), taps) <= 48 * 1024, (mode, h, w)
    assert gpu_can_resize(256, 256, (224, 224), "bicubic")  # CC3M-style 256-px images
    assert gpu_can_resize(2048, 1536, (224, 224), "bicubic")
    assert not gpu_can_resize(3000, 3000, (64, 64), "bicubic")  # a photo to a small tower
    assert gpu_can_resize(3000, 3000, (64, 64), "bilinear")  # half the taps
    assert not gpu_can_resize(3000, 3000, (32, 32), "bilinear")


def test_a_crop_too_large_for_the_gpu_resize_goes_to_the_cpu_and_is_counted(tmp_path):
    big = textured(2400, 1800, 7)  # at 32 px every crop shrinks more than the GPU resize takes
    rows = [{"__key__": f"{i:09d}", "txt": caption_of(i).encode(),
             "jpg": encode(big if i == 2 else textured(60, 50, i))} for i in range(4)]
    write_shard(tmp_path / "00000.tar", rows)
    pattern = str(tmp_path / "00000.tar")
    transform = train_transform()
    gpu = GpuDecodeTransform(transform)
    (batch,) = list(_loader(pattern, SeededTransform(gpu, SEED), batch_size=4))
    loader = _loader(pattern, SeededTransform(gpu, SEED), batch_size=4)
    list(loader)
    assert loader.fallback_samples == {"downscale_too_large": 1}
    assert batch.images.decoded_positions.tolist() == [2] and len(batch.images.positions) == 3
    # The CPU path's image of that sample: the same seeded crop.
    (cpu_batch,) = list(_loader(pattern, SeededTransform(transform, SEED), batch_size=4))
    images = gpu.batch_transform()(batch.images, "cpu", torch.float32)
    std = torch.tensor(gpu.gpu_plan.std).view(3, 1, 1)
    assert ((images[2] - cpu_batch.images[2]) * std * 255).abs().max() <= 1.0


def test_out_of_memory_is_not_taken_for_a_bad_jpeg_and_a_batch_nvjpeg_rejects_whole_is_told(
        caplog):
    transform = train_transform()
    gpu = GpuDecodeTransform(transform)
    encoded, _ = _batch([encode(textured(50 + i, 60, i)) for i in range(3)], transform)

    def out_of_memory(chunks, device):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        GpuBatchTransform(gpu.gpu_plan, gpu.head, decoder=out_of_memory)(encoded, "cpu",
                                                                         torch.float32)

    def rejects_all(chunks, device):
        raise RuntimeError("nvjpeg: not supported")

    batch_transform = GpuBatchTransform(gpu.gpu_plan, gpu.head, decoder=rejects_all)
    with caplog.at_level("WARNING", logger="vlcontrast.data.gpu_decode"):
        batch_transform(encoded, "cpu", torch.float32)
        batch_transform(encoded, "cpu", torch.float32)
    assert batch_transform.fallbacks == {"gpu_decode_failed": 6}
    warned = [r for r in caplog.records if "rejected every JPEG" in r.getMessage()]
    assert len(warned) == 1  # once, not per batch
