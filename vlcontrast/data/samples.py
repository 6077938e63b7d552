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
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from PIL import Image

from vlcontrast.errors import LoaderError
from .crops import image_digest
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
                  "transform_error", "not_in_feature_cache", "missing_samples")
"""Per-sample reasons of the training loader: each counts samples and enters the bad-sample rate.
``not_in_feature_cache``: under ``model.lock_image_features`` images are not decoded, and a sample
the cache does not hold (its image failed when the cache was written) is skipped instead."""
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
    required: bool = True
    """False: a row without a numeric id is kept, with sample id -1 (``NO_ID``)."""


NO_ID = -1
"""The sample id of a row whose key is not a number, where ids are not required."""


@dataclass(frozen=True)
class Members:
    """Which members hold the image and the caption(s): ``data.image_key`` and
    ``data.caption_key``, each ``;``-separated.

    Images: the first extension present wins (``jpg;png;webp``). Captions: every key present
    contributes (``txt``, ``json:caption``; a JSON field may name a list, and dots reach into
    nested objects: ``json:meta.caption``); duplicates are dropped. One caption gives the plain
    string, several give a tuple, from which the loader draws one per image per epoch."""
    image: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")
    caption: tuple[str, ...] = ("txt",)

    @classmethod
    def parse(cls, image_key: str = "", caption_key: str = "") -> "Members":
        image = tuple(p.strip().lower() for p in image_key.split(";") if p.strip())
        caption = tuple(p.strip() for p in caption_key.split(";") if p.strip())
        return cls(image or cls.image, caption or cls.caption)


DEFAULT_MEMBERS = Members()

MEMBER_KEYS = re.compile(r"\s*[A-Za-z0-9_.-]+(:[A-Za-z0-9_.-]+)?\s*(;\s*[A-Za-z0-9_.-]+"
                         r"(:[A-Za-z0-9_.-]+)?\s*)*")
"""The grammar of ``data.image_key``/``data.caption_key``: ``;``-separated ``ext[:json.field]``."""


def check_member_keys(image_key: str, caption_key: str, where: str) -> None:
    """A one-line :class:`~vlcontrast.errors.DataPrepError` for malformed member keys."""
    from vlcontrast.errors import DataPrepError

    for name, value in (("--image-key", image_key), ("--caption-key", caption_key)):
        if not MEMBER_KEYS.fullmatch(value):
            raise DataPrepError(f"{where}: {name}={value!r}: expected ;-separated member names "
                                "such as 'jpg;png;webp' or 'txt;json:caption'")
    if ":" in image_key:
        raise DataPrepError(f"{where}: --image-key={image_key!r}: images are whole members "
                            "(jpg, png, ...), not JSON fields")


@dataclass(frozen=True)
class Inspected:
    """A usable sample: the RGB image (None when images are not decoded), caption, id."""
    image: Image.Image | None
    caption: str | tuple[str, ...]
    """One caption, or several (a tuple) from which training draws one per epoch."""
    sample_id: int | None
    digest: int | None = None
    """The CRC-32 of the encoded image (:func:`~vlcontrast.data.crops.image_digest`): what seeds
    the image's augmentation on either decode path."""


def find_image(members: dict[str, bytes], extensions: tuple[str, ...] = IMAGE_EXTENSIONS
               ) -> bytes | None:
    return next((members[e] for e in extensions if e in members), None)


def _caption_values(members: dict[str, bytes], key: str) -> list[str] | str | None:
    """Caption strings under one caption key, a reason, or None when the key is absent."""
    ext, _, field = key.partition(":")
    raw = members.get(ext.lower())
    if raw is None:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "caption_not_utf8"
    if not field and ext.lower() != "json":
        return [text]
    try:
        value: Any = json.loads(text)
    except ValueError:
        return None
    for part in field.split(".") if field else ():
        value = value.get(part) if isinstance(value, dict) else None
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, str)]
    return None


