"""The bad-sample taxonomy and the checks behind it, shared by training, evaluation and the check.

One function, :func:`inspect_sample`, decides whether a row ``(key, {extension: bytes})`` is usable
and, if not, names the first reason, checked in this order:

=========================  ================================================================
``missing_image``          no ``.jpg/.jpeg/.png/.webp`` member
``missing_caption``        no ``.txt`` member
``caption_not_utf8``       the ``.txt`` bytes are not UTF-8
``empty_caption``          the ``.txt`` is only whitespace
``no_sample_id``           (training, the check) neither ``json["key"]`` nor the tar key is numeric
``sample_id_out_of_range`` (training, the check) the id is ``>= id_space``
``decompression_bomb``     more pixels than ``max_image_pixels`` (read from the header)
``undecodable_image``      PIL cannot decode the image
``transform_error``        (training, evaluation) the image transform raised
=========================  ================================================================

The training loader, retrieval evaluation and ``vlcontrast prep check`` all call it, so they skip
and count the same samples under the same names; sample ids are only asked for where they are used
(training, and the check). Zero-shot classification shards use the image checks plus
``missing_label`` (no integer ``.cls``). Shard events (``truncated_tar``, ``unreadable_shard``) and
``missing_samples`` (rows a shard of known size did not deliver) come from the tar reader. The
check also reports ``duplicate_key`` and ``invalid_json``, which no reader skips.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from PIL import Image

from vlcontrast.errors import LoaderError
from .tar_reader import SHARD_EVENTS

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
CAPTION_EXTENSION = "txt"
LABEL_EXTENSION = "cls"
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
"""PIL's own decompression-bomb warning threshold (``Image.MAX_IMAGE_PIXELS``)."""

CONTENT_REASONS = ("missing_image", "missing_caption", "caption_not_utf8", "empty_caption",
                   "decompression_bomb", "undecodable_image", "transform_error")
"""Why a sample is skipped wherever it is read (training, evaluation, the check)."""
ID_REASONS = ("no_sample_id", "sample_id_out_of_range")
"""Why a sample is skipped where sample ids are used (training; the check reports them)."""
LABEL_REASONS = ("missing_label",)
"""Why a classification sample is skipped (zero-shot shards)."""
SAMPLE_REASONS = ("missing_image", "undecodable_image", "decompression_bomb", "missing_caption",
                  "empty_caption", "caption_not_utf8", "no_sample_id", "sample_id_out_of_range",
                  "transform_error", "missing_samples")
"""Per-sample reasons of the training loader: each counts samples and enters the bad-sample rate."""
SHARD_REASONS = SHARD_EVENTS
"""Per-shard events: each counts shard reads that ended early (their lost rows are counted as
``missing_samples`` when the shard's size is known)."""
CHECK_ONLY_REASONS = ("duplicate_key", "invalid_json")
"""Reported by the check; no reader skips them."""


@dataclass(frozen=True)
class IdRule:
    """How a row's sample id is formed: ``int(json["key"] or tar key) + offset``, ``< space``."""
    offset: int = 0
    space: int = 0
    """0: unknown, not checked."""


@dataclass(frozen=True)
class Inspected:
    """A usable sample: the RGB image (None when images are not decoded), caption, id."""
    image: Image.Image | None
    caption: str
    sample_id: int | None


def find_image(members: dict[str, bytes]) -> bytes | None:
    return next((members[e] for e in IMAGE_EXTENSIONS if e in members), None)


def read_caption(members: dict[str, bytes]) -> str:
    """The stripped ``.txt`` caption, or the reason it is unusable."""
    raw = members.get(CAPTION_EXTENSION)
    if raw is None:
        return "missing_caption"
    try:
        caption = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return "caption_not_utf8"
    return caption if caption else "empty_caption"


def read_json(members: dict[str, bytes]) -> Any:
    """The parsed ``.json`` member; None when absent or not JSON."""
    if "json" not in members:
        return None
    try:
        return json.loads(members["json"])
    except ValueError:
        return None


