"""Fixtures for the data tests: tiny img2dataset-style shards written on the fly.

``make_shards(directory, sizes, ...)`` writes ``00000.tar`` ... with ``<key>.jpg/.txt/.json``
(9-digit keys ``shard * 10**4 + row``), ``sizes.json`` and ``manifest.json``. Every image is a flat
colour computed from its sample id and every caption names the id, so a test can check that
images, captions and ids stay aligned through the loader.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest
from PIL import Image

KEY_STRIDE = 10_000
IMAGE_SIZE = 8


def color_of(sample_id: int) -> tuple[int, int, int]:
    # Flat colours survive JPEG almost exactly; spread ids over the cube so neighbours differ.
    return (sample_id * 37) % 200 + 20, (sample_id * 91) % 200 + 20, (sample_id * 13) % 200 + 20


def caption_of(sample_id: int) -> str:
    return f"a picture of sample {sample_id}"


def jpeg_bytes(color=(128, 128, 128), size: int = IMAGE_SIZE) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def bomb_png(size: int = 64) -> bytes:
    """A valid PNG whose pixel count exceeds a small ``max_image_pixels``."""
    buffer = io.BytesIO()
    Image.new("L", (size, size), 0).save(buffer, format="PNG")
    return buffer.getvalue()


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shard(path: Path, rows: list[dict[str, bytes]]) -> None:
    """``rows``: [{"__key__": key, ext: bytes, ...}] written member by member."""
    with tarfile.open(path, "w") as tar:
        for row in rows:
            key = row["__key__"]
            for ext, data in row.items():
                if ext != "__key__":
                    add_member(tar, f"{key}.{ext}", data)


def sample_row(shard: int, row: int, *, kind: str = "good", json_key: bool = True) -> dict:
    """One row; ``kind`` selects a defect: undecodable, missing_image, missing_caption,
    empty_caption, not_utf8, bomb."""
    sample_id = shard * KEY_STRIDE + row
    key = f"{sample_id:09d}"
    image = jpeg_bytes(color_of(sample_id))
    caption = caption_of(sample_id).encode()
    meta = {"key": key, "caption": caption_of(sample_id)} if json_key else {"caption": "x"}
    out: dict[str, bytes] = {"__key__": key}  # type: ignore[dict-item]
    if kind == "undecodable":
        image = b"\xff\xd8\xff\xe0 this is not a jpeg"
    if kind == "bomb":
        out["png"] = bomb_png()
    elif kind != "missing_image":
        out["jpg"] = image
    if kind == "empty_caption":
        caption = b"   "
    if kind == "not_utf8":
        caption = b"\xff\xfe\xfa caption"
    if kind != "missing_caption":
        out["txt"] = caption
    out["json"] = json.dumps(meta).encode()
    return out


def add_cut_shard(directory, shard: int, rows: int) -> None:
    """Shard ``shard`` of ``rows`` good rows, cut in the middle of a member (a truncated tar),
    listed in ``sizes.json`` at its full size; ``manifest.json`` is removed (its ids would not
    cover the shard)."""
    directory = Path(directory)
    whole = directory / "whole.tar"
    write_shard(whole, [sample_row(shard, r) for r in range(rows)])
    data = whole.read_bytes()
    (directory / f"{shard:05d}.tar").write_bytes(data[: len(data) // 2 + 100])
    whole.unlink()
    sizes = json.loads((directory / "sizes.json").read_text())
    sizes[f"{shard:05d}.tar"] = rows
    (directory / "sizes.json").write_text(json.dumps(sizes))
    (directory / "manifest.json").unlink()


def make_shards(directory, sizes: list[int], *, first_shard: int = 0,
                defects: dict[tuple[int, int], str] | None = None, metadata: bool = True,
                json_key: bool = True) -> list[int]:
    """Write ``len(sizes)`` shards; returns the ids of the good samples."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    defects = defects or {}
    good: list[int] = []
    size_map = {}
    for offset, size in enumerate(sizes):
        shard = first_shard + offset
        rows = []
        for row in range(size):
            kind = defects.get((shard, row), "good")
            rows.append(sample_row(shard, row, kind=kind, json_key=json_key))
            if kind == "good":
                good.append(shard * KEY_STRIDE + row)
        name = f"{shard:05d}.tar"
        write_shard(directory / name, rows)
        size_map[name] = size
    if metadata:
        (directory / "sizes.json").write_text(json.dumps(size_map))
        last = first_shard + len(sizes) - 1
        manifest = {"num_samples": sum(sizes), "num_shards": len(sizes),
                    "id_space": (last + 1) * KEY_STRIDE, "key_stride": KEY_STRIDE,
                    "shards": size_map}
        (directory / "manifest.json").write_text(json.dumps(manifest))
    return good


UNEVEN_SIZES = [23, 17, 30, 12, 26, 20]
"""128 samples in six shards of unequal size."""


@pytest.fixture(scope="session")
def uneven_shards(tmp_path_factory) -> tuple[str, list[int]]:
    """(pattern, good ids) of six clean shards of unequal sizes."""
    directory = tmp_path_factory.mktemp("uneven")
    good = make_shards(directory, UNEVEN_SIZES)
    return os.path.join(str(directory), "{00000..00005}.tar"), good