def read_caption(members: dict[str, bytes], keys: tuple[str, ...] = (CAPTION_EXTENSION,)
                 ) -> str | tuple[str, ...]:
    """The stripped caption (a tuple when the keys hold several different ones), or the reason
    it is unusable: ``missing_caption`` (no key present), ``caption_not_utf8``,
    ``empty_caption`` (only whitespace)."""
    found: list[str] = []
    reason = "missing_caption"
    for key in keys:
        values = _caption_values(members, key)
        if values is None:
            continue
        if isinstance(values, str):
            reason = values if reason == "missing_caption" else reason
            continue
        reason = "empty_caption"
        found.extend(v.strip() for v in values if v.strip())
    if not found:
        return reason
    unique = tuple(dict.fromkeys(found))
    return unique[0] if len(unique) == 1 else unique


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
        if not rule.required and os.path.basename(key).isdigit():
            id_text = os.path.basename(key)  # a json "key" of another kind: the tar key
        elif rule.required:
            return "no_sample_id"
        else:
            return NO_ID
    if not rule.required and not rule.space:
        return int(id_text) + rule.offset
    sample_id = int(id_text) + rule.offset
    if rule.space and sample_id >= rule.space:
        return "sample_id_out_of_range"
    return sample_id


EXIF_ORIENTATION = 0x0112
"""The EXIF tag that says how a camera's stored pixels must be turned to stand upright."""
_EXIF_FORMATS = frozenset({"JPEG", "MPO", "TIFF", "WEBP", "PNG"})
"""The formats that carry EXIF (PIL's ``info["exif"]``; TIFF in its own tags)."""
_EXIF_INFO_KEYS = ("exif", "xmp", "XML:com.adobe.xmp", "Raw profile type exif")
"""Where PIL's ``getexif`` finds an orientation (EXIF, or XMP's ``tiff:Orientation``)."""
_ORIENTATIONS = frozenset(range(2, 9))
"""The orientations that move pixels (1 is upright; other values are ignored, as PIL does)."""


def exif_orientation(image: Image.Image) -> int:
    """The EXIF orientation (2-8) of an opened image, else 1, read from its header without
    decoding pixels; only a JPEG/MPO/TIFF/WebP/PNG file that carries EXIF (or XMP) metadata is
    parsed, and malformed metadata counts as 1 (the pixels as stored). A PNG's ``eXIf`` chunk may
    follow its pixels: PIL only sees it once the image is loaded (as :func:`upright` does)."""
    if image.format not in _EXIF_FORMATS:
        return 1  # also any image made in memory (a convert, a crop): no second rotation
    if image.format != "TIFF" and not any(k in image.info for k in _EXIF_INFO_KEYS):
        return 1
    try:
        orientation = image.getexif().get(EXIF_ORIENTATION, 1)
    except Exception:  # noqa: BLE001 - unreadable metadata: the pixels as stored
        return 1
    return orientation if orientation in _ORIENTATIONS else 1


def upright(image: Image.Image) -> Image.Image:
    """The image turned/flipped as its EXIF orientation says (:func:`exif_orientation`,
    ``ImageOps.exif_transpose``, which also drops the tag); the same image, loaded, when there is
    nothing to do. The first step of :func:`to_rgb`."""
    image.load()
    if exif_orientation(image) == 1:
        return image
    from PIL import ImageOps

    return ImageOps.exif_transpose(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, upright (the EXIF orientation applied, :func:`upright`), with any transparency (RGBA,
    LA, palette transparency) composited on white and 16-bit grey scaled to 8 bits: the one rule
    of the converters and of every reader, so that a transparent PNG or a phone photo shot
    sideways looks the same in training (either decode path), evaluation, ``classify``,
    ``embed`` and ``vlcontrast.load``'s preprocess as after ``vlcontrast prep folder``."""
    image = upright(image)
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, rgba)
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        image = image.point(lambda v: v / 256).convert("L")
    return image.convert("RGB")


ALPHA_RULES = ("white", "drop")
"""What a reader does with transparency. ``white``: composite it on white (:func:`to_rgb`), the
rule of the converters and of training. ``drop``: ``convert("RGB")`` right after decoding, which
throws the alpha channel away and keeps whatever colour the transparent pixels store (often
black): what open_clip's transforms, CLIP_benchmark's readers and transformers' processors do."""
TRAINING_ALPHA = "white"
"""The rule every vlcontrast model is trained with (the converters and the training reader)."""


def has_transparency(image: Image.Image) -> bool:
    """Whether :func:`to_rgb` would change the image's pixels: an alpha channel (or palette
    transparency) with at least one pixel that is not fully opaque."""
    if image.mode == "P":
        if "transparency" not in image.info:
            return False
        image = image.convert("RGBA")
    if image.mode not in ("RGBA", "LA", "PA", "RGBa", "La"):
        return False
    return image.getchannel("A").getextrema()[0] < 255


