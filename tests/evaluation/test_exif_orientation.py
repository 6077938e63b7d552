"""EXIF orientation in the evaluation readers: shards (retrieval, classification, images) and
folders decode a JPEG stored 64x32 with orientation 6 as 32x64, as ``prep folder`` writes it; a
JPEG without the tag is read as stored."""

from __future__ import annotations

import io
import tarfile

import torch
import torchvision.transforms as T
from PIL import Image

from vlcontrast.evaluation.datasets import (ClassificationDecoder, FolderEvalDataset,
                                            RetrievalDecoder, build_image_files_loader,
                                            build_image_shards_loader)

STORED, UPRIGHT = (64, 32), (32, 64)


def jpeg(orientation: int | None) -> bytes:
    image = Image.new("RGB", STORED, (200, 40, 40))
    image.paste((30, 60, 220), (STORED[0] // 2, 0, STORED[0], STORED[1]))
    buffer = io.BytesIO()
    options = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        options["exif"] = exif.tobytes()
    image.save(buffer, format="JPEG", quality=95, **options)
    return buffer.getvalue()


def shape(size):
    return (3, size[1], size[0])


def test_shard_decoders_turn_tagged_jpegs_upright():
    for orientation, size in ((6, UPRIGHT), (None, STORED), (1, STORED)):
        files = {"jpg": jpeg(orientation), "txt": b"a photo", "cls": b"3"}
        for alpha in ("white", "drop"):
            image, captions, transparent = RetrievalDecoder(T.ToTensor(), alpha=alpha)("0", files)
            assert tuple(image.shape) == shape(size) and captions == ["a photo"]
            image, label, _ = ClassificationDecoder(T.ToTensor(), alpha=alpha)("0", files)
            assert tuple(image.shape) == shape(size) and label == 3


def test_the_upright_image_is_the_left_half_on_top():
    image, _, _ = RetrievalDecoder(T.ToTensor())("0", {"jpg": jpeg(6), "txt": b"x"})
    # Orientation 6: the stored left (red) half ends up on top.
    assert image[0, :8].mean() > 0.6 and image[2, :8].mean() < 0.4
    assert image[0, -8:].mean() < 0.4 and image[2, -8:].mean() > 0.6


def test_shard_and_folder_loaders_turn_tagged_jpegs_upright(tmp_path):
    with tarfile.open(tmp_path / "00000.tar", "w") as archive:
        for key in ("000000000", "000000001"):
            info = tarfile.TarInfo(f"{key}.jpg")
            data = jpeg(6)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    loader = build_image_shards_loader(str(tmp_path / "00000.tar"), T.ToTensor(), batch_size=2)
    images = next(iter(loader.loader))[0]
    assert tuple(images.shape) == (2, *shape(UPRIGHT))

    paths = []
    for name, orientation in (("a.jpg", 6), ("b.jpg", 6)):
        (tmp_path / name).write_bytes(jpeg(orientation))
        paths.append(tmp_path / name)
    images = next(iter(build_image_files_loader(paths, T.ToTensor(), batch_size=2).loader))[0]
    assert tuple(images.shape) == (2, *shape(UPRIGHT))
    (tmp_path / "c.jpg").write_bytes(jpeg(None))
    _, (image, label, _) = FolderEvalDataset([(str(tmp_path / "c.jpg"), 0)], T.ToTensor(),
                                             0, 1)[0]
    assert tuple(image.shape) == shape(STORED)
    _, (image, label, _) = FolderEvalDataset([(str(paths[0]), 0)], T.ToTensor(), 0, 1)[0]
    assert tuple(image.shape) == shape(UPRIGHT) and isinstance(image, torch.Tensor)
