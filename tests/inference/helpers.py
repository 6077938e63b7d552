"""Shared by the inference tests: a folder of the user's own images (nested, odd names, one
broken file, one non-image) and the embeddings open_clip's calls give for them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

from tests.evaluation.helpers import image_bytes

IMAGES = {  # relative path -> (generator index, format), in find_images' order: a folder's
    "Holiday photo (2).PNG": (1, "PNG"),     # files sorted, then its sub-folders sorted
    "b_cat.jpg": (2, "JPEG"),
    "nested/x.bmp": (4, "BMP"),
    "nested/ünïcode.gif": (5, "GIF"),
    "nested/deeper/zebra crossing.webp": (3, "WEBP"),
}
BROKEN = "corrupt.jpg"                       # found between b_cat.jpg and nested/


def write_user_images(folder: Path) -> list[Path]:
    """The readable images in the order ``find_images`` walks them; writes a broken JPEG and a
    text file beside them."""
    folder = Path(folder)
    for relative, (index, fmt) in IMAGES.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_bytes(image_bytes(index, fmt))
    (folder / BROKEN).write_bytes(b"\xff\xd8 not really a jpeg")
    (folder / "notes.txt").write_text("not an image")
    return [folder / relative for relative in IMAGES]


@torch.no_grad()
def reference_image_features(model, preprocess, paths) -> torch.Tensor:
    images = torch.stack([preprocess(Image.open(path).convert("RGB")) for path in paths])
    return F.normalize(model.encode_image(images).float(), dim=-1)


@torch.no_grad()
def reference_text_features(model, tokenizer, texts) -> torch.Tensor:
    return F.normalize(model.encode_text(tokenizer(list(texts))).float(), dim=-1)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """``vlcontrast ARGS`` in this process: (exit code, stdout, stderr)."""
    from vlcontrast import cli

    capsys.readouterr()
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def parse_json(text: str) -> dict:
    return json.loads(text)