def check_alpha(alpha: str, what: str = "--alpha") -> str:
    """``alpha`` when it is one of :data:`ALPHA_RULES`, else a one-line error."""
    from vlcontrast.errors import ConfigError

    if alpha not in ALPHA_RULES:
        raise ConfigError(f"{what} {alpha!r}: use white (transparency on white, as in training) "
                          "or drop (open_clip's and CLIP_benchmark's convert(\"RGB\"))")
    return alpha


def alpha_summary(transparent: int, total: int, alpha: str) -> str:
    """The line the commands print: how many images had transparency and which rule read them."""
    rule = ("composited on white, as in training" if alpha == "white" else
            "alpha dropped by convert(\"RGB\"), as open_clip and CLIP_benchmark read images")
    return f"{transparent} of {total} images had transparency; --alpha {alpha}: {rule}"


def pixels_hint(reasons: dict[str, int], max_image_pixels: int | None,
                option: str = "--max-image-pixels") -> str:
    """``; raise --max-image-pixels (now 89,478,485) if you trust these files`` when ``reasons``
    count ``decompression_bomb`` skips and the limit is known, else ``""``; ``option``: how the
    limit is set (``data.max_image_pixels`` in training)."""
    if not reasons.get("decompression_bomb") or max_image_pixels is None:
        return ""
    return f"; raise {option} (now {max_image_pixels:,}) if you trust these files"


