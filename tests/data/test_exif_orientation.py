"""EXIF orientation: every reader turns a phone photo upright, as ``vlcontrast prep folder`` does.

A JPEG stored 64x32 with orientation 6 ("rotate 90 degrees clockwise to view") is 32x64 upright:
that is what ``prep folder``'s re-encoding writes, and what the training loader (either decode
path) must feed the model. A JPEG without the tag comes out as stored.
"""

from __future__ import annotations

import io

import numpy as np
import torch
import torchvision.transforms as T
from PIL import Image, ImageOps

from tests.data.helpers import caption_of, write_shard
from tests.data.test_gpu_decode import SEED, _loader, textured, train_transform
from vlcontrast.data.gpu_decode import (FALLBACK_REASONS, EncodedImages, GpuDecodeTransform,
                                        probe_jpeg)
from vlcontrast.data.prep.writer import encode_image
from vlcontrast.data.samples import decode_image, open_image, to_rgb
from vlcontrast.train.batches import SeededTransform

STORED = (64, 32)
UPRIGHT = (32, 64)


def stored_image(seed: int = 0) -> Image.Image:
    """64x32, left half light and right half dark, so a rotation is visible in the pixels."""
    image = textured(*STORED, seed)
    array = np.asarray(image).copy()
    array[:, : STORED[0] // 2] = np.clip(array[:, : STORED[0] // 2].astype(int) + 60, 0, 255)
    array[:, STORED[0] // 2:] //= 3
    return Image.fromarray(array)


def jpeg(orientation: int | None, seed: int = 0, **options) -> bytes:
    """A camera-style JPEG: stored 64x32, with EXIF (make, model and, unless None, the
    orientation tag) when ``orientation`` is given."""
    buffer = io.BytesIO()
    if orientation is not None:
        exif = Image.Exif()
        exif[0x010F], exif[0x0110] = "Phone", "Model X"
        exif[0x0112] = orientation
        options["exif"] = exif.tobytes()
    stored_image(seed).save(buffer, format="JPEG", quality=95, **options)
    return buffer.getvalue()


def reference(data: bytes) -> Image.Image:
    """PIL's own rule: exif_transpose, then RGB."""
    return ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")


def test_the_shared_rule_turns_tagged_images_upright_and_leaves_others_as_stored():
    tagged, plain, upright_tag = jpeg(6), jpeg(None), jpeg(1)
    for data, size in ((tagged, UPRIGHT), (plain, STORED), (upright_tag, STORED)):
        expected = reference(data)
        assert expected.size == size
        assert open_image(data).size == size
        assert open_image(data).tobytes() == expected.tobytes()
        for alpha in ("white", "drop"):
            image, transparent = decode_image(data, alpha=alpha)
            assert (image.size, transparent) == (size, False)
            assert image.tobytes() == expected.tobytes()
    # Every orientation, as PIL's exif_transpose applies it.
    for orientation in range(2, 9):
        data = jpeg(orientation)
        assert open_image(data).tobytes() == reference(data).tobytes(), orientation
    # Applied once: an image already turned (format None, tag still in its info) stays put.
    once = to_rgb(Image.open(io.BytesIO(tagged)))
    assert to_rgb(once).size == UPRIGHT == to_rgb(once.copy()).size


def test_readers_agree_with_prep_folder():
    """``prep folder``/``prep csv`` re-encode upright; a raw shard's reader gives the same shape."""
    tagged = jpeg(6)
    converted = encode_image(tagged, image_size=32, resize_mode="keep_ratio")
    assert Image.open(io.BytesIO(converted)).size == UPRIGHT
    assert Image.open(io.BytesIO(converted)).getexif().get(0x0112, 1) == 1
    assert open_image(converted).size == open_image(tagged).size == UPRIGHT


def test_png_and_webp_orientation():
    exif = Image.Exif()
    exif[0x0112] = 6
    for fmt in ("PNG", "WEBP"):
        buffer = io.BytesIO()
        stored_image().save(buffer, format=fmt, exif=exif.tobytes(), **(
            {"lossless": True} if fmt == "WEBP" else {}))
        assert open_image(buffer.getvalue()).size == UPRIGHT, fmt


def test_malformed_exif_reads_the_pixels_as_stored():
    data = jpeg(None, exif=b"Exif\x00\x00" + b"\x00garbage" * 4)
    assert open_image(data).size == STORED


def _shard(tmp_path, orientations) -> str:
    rows = [{"__key__": f"{i:09d}", "txt": caption_of(i).encode(), "jpg": jpeg(o, seed=i)}
            for i, o in enumerate(orientations)]
    write_shard(tmp_path / "00000.tar", rows)
    return str(tmp_path / "00000.tar")


def test_training_loader_cpu_path_turns_tagged_jpegs_upright(tmp_path):
    pattern = _shard(tmp_path, [6] * 4)
    batches = list(_loader(pattern, SeededTransform(T.ToTensor(), SEED), batch_size=4))
    assert len(batches) == 1
    assert tuple(batches[0].images.shape) == (4, 3, UPRIGHT[1], UPRIGHT[0])
    expected = torch.stack([T.ToTensor()(reference(jpeg(6, seed=i))) for i in range(4)])
    assert torch.equal(batches[0].images, expected)

    plain = tmp_path / "plain"
    plain.mkdir()
    batches = list(_loader(_shard(plain, [None] * 4), SeededTransform(T.ToTensor(), SEED),
                           batch_size=4))
    assert tuple(batches[0].images.shape) == (4, 3, STORED[1], STORED[0])


def test_gpu_probe_sends_tagged_jpegs_to_the_cpu():
    assert "exif_orientation" in FALLBACK_REASONS
    assert probe_jpeg(jpeg(6), 10**6) == "exif_orientation"
    assert probe_jpeg(jpeg(3), 10**6) == "exif_orientation"
    assert probe_jpeg(jpeg(1), 10**6) == STORED
    assert probe_jpeg(jpeg(None), 10**6) == STORED


def test_gpu_path_falls_back_for_tagged_jpegs_and_gives_the_cpu_pixels(tmp_path):
    """The worker half of data.decode=gpu on CPU: tagged JPEGs are decoded upright in the worker,
    counted ``exif_orientation``, and equal the CPU path's images; the others are shipped."""
    orientations = [6, None, 1, 8, None, 6, None, None]
    pattern = _shard(tmp_path, orientations)
    transform = train_transform(flip=0.5)
    gpu = GpuDecodeTransform(transform)
    batches = list(_loader(pattern, SeededTransform(gpu, SEED), batch_size=4))
    assert all(isinstance(b.images, EncodedImages) for b in batches)
    loader_stats = _loader(pattern, SeededTransform(gpu, SEED), batch_size=4)
    list(loader_stats)
    assert loader_stats.fallback_samples == {"exif_orientation": 3}
    assert sum(len(b.images.decoded_positions) for b in batches) == 3
    assert sum(len(b.images.positions) for b in batches) == 5

    cpu_batches = list(_loader(pattern, SeededTransform(transform, SEED), batch_size=4))
    batch_transform = gpu.batch_transform()
    std = torch.tensor(gpu.gpu_plan.std).view(1, 3, 1, 1)
    for ours, theirs in zip(batches, cpu_batches):
        assert torch.equal(ours.sample_ids, theirs.sample_ids)
        images = batch_transform(ours.images, "cpu", torch.float32)
        difference = ((images - theirs.images) * std * 255).abs()
        for position in ours.images.decoded_positions:  # the fallbacks: the CPU path's pixels
            assert difference[int(position)].max() < 0.51, position
        assert difference.mean() < 1.0
