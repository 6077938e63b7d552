"""Helpers shared by the data tests: tiny img2dataset-style shards written on the fly.

``make_shards(directory, sizes, ...)`` writes ``00000.tar`` ... with ``<key>.jpg/.txt/.json``
(9-digit keys ``shard * 10**4 + row``), ``sizes.json`` and ``manifest.json``. Every image is a flat
colour computed from its sample id and every caption names the id, so a test can check that
images, captions and ids stay aligned through the loader.
"""

from __future__ import annotations

import io
import json
import tarfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
import torchvision.transforms as T
from PIL import Image

from vlcontrast.config import DataConfig

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


# ---------------------------------------------------------------------------------------------
# the loader under test, with cheap stand-ins

PREPROCESS = T.Compose([T.Resize(IMAGE_SIZE), T.CenterCrop(IMAGE_SIZE), T.ToTensor()])


class CountingTokenizer:
    """Cheap stand-in for the open_clip tokenizer: the sample number at position 0."""

    def __call__(self, texts):
        return torch.tensor([[int(t.split()[-1]), len(t)] for t in texts])


def config(train: str, **overrides) -> DataConfig:
    values = dict(train=train, batch_size=4, workers=0, shuffle_buffer=8, max_bad_fraction=0.5)
    values.update(overrides)
    return DataConfig(**values)


def run_epoch(loader) -> list[list[int]]:
    return [batch.sample_ids.tolist() for batch in loader]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


# ---------------------------------------------------------------------------------------------
# a local image server for the URL converters (127.0.0.1, an ephemeral port; nothing else)


SLOW_S = 3.0
"""Seconds the server's /slow.jpg takes (the CC3M test's download timeout is shorter)."""


def jpeg_of(color: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="JPEG")
    return buffer.getvalue()


class ImageServer:
    """Images by path: /good/<i>.jpg, /missing.jpg (404), /corrupt.jpg, /slow.jpg, /flaky.jpg."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.flaky_calls = 0
        self.lock = threading.Lock()
        self.good = {f"/good/{i}.jpg": jpeg_of((40 * i, 200 - 30 * i, 90), (80 + 10 * i, 60))
                     for i in range(5)}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep pytest output clean
                pass

            def do_GET(self) -> None:
                with server.lock:
                    server.hits.append(self.path)
                if self.path in server.good:
                    self._send(200, server.good[self.path])
                elif self.path == "/corrupt.jpg":
                    self._send(200, b"\xff\xd8\xff\xe0 definitely not a jpeg" * 10)
                elif self.path == "/slow.jpg":
                    time.sleep(SLOW_S)
                    self._send(200, server.good["/good/0.jpg"])
                elif self.path == "/flaky.jpg":
                    with server.lock:
                        server.flaky_calls += 1
                        first = server.flaky_calls == 1
                    if first:
                        self._send(503, b"try again")
                    else:
                        self._send(200, server.good["/good/1.jpg"])
                else:
                    self._send(404, b"not found")

            def _send(self, status: int, body: bytes) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "image/jpeg" if status == 200 else "text/plain")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return self.base + path