def read_sample_id(key: str, members: dict[str, bytes], rule: IdRule) -> int | str:
    """``json["key"]`` when present, else the tar key's basename, plus the source offset."""
    meta = read_json(members)
    id_text = meta.get("key") if isinstance(meta, dict) else None
    if id_text is None:
        id_text = os.path.basename(key)
    id_text = str(id_text)
    if not id_text.isdigit():
        return "no_sample_id"
    sample_id = int(id_text) + rule.offset
    if rule.space and sample_id >= rule.space:
        return "sample_id_out_of_range"
    return sample_id


def open_image(image_bytes: bytes, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
               ) -> Image.Image | str:
    """The decoded RGB image, or ``decompression_bomb`` / ``undecodable_image``. The pixel count
    is read from the header, before anything is decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(image_bytes))
            width, height = image.size
            if width * height > max_image_pixels:
                return "decompression_bomb"
            return image.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return "decompression_bomb"
    except Exception:  # noqa: BLE001 - PIL raises many types for broken files
        return "undecodable_image"


def inspect_sample(key: str, members: dict[str, bytes], *, ids: IdRule | None = None,
                   max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                   decode_image: bool = True) -> Inspected | str:
    """The usable sample, or the first reason it is not (see the module docstring). ``ids`` None:
    sample ids are not asked for. ``decode_image`` False: only the image's presence is checked."""
    image_bytes = find_image(members)
    if image_bytes is None:
        return "missing_image"
    caption = read_caption(members)
    if caption in ("missing_caption", "caption_not_utf8", "empty_caption"):
        return caption
    sample_id = None
    if ids is not None:
        sample_id = read_sample_id(key, members, ids)
        if isinstance(sample_id, str):
            return sample_id
    image = None
    if decode_image:
        image = open_image(image_bytes, max_image_pixels)
        if isinstance(image, str):
            return image
    return Inspected(image, caption, sample_id)


def decode_sample(key: str, members: dict[str, bytes], *, preprocess: Callable, id_offset: int = 0,
                  id_space: int = 0, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
                  ) -> tuple[Any, str, int] | str:
    """Training: (image tensor, caption, sample id), or the reason the sample is unusable."""
    sample = inspect_sample(key, members, ids=IdRule(id_offset, id_space),
                            max_image_pixels=max_image_pixels)
    if isinstance(sample, str):
        return sample
    return transform_sample(sample, preprocess)


def transform_sample(sample: Inspected, preprocess: Callable) -> tuple[Any, str, int] | str:
    """(image tensor, caption, sample id) of an inspected sample, or ``transform_error``."""
    try:
        tensor = preprocess(sample.image)
    except Exception:  # noqa: BLE001 - counted; the rate limit stops systematic failures
        return "transform_error"
    return tensor, sample.caption, sample.sample_id  # type: ignore[return-value]


def read_label(members: dict[str, bytes]) -> int | str:
    """CLIP_benchmark's integer ``.cls`` label, or ``missing_label``."""
    raw = members.get(LABEL_EXTENSION)
    try:
        return int(raw.decode("utf-8").strip())  # type: ignore[union-attr]
    except (AttributeError, UnicodeDecodeError, ValueError):
        return "missing_label"


def count(counts: dict[str, int], reason: str, n: int = 1) -> None:
    counts[reason] = counts.get(reason, 0) + n


def bad_items(counts: dict[str, int]) -> int:
    """Skipped samples among ``counts`` (shard events and ``missing_samples`` excluded)."""
    return sum(counts.get(r, 0) for r in SAMPLE_REASONS if r != "missing_samples")


def bad_rate_error(bad: dict[str, int], examined: int, max_bad_fraction: float, where: str
                   ) -> LoaderError | None:
    """The error to raise when the bad-sample rate exceeds the limit, else None."""
    bad_total = sum(bad.get(r, 0) for r in SAMPLE_REASONS)
    denominator = examined + bad.get("missing_samples", 0)
    if denominator <= 0 or bad_total / denominator <= max_bad_fraction:
        return None
    detail = {k: v for k, v in sorted(bad.items()) if v}
    return LoaderError(
        f"{where}: {bad_total} of {denominator} samples were bad ({bad_total / denominator:.1%} > "
        f"data.max_bad_fraction={max_bad_fraction:.1%}); reasons {detail}. The shards look "
        "damaged or are not image/caption webdataset shards; fix them or raise "
        "data.max_bad_fraction")