def skipped_summary(skipped: int, total: int, reasons: dict[str, int],
                    names: Sequence[str] = (), limit: int = 3, *,
                    max_image_pixels: int | None = None, option: str = "--max-image-pixels",
                    noun: str = "images") -> str:
    """The line the commands print for skipped images: ``skipped 2 of 10 images
    (undecodable_image: 2): a.png, b.jpg`` (the first ``limit`` of ``names``, when given), ending
    in :func:`pixels_hint` when ``max_image_pixels`` is given. Shard events among ``reasons``
    (:data:`SHARD_EVENTS`: whole input shards, not samples) are listed apart, after the samples:
    ``...; input shards: 1 truncated_tar``, so the reasons in parentheses sum to ``skipped``."""
    samples, events = split_shard_events(reasons)
    why = ", ".join(f"{reason}: {n}" for reason, n in sorted(samples.items()))
    shown = ", ".join(str(name) for name in names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return (f"skipped {skipped} of {total} {noun}" + (f" ({why})" if why else "")
            + (f": {shown}{more}" if shown else "")
            + (f"; {shard_events_text(events)}" if events else "")
            + pixels_hint(reasons, max_image_pixels, option))


def split_shard_events(reasons: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """``reasons`` -> (per-sample reasons, shard events): the counts of skipped samples, which sum
    to the samples skipped, apart from the events of whole shards (:data:`SHARD_EVENTS`)."""
    samples = {r: n for r, n in reasons.items() if r not in SHARD_EVENTS}
    events = {r: n for r, n in reasons.items() if r in SHARD_EVENTS}
    return samples, events


def shard_events_text(events: dict[str, int]) -> str:
    """``input shards: 2 truncated_tar`` (as ``vlcontrast prep`` words them), or ``""``."""
    if not events:
        return ""
    return "input shards: " + ", ".join(f"{n} {r}" for r, n in sorted(events.items()))


def decode_image(image_bytes: bytes, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 alpha: str = TRAINING_ALPHA) -> tuple[Image.Image, bool] | str:
    """``(RGB image, whether it had transparency)`` under the rule ``alpha``
    (:data:`ALPHA_RULES`), upright under either rule (:func:`upright`), or the reason it cannot
    be used (as :func:`open_image`)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(image_bytes))
            width, height = image.size
            if width * height > max_image_pixels:
                return "decompression_bomb"
            image.load()
        with warnings.catch_warnings():
            # PIL's advice to convert palette images with transparency to RGBA first: the rule
            # decides that, and "drop" must not.
            warnings.filterwarnings("ignore", message="Palette images with Transparency")
            transparent = has_transparency(image)
            return (to_rgb(image) if alpha == "white" else upright(image).convert("RGB")), \
                transparent
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return "decompression_bomb"
    except Exception:  # noqa: BLE001 - PIL raises many types for broken files
        return "undecodable_image"


def open_image(image_bytes: bytes, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
               ) -> Image.Image | str:
    """The decoded RGB image (upright, transparency on white: :func:`to_rgb`), or
    ``decompression_bomb`` / ``undecodable_image``. The pixel count is read from the header,
    before anything is decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(image_bytes))
            width, height = image.size
            if width * height > max_image_pixels:
                return "decompression_bomb"
            return to_rgb(image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return "decompression_bomb"
    except Exception:  # noqa: BLE001 - PIL raises many types for broken files
        return "undecodable_image"


def inspect_sample(key: str, members: dict[str, bytes], *, ids: IdRule | None = None,
                   max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                   decode_image: bool = True, keys: Members = DEFAULT_MEMBERS
                   ) -> Inspected | str:
    """The usable sample, or the first reason it is not (see the module docstring). ``ids`` None:
    sample ids are not asked for. ``decode_image`` False: only the image's presence is checked.
    ``keys``: the image and caption members (``data.image_key``, ``data.caption_key``)."""
    image_bytes = find_image(members, keys.image)
    if image_bytes is None:
        return "missing_image"
    caption = read_caption(members, keys.caption)
    if caption in ("missing_caption", "caption_not_utf8", "empty_caption"):
        return caption  # type: ignore[return-value]
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
    return Inspected(image, caption, sample_id, image_digest(image_bytes))


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
        if getattr(preprocess, "takes_digest", False) and sample.digest is not None:
            tensor = preprocess(sample.image, digest=sample.digest)
        else:
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


def bad_rate_error(bad: dict[str, int], examined: int, max_bad_fraction: float, where: str,
                   max_image_pixels: int | None = None) -> LoaderError | None:
    """The error to raise when the bad-sample rate exceeds the limit, else None; with
    ``max_image_pixels`` (``data.max_image_pixels``) it ends in :func:`pixels_hint` when images
    were skipped as ``decompression_bomb``; when most are ``missing_caption``/``missing_image`` it
    names ``data.caption_key``/``data.image_key`` instead. Counts are per read (a worker short of
    good samples reads rows again), which the error says where most samples were bad."""
    bad_total = sum(bad.get(r, 0) for r in SAMPLE_REASONS)
    denominator = examined + bad.get("missing_samples", 0)
    if denominator <= 0 or bad_total / denominator <= max_bad_fraction:
        return None
    detail = {k: v for k, v in sorted(bad.items()) if v}
    if bad.get("no_sample_id", 0) + bad.get("sample_id_out_of_range", 0) > bad_total / 2:
        return LoaderError(
            f"{where}: {bad_total} of {denominator} samples were bad, most for want of a usable "
            f"numeric sample id; reasons {detail}. Re-key the shards with `vlcontrast prep wds "
            "SHARDS OUT` (dense ids; a loss without per-sample state needs none), or set "
            "data.id_space to cover the ids")
    # A worker left short of good samples reads rows again (plan.spare_segments goes around the
    # shards once more), so where nearly everything is bad a sample can be counted twice.
    reads = ("; counted per read: a worker short of good samples reads the shards again, so "
             "one sample can count more than once" if bad_total * 2 > denominator else "")
    missing_key = next((option for reason, option in (("missing_caption", "data.caption_key"),
                                                      ("missing_image", "data.image_key"))
                        if bad.get(reason, 0) * 2 > bad_total), None)
    if missing_key is not None:
        example = ("data.caption_key=json:caption when the captions are in the .json"
                   if missing_key == "data.caption_key" else "data.image_key=gif for .gif images")
        return LoaderError(
            f"{where}: {bad_total} of {denominator} samples were bad "
            f"({bad_total / denominator:.1%} > data.max_bad_fraction={max_bad_fraction:.1%}"
            f"{reads}); "
            f"reasons {detail}. Most have no member matching {missing_key}: set it to the member "
            f"that holds it (e.g. {example}; `vlcontrast prep check SHARDS` names the members "
            "the samples have)")
    return LoaderError(
        f"{where}: {bad_total} of {denominator} samples were bad ({bad_total / denominator:.1%} > "
        f"data.max_bad_fraction={max_bad_fraction:.1%}{reads}); reasons {detail}. The shards look "
        "damaged or are not image/caption webdataset shards; fix them or raise "
        "data.max_bad_fraction" + pixels_hint(bad, max_image_pixels, "data.max_image_pixels"))
