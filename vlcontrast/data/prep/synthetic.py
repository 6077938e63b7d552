"""A procedural image-caption world: the default dataset, small enough to train on a laptop CPU.

A scene is one to three flat shapes (10 shapes x 10 colours x 3 sizes, on a 3x3 grid of
positions) over a coloured background with an optional brightness gradient and sensor-like noise.
Captions are written from the scene's attributes with paraphrase variety: synonyms for sizes,
colours, positions and relations, several sentence frames, attributes sometimes left out, and the
object order of two-object scenes sometimes swapped ("a small red circle to the left of a blue
square" / "a blue square to the right of a small red circle").

:func:`write_synthetic` writes three things, the first two exactly as img2dataset writes CC3M
(``<key>.jpg/.txt/.json`` in ``00000.tar`` ..., 9-digit keys ``shard*10^4 + row``, ``sizes.json``,
``manifest.json``, ``00000_stats.json``) so the same loader reads both::

    OUT/train/     training shards
    OUT/val/       held-out shards (retrieval evaluation, validation loss)
    OUT/zeroshot/  ImageFolder of single-shape images, one folder per shape, with
                   classnames.txt (the shape words the captions use) and templates.txt

Every sample is a pure function of ``(seed, split, index)``, so the output is byte-identical for a
seed whatever the number of worker processes. See ``docs/data.md``.

Ctrl-C (SIGINT, to the process or its group) stops the worker processes (they ignore it; the
parent terminates them, as :mod:`.writer` does), removes what the shards not yet finished left
(their ``.tmp``, a shard renamed without its whole stats) and raises ``KeyboardInterrupt``, which
the command line ends as one line, exit 130. ``synthetic.json`` is not written, so the folder is
not taken for a finished world; running the command again writes it whole.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import multiprocessing
import os
import random
import signal
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from vlcontrast.errors import DataPrepError

from ..naming import make_key, shard_name
from ..shards import build_manifest, write_manifest, write_sizes
from .writer import (SPLITS, SYNTHETIC_FILE, ZEROSHOT_LISTS, _no_interrupts, earlier_prep,
                     prepare_layout, refuse_unrecorded, remove_earlier_prep, remove_files,
                     zeroshot_files)

SHAPES = ("circle", "crescent", "cross", "diamond", "heart", "hexagon", "ring", "square", "star",
          "triangle")
"""Shape names, sorted: they are also the zero-shot class names and folder names."""

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35), "green": (40, 165, 50), "blue": (35, 70, 215),
    "yellow": (240, 215, 35), "orange": (245, 135, 25), "purple": (135, 45, 175),
    "pink": (245, 125, 190), "white": (245, 245, 245), "black": (20, 20, 20),
    "brown": (125, 75, 35),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "gray": (128, 128, 128), "light gray": (200, 200, 200), "dark gray": (60, 60, 60),
    "beige": (225, 210, 175), "light blue": (170, 200, 235), "light green": (185, 225, 170),
    "navy": (25, 35, 80), "cream": (250, 245, 225),
}
SIZES: dict[str, tuple[float, float]] = {
    "small": (0.09, 0.12), "medium": (0.14, 0.18), "large": (0.23, 0.30),
}
"""Object radius as a fraction of the image side."""
COLUMNS = ("left", "center", "right")
ROWS = ("top", "middle", "bottom")

TEMPLATES = (
    "a {c}.",
    "a photo of a {c}.",
    "a picture of a {c}.",
    "an image of a {c}.",
    "a drawing of a {c}.",
    "there is a {c} in the picture.",
    "a {c} on a plain background.",
    "a small {c}.",
    "a large {c}.",
)
"""Zero-shot prompt templates; ``{c}`` is replaced by a class name."""

WORLD_VERSION = 2
"""Changes whenever the same seed would render different samples (scene, caption or image rules).
Written to ``synthetic.json``; the loss study hashes it into its cells' fingerprints, so results
made on another version of the world are not mixed with new ones. 2: a quarter of object phrases
leave the colour out."""

COLORLESS_PHRASE_WEIGHT = 0.25
"""Share of object phrases that name size and shape but no colour (``a large star``). Colour,
position and background already tell most scenes in a batch apart, so a model trained on
fully-detailed captions learns shapes last; captions without the colour make the shape the only
match, which is what zero-shot shape classification (prompts without colours) needs."""

OBJECT_COUNT_WEIGHTS = (0.55, 0.33, 0.12)
"""How often a scene holds 1, 2 or 3 objects (the world's default)."""
SINGLE_FRAME_WEIGHTS = (0.22, 0.12, 0.14, 0.1, 0.1, 0.12, 0.1, 0.1)
"""Caption frames of one-object scenes; frame 3 is the bare object phrase (``a large star``)."""
BARE_FRAME = 3


@dataclass(frozen=True)
class TrainMix:
    """What the *training* split emphasises; validation and zero-shot always use the defaults.

    ``single_object``: share of scenes with one object (the rest keep the default 2:3-object
    ratio). ``colorless``: share of object phrases without the colour (see
    ``COLORLESS_PHRASE_WEIGHT``). ``bare``: share of one-object captions that are the object
    phrase alone, without position, background or framing words (the other frames keep their
    ratios). The defaults reproduce the world exactly, sample by sample.
    """

    single_object: float = OBJECT_COUNT_WEIGHTS[0]
    colorless: float = COLORLESS_PHRASE_WEIGHT
    bare: float = SINGLE_FRAME_WEIGHTS[BARE_FRAME]

    def __post_init__(self) -> None:
        if not 0.0 <= self.single_object <= 1.0:
            raise DataPrepError(f"prep synthetic: --single-object={self.single_object}: must be in "
                                 "[0, 1]")
        if not 0.0 <= self.colorless <= 0.72:
            raise DataPrepError(f"prep synthetic: --colorless={self.colorless}: must be in "
                                "[0, 0.72] (the share of phrases in the plain 'size colour "
                                "shape' form it replaces)")
        if not 0.0 <= self.bare <= 1.0:
            raise DataPrepError(f"prep synthetic: --bare={self.bare}: must be in [0, 1]")

    @property
    def is_default(self) -> bool:
        return self == TrainMix()

    def object_weights(self) -> tuple[float, float, float]:
        if self.single_object == OBJECT_COUNT_WEIGHTS[0]:
            return OBJECT_COUNT_WEIGHTS  # the default draws, bit for bit
        rest = sum(OBJECT_COUNT_WEIGHTS[1:])
        return (self.single_object, *(w / rest * (1.0 - self.single_object) for w in OBJECT_COUNT_WEIGHTS[1:]))

    def single_frame_weights(self) -> tuple[float, ...]:
        if self.bare == SINGLE_FRAME_WEIGHTS[BARE_FRAME]:
            return SINGLE_FRAME_WEIGHTS
        rest = 1.0 - SINGLE_FRAME_WEIGHTS[BARE_FRAME]
        return tuple(self.bare if i == BARE_FRAME else w / rest * (1.0 - self.bare)
                     for i, w in enumerate(SINGLE_FRAME_WEIGHTS))


SPLIT_CODES = {"train": 1, "val": 2, "zeroshot": 3}
"""Each split draws from its own random streams, so validation scenes are not training scenes."""

MIN_COLOR_DISTANCE = 110.0
"""Object colours closer than this (RGB euclidean) to the background are redrawn."""

# ---------------------------------------------------------------------------------------------
# scenes


@dataclass
class SceneObject:
    shape: str
    color: str
    size: str
    column: str
    row: str
    x: float
    """Centre, as a fraction of the image side."""
    y: float
    radius: float
    """Fraction of the image side."""
    rotation: float
    """Degrees."""
    rgb: tuple[int, int, int]


@dataclass
class Scene:
    objects: list[SceneObject]
    background: str
    background_rgb: tuple[int, int, int]
    gradient: float
    """Brightness change across the image (-0.3 .. 0.3); 0 for a flat background."""
    gradient_axis: int
    noise: float
    """Standard deviation of the additive pixel noise (0-255 scale)."""
    noise_offset: tuple[int, int] = field(default=(0, 0))


def _jitter_rgb(rgb: tuple[int, int, int], rng: random.Random, amount: int) -> tuple[int, int, int]:
    return tuple(min(255, max(0, c + rng.randint(-amount, amount))) for c in rgb)  # type: ignore


def _color_distance(a: tuple[int, int, int], b: tuple[int, int, int]) -> float:
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))


def sample_scene(rng: random.Random, *, num_objects: int | None = None,
                 shape: str | None = None,
                 object_weights: tuple[float, float, float] = OBJECT_COUNT_WEIGHTS) -> Scene:
    """Draw a scene. ``num_objects``/``shape`` pin the count and the first object's shape;
    otherwise the count is drawn with ``object_weights`` (1, 2, 3 objects)."""
    background = rng.choice(list(BACKGROUNDS))
    background_rgb = _jitter_rgb(BACKGROUNDS[background], rng, 12)
    if num_objects is None:
        num_objects = rng.choices((1, 2, 3), weights=object_weights)[0]
    gradient = rng.uniform(-0.3, 0.3) if rng.random() < 0.4 else 0.0
    noise = rng.choice((0.0, rng.uniform(2.0, 8.0), rng.uniform(8.0, 20.0)))
    objects: list[SceneObject] = []
    used_cells: set[tuple[int, int]] = set()
    for index in range(num_objects):
        for _attempt in range(20):
            col, row = rng.randrange(3), rng.randrange(3)
            if (col, row) in used_cells:
                continue
            if num_objects == 1:
                size = rng.choice(list(SIZES))
            else:
                size = rng.choice(("small", "medium"))
            radius = rng.uniform(*SIZES[size])
            # Cell centres at 1/6, 1/2, 5/6 of the side, jittered, kept inside the image.
            x = min(max((col + 0.5) / 3 + rng.uniform(-0.05, 0.05), radius + 0.01), 0.99 - radius)
            y = min(max((row + 0.5) / 3 + rng.uniform(-0.05, 0.05), radius + 0.01), 0.99 - radius)
            if all(math.hypot(x - o.x, y - o.y) > radius + o.radius + 0.02 for o in objects):
                break
        else:
            break  # no free room left: a scene with fewer objects
        used_cells.add((col, row))
        object_shape = shape if (shape is not None and index == 0) else rng.choice(SHAPES)
        while True:
            color = rng.choice(list(COLORS))
            rgb = _jitter_rgb(COLORS[color], rng, 15)
            if _color_distance(rgb, background_rgb) >= MIN_COLOR_DISTANCE:
                break
        objects.append(SceneObject(
            shape=object_shape, color=color, size=size, column=COLUMNS[col], row=ROWS[row],
            x=round(x, 4), y=round(y, 4), radius=round(radius, 4),
            rotation=round(rng.uniform(-15.0, 15.0), 2), rgb=rgb))
    return Scene(objects=objects, background=background, background_rgb=background_rgb,
                 gradient=round(gradient, 4), gradient_axis=rng.randrange(2),
                 noise=round(noise, 3), noise_offset=(rng.randrange(1 << 16), rng.randrange(1 << 16)))


# ---------------------------------------------------------------------------------------------
# rendering


def _regular(n: int, start: float = -90.0) -> list[tuple[float, float]]:
    return [(math.cos(math.radians(start + 360.0 * i / n)), math.sin(math.radians(start + 360.0 * i / n)))
            for i in range(n)]


def _star() -> list[tuple[float, float]]:
    points = []
    for i in range(10):
        r = 1.0 if i % 2 == 0 else 0.42
        angle = math.radians(-90.0 + 36.0 * i)
        points.append((r * math.cos(angle), r * math.sin(angle)))
    return points


def _heart() -> list[tuple[float, float]]:
    points = []
    for i in range(32):
        t = 2 * math.pi * i / 32
        x = 16 * math.sin(t) ** 3
        y = 13 * math.cos(t) - 5 * math.cos(2 * t) - 2 * math.cos(3 * t) - math.cos(4 * t)
        points.append((x / 17.0, -(y + 2.5) / 17.0))
    return points


_ARM = 0.33
_POLYGONS: dict[str, list[tuple[float, float]]] = {
    "square": [(-0.82, -0.82), (0.82, -0.82), (0.82, 0.82), (-0.82, 0.82)],
    "triangle": [(0.0, -1.0), (0.92, 0.72), (-0.92, 0.72)],
    "star": _star(),
    "cross": [(-_ARM, -1), (_ARM, -1), (_ARM, -_ARM), (1, -_ARM), (1, _ARM), (_ARM, _ARM),
              (_ARM, 1), (-_ARM, 1), (-_ARM, _ARM), (-1, _ARM), (-1, -_ARM), (-_ARM, -_ARM)],
    "diamond": [(0.0, -1.0), (0.62, 0.0), (0.0, 1.0), (-0.62, 0.0)],
    "hexagon": _regular(6, start=0.0),
    "heart": _heart(),
}


def _shape_mask(shape: str, radius_px: float, rotation: float) -> Image.Image:
    """Anti-aliased ``L`` mask of one shape: drawn at 4x and box-reduced."""
    scale = 4
    side = int(math.ceil(2 * radius_px)) + 2
    big = side * scale
    center = big / 2.0
    r = radius_px * scale
    mask = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(mask)
    if shape in ("circle", "ring", "crescent"):
        draw.ellipse((center - r, center - r, center + r, center + r), fill=255)
        if shape == "ring":
            inner = 0.55 * r
            draw.ellipse((center - inner, center - inner, center + inner, center + inner), fill=0)
        elif shape == "crescent":
            # The bite is offset along the rotation so crescents face different ways.
            angle = math.radians(rotation * 6.0)
            cx, cy = center + 0.45 * r * math.cos(angle), center + 0.45 * r * math.sin(angle) - 0.1 * r
            bite = 0.82 * r
            draw.ellipse((cx - bite, cy - bite, cx + bite, cy + bite), fill=0)
    else:
        cos, sin = math.cos(math.radians(rotation)), math.sin(math.radians(rotation))
        points = [(center + r * (px * cos - py * sin), center + r * (px * sin + py * cos))
                  for px, py in _POLYGONS[shape]]
        draw.polygon(points, fill=255)
    return mask.reduce(scale)


_NOISE_BANK: dict[int, np.ndarray] = {}


def _noise_bank(image_size: int) -> np.ndarray:
    # One fixed field of unit Gaussian noise per process; scenes take a crop of it at their own
    # offset. Much cheaper than a fresh generator per sample and still deterministic.
    bank = _NOISE_BANK.get(image_size)
    if bank is None:
        side = max(256, 2 * image_size)
        bank = np.random.default_rng(20240601).standard_normal((side, side, 3)).astype(np.float32)
        _NOISE_BANK[image_size] = bank
    return bank


def render_scene(scene: Scene, image_size: int = 64) -> Image.Image:
    """Draw a scene as an RGB image of ``image_size`` x ``image_size`` pixels."""
    if scene.gradient:
        canvas = np.empty((image_size, image_size, 3), np.float32)
        canvas[:] = scene.background_rgb
        ramp = 1.0 + scene.gradient * np.linspace(-1.0, 1.0, image_size, dtype=np.float32)
        canvas *= ramp[:, None, None] if scene.gradient_axis == 0 else ramp[None, :, None]
        image = Image.fromarray(np.clip(canvas, 0, 255).astype(np.uint8))
    else:
        image = Image.new("RGB", (image_size, image_size), scene.background_rgb)
    for obj in scene.objects:
        radius_px = obj.radius * image_size
        mask = _shape_mask(obj.shape, radius_px, obj.rotation)
        left = int(round(obj.x * image_size - mask.width / 2))
        top = int(round(obj.y * image_size - mask.height / 2))
        image.paste(obj.rgb, (left, top, left + mask.width, top + mask.height), mask)
    if scene.noise > 0:
        bank = _noise_bank(image_size)
        limit = bank.shape[0] - image_size
        oy, ox = scene.noise_offset[0] % limit, scene.noise_offset[1] % limit
        pixels = np.asarray(image, np.float32) + scene.noise * bank[oy:oy + image_size, ox:ox + image_size]
        image = Image.fromarray(np.clip(pixels + 0.5, 0, 255).astype(np.uint8))
    return image


# ---------------------------------------------------------------------------------------------
# captions

_SIZE_WORDS = {"small": ("small", "small", "little", "tiny"),
               "medium": ("medium-sized", "medium", "mid-sized"),
               "large": ("large", "large", "big", "huge")}
_COLOR_WORDS = {name: (name,) for name in COLORS}
_COLOR_WORDS["purple"] = ("purple", "purple", "violet")
_SHAPE_WORDS = {name: (name,) for name in SHAPES}
# Canonical words dominate so the zero-shot class names are what the captions mostly say.
_SHAPE_WORDS.update({"circle": ("circle", "circle", "circle", "disc"),
                     "cross": ("cross", "cross", "cross", "plus sign"),
                     "diamond": ("diamond", "diamond", "diamond", "rhombus"),
                     "ring": ("ring", "ring", "ring", "donut"),
                     "crescent": ("crescent", "crescent", "crescent", "crescent moon")})
_PLURALS = {"cross": "crosses", "plus sign": "plus signs", "rhombus": "rhombi",
            "crescent moon": "crescent moons"}
_POSITION_WORDS = {
    ("center", "middle"): ("in the center", "in the centre", "in the middle",
                           "in the middle of the image"),
    ("left", "middle"): ("on the left", "on the left side", "at the left"),
    ("right", "middle"): ("on the right", "on the right side", "at the right"),
    ("center", "top"): ("at the top", "near the top", "in the upper part of the image"),
    ("center", "bottom"): ("at the bottom", "near the bottom", "in the lower part of the image"),
}
for _row, _vertical in (("top", ("top", "upper")), ("bottom", ("bottom", "lower"))):
    for _col in ("left", "right"):
        _POSITION_WORDS[(_col, _row)] = (f"in the {_vertical[0]} {_col} corner",
                                         f"in the {_vertical[1]} {_col}", f"at the {_vertical[0]} {_col}")
_RELATION_WORDS = {"left of": ("to the left of", "left of", "on the left of"),
                   "right of": ("to the right of", "right of", "on the right of"),
                   "above": ("above", "over", "higher than"),
                   "below": ("below", "under", "beneath")}
_INVERSE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
_PREFIXES = ("a photo of", "an image of", "a picture of", "a drawing of", "a rendering of")
_NOISY_PREFIXES = ("a grainy photo of", "a noisy picture of", "a grainy image of")


def _article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def _plural(word: str) -> str:
    return _PLURALS.get(word, word + "s")


def _object_phrase(obj: SceneObject, rng: random.Random, *, allow_no_color: bool = True,
                   colorless: float = COLORLESS_PHRASE_WEIGHT) -> str:
    """``a small red circle``, ``a circle that is red``, ``a red-colored square`` ..."""
    shape = rng.choice(_SHAPE_WORDS[obj.shape])
    color = rng.choice(_COLOR_WORDS[obj.color])
    size = rng.choice(_SIZE_WORDS[obj.size])
    # Medium is the unremarkable size: usually unsaid.
    say_size = rng.random() < (0.35 if obj.size == "medium" else 0.75)
    form = rng.choices(("adjectives", "no_color", "that_is", "colored", "in_color"),
                       weights=(0.72 - colorless, colorless if allow_no_color else 0.0,
                                0.10, 0.08, 0.10))[0]
    if form == "no_color":
        return _article(f"{size} {shape}")
    if form == "that_is":
        return _article(f"{size} {shape}" if say_size else shape) + f" that is {color}"
    if form == "colored":
        colored = rng.choice(("colored", "coloured"))
        return _article(f"{size} {color}-{colored} {shape}" if say_size else f"{color}-{colored} {shape}")
    if form == "in_color":
        return _article(f"{size} {shape}" if say_size else shape) + f" in {color}"
    return _article(f"{size} {color} {shape}" if say_size else f"{color} {shape}")


def _relation(a: SceneObject, b: SceneObject) -> str:
    """Where ``a`` is relative to ``b``: by column first, then by row."""
    col_a, col_b = COLUMNS.index(a.column), COLUMNS.index(b.column)
    if col_a != col_b:
        return "left of" if col_a < col_b else "right of"
    return "above" if ROWS.index(a.row) < ROWS.index(b.row) else "below"


def _background_phrase(scene: Scene, rng: random.Random) -> str:
    return rng.choice((f"on a {scene.background} background", f"against a {scene.background} backdrop",
                       f"on {scene.background}"))


def _prefix(scene: Scene, rng: random.Random) -> str:
    return rng.choice(_NOISY_PREFIXES if scene.noise >= 8.0 and rng.random() < 0.5 else _PREFIXES)


def write_caption(scene: Scene, rng: random.Random, *,
                  colorless: float = COLORLESS_PHRASE_WEIGHT,
                  single_frames: tuple[float, ...] = SINGLE_FRAME_WEIGHTS) -> str:
    """One caption for a scene, drawn from the paraphrase grammar."""
    objects = scene.objects
    phrase_of = functools.partial(_object_phrase, colorless=colorless)
    if len(objects) == 1:
        obj = objects[0]
        phrase = phrase_of(obj, rng)
        position = rng.choice(_POSITION_WORDS[(obj.column, obj.row)])
        frame = rng.choices(range(8), weights=single_frames)[0]
        text = (
            f"{phrase} {position}",
            f"{position}, {phrase}" if rng.random() < 0.5 else f"{position} there is {phrase}",
            f"{_prefix(scene, rng)} {phrase} {position}",
            phrase,
            f"{phrase} {position} {_background_phrase(scene, rng)}",
            f"{phrase} {_background_phrase(scene, rng)}",
            f"there is {phrase} {position}",
            f"{_prefix(scene, rng)} {phrase}, {position}",
        )[frame]
    elif len(objects) == 2:
        first, second = objects if rng.random() < 0.5 else objects[::-1]
        relation = rng.choice(_RELATION_WORDS[_relation(first, second)])
        same = first.shape == second.shape and first.color == second.color
        frame = rng.choices(range(5), weights=(0.45, 0.15, 0.12, 0.18, 0.10))[0]
        if same and rng.random() < 0.6:
            shape = rng.choice(_SHAPE_WORDS[first.shape])
            text = f"two {rng.choice(_COLOR_WORDS[first.color])} {_plural(shape)}"
        elif frame == 0:
            text = f"{phrase_of(first, rng)} {relation} {phrase_of(second, rng)}"
        elif frame == 1:
            text = f"{_prefix(scene, rng)} {phrase_of(first, rng)} {relation} {phrase_of(second, rng)}"
        elif frame == 2:
            text = f"{phrase_of(first, rng)} and {phrase_of(second, rng)}"
        elif frame == 3:
            text = (f"{phrase_of(first, rng)} {relation} {phrase_of(second, rng)} "
                    f"{_background_phrase(scene, rng)}")
        else:
            text = f"two shapes: {phrase_of(first, rng)} and {phrase_of(second, rng)}"
    else:
        ordered = list(objects)
        distinct_columns = len({o.column for o in objects}) == len(objects)
        if distinct_columns and rng.random() < 0.35:
            ordered.sort(key=lambda o: o.x)
            lead = "from left to right: "
        else:
            rng.shuffle(ordered)
            lead = rng.choice(("", "", "three shapes: ", f"{_prefix(scene, rng)} "))
        phrases = [phrase_of(o, rng, allow_no_color=False) for o in ordered]
        text = lead + f"{phrases[0]}, {phrases[1]} and {phrases[2]}"
    if rng.random() < 0.3:
        text += "."
    return text


# ---------------------------------------------------------------------------------------------
# samples


def _sample_rng(seed: int, split: str, index: int) -> random.Random:
    return random.Random((seed * 8 + SPLIT_CODES[split]) * 10**12 + index)


def _scene_meta(scene: Scene) -> dict[str, Any]:
    return {
        "background": scene.background,
        "gradient": scene.gradient,
        "noise": scene.noise,
        "objects": [{"shape": o.shape, "color": o.color, "size": o.size, "column": o.column,
                     "row": o.row, "x": o.x, "y": o.y, "radius": o.radius, "rotation": o.rotation}
                    for o in scene.objects],
    }


def make_sample(seed: int, split: str, index: int, image_size: int = 64,
                shape: str | None = None, mix: TrainMix | None = None) -> tuple[bytes, str, dict[str, Any]]:
    """(JPEG bytes, caption, scene attributes) of sample ``index`` of ``split``; pure function.

    ``shape`` gives a single-object scene of that shape (the zero-shot set). ``mix`` changes
    the scene and caption mix (``TrainMix``; the writer passes it for the training split only).
    """
    mix = mix or TrainMix()
    rng = _sample_rng(seed, split, index)
    if shape is None:
        scene = sample_scene(rng, object_weights=mix.object_weights())
    else:
        scene = sample_scene(rng, num_objects=1, shape=shape)
    caption = write_caption(scene, rng, colorless=mix.colorless, single_frames=mix.single_frame_weights())
    buffer = io.BytesIO()
    render_scene(scene, image_size).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue(), caption, _scene_meta(scene)


# ---------------------------------------------------------------------------------------------
# writing


class _TarStream:
    """Minimal ustar writer: the same bytes as ``webdataset.TarWriter(stream, mtime=0)``.

    (img2dataset's writer leaves ``mtime`` unset, so its float ``time.time()`` adds a PAX header
    per member; readers see the same members either way.)

    tarfile builds every header in Python (about a third of the time per sample); here a header
    template is patched with the name, size and checksum instead.
    """

    def __init__(self, stream: Any) -> None:
        info = tarfile.TarInfo("template")
        info.mtime, info.mode, info.uname, info.gname = 0, 0o444, "bigdata", "bigdata"
        self._template = bytes(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape"))
        self._stream = stream
        self._written = 0

    def add(self, name: str, data: bytes) -> None:
        encoded = name.encode("utf-8")
        if len(encoded) > 99:
            raise ValueError(f"tar member name {name!r} is too long for a ustar header")
        header = bytearray(self._template)
        header[0:100] = encoded.ljust(100, b"\0")
        header[124:136] = b"%011o\0" % len(data)
        header[148:156] = b" " * 8
        header[148:155] = b"%06o\0" % sum(header)
        padding = -len(data) % tarfile.BLOCKSIZE
        self._stream.write(bytes(header) + data + b"\0" * padding)
        self._written += tarfile.BLOCKSIZE + len(data) + padding

    def close(self) -> None:
        # End-of-archive marker, then padding to a whole record, as tarfile's stream mode does.
        end = 2 * tarfile.BLOCKSIZE
        end += -(self._written + end) % tarfile.RECORDSIZE
        self._stream.write(b"\0" * end)


def _write_shard(job: tuple) -> dict[str, Any]:
    """Worker: render and write one shard like img2dataset's webdataset writer."""
    split, directory, shard, first_index, count, seed, image_size, mix = job
    start = time.time()
    stride = 10_000
    captions = []
    tmp_path = Path(directory) / (shard_name(shard) + ".tmp")
    with open(tmp_path, "wb") as stream:
        tar = _TarStream(stream)
        for row in range(count):
            index = first_index + row
            jpeg, caption, scene = make_sample(seed, split, index, image_size, mix=mix)
            key = make_key(shard, row, stride)
            meta = {"url": f"synthetic://{split}/{index}", "caption": caption, "key": key,
                    "status": "success", "error_message": None, "width": image_size,
                    "height": image_size, "original_width": image_size,
                    "original_height": image_size, "index": index, **scene}
            # Members in sorted extension order, as webdataset's TarWriter writes them.
            tar.add(f"{key}.jpg", jpeg)
            tar.add(f"{key}.json", json.dumps(meta).encode("utf-8"))
            tar.add(f"{key}.txt", caption.encode("utf-8"))
            captions.append(caption)
        tar.close()
    os.replace(tmp_path, Path(directory) / shard_name(shard))
    end = time.time()
    stats = {"count": count, "successes": count, "failed_to_download": 0, "failed_to_resize": 0,
             "duration": end - start, "start_time": start, "end_time": end,
             "status_dict": {"success": count} if count else {}}
    with open(Path(directory) / f"{shard:05d}_stats.json", "w") as f:
        json.dump(stats, f, indent=4)
    return {"split": split, "shard": shard_name(shard), "count": count, "captions": captions}


def _write_zeroshot_class(job: tuple) -> dict[str, Any]:
    _, directory, class_index, count, seed, image_size = job
    shape = SHAPES[class_index]
    folder = Path(directory) / shape
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        jpeg, _, _ = make_sample(seed, "zeroshot", class_index * 1_000_000 + i, image_size, shape=shape)
        (folder / f"{shape}_{i:05d}.jpg").write_bytes(jpeg)
    return {"split": "zeroshot", "count": count, "captions": []}


def _run_job(job: tuple) -> dict[str, Any]:
    return _write_zeroshot_class(job) if job[0] == "zeroshot" else _write_shard(job)


def _run_numbered(numbered: tuple[int, tuple]) -> tuple[int, dict[str, Any]]:
    """``_run_job`` with the job's number, so the parent knows which jobs finished."""
    number, job = numbered
    return number, _run_job(job)


def _ignore_interrupts() -> None:
    """Pool worker: leave Ctrl-C to the parent, which stops the pool (a worker that died of the
    SIGINT lost its job, and the pool waited for it for good)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _remove_unfinished(jobs: list[tuple]) -> None:
    """After an interrupt: what the shard jobs the parent did not see finish left. The ``.tmp`` of
    an unfinished shard goes, and so does a shard a stopped worker renamed but whose
    ``NNNNN_stats.json`` it had not written whole (a shard without stats is no prep's to a re-run,
    which would refuse it); a shard whose stats were written (its worker's last act) is whole and
    stays. So every shard on disk is whole and has its stats."""
    for job in jobs:
        if job[0] == "zeroshot":  # (a re-run empties the class folders before writing them)
            continue
        directory, name = Path(job[1]), shard_name(job[2])
        (directory / (name + ".tmp")).unlink(missing_ok=True)
        stats = directory / f"{job[2]:05d}_stats.json"
        try:
            finished = json.loads(stats.read_text()).get("count") == job[4]
        except (OSError, ValueError, AttributeError):
            finished = False
        if not (finished and (directory / name).is_file()):
            (directory / name).unlink(missing_ok=True)
            stats.unlink(missing_ok=True)


def _read_record(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    """``out_dir``'s ``synthetic.json``, or None."""
    try:
        made = json.loads((Path(out_dir) / SYNTHETIC_FILE).read_text())
    except (OSError, ValueError):
        return None
    return made if isinstance(made, dict) else None


def is_current(out_dir: str | os.PathLike, *, train: int = 20_000, val: int = 1_000,
               zeroshot_per_class: int = 50, seed: int = 0, image_size: int = 64,
               train_mix: TrainMix | None = None) -> bool:
    """Whether ``out_dir`` already holds exactly this world (``synthetic.json`` written last, so a
    crashed write is never taken for a finished one)."""
    made = _read_record(out_dir)
    if made is None:
        return False
    mix = train_mix or TrainMix()
    wanted = {"world_version": WORLD_VERSION, "seed": seed, "image_size": image_size,
              "train": train, "val": val, "zeroshot": zeroshot_per_class * len(SHAPES),
              "train_mix": None if mix.is_default else dataclasses.asdict(mix)}
    found = {"world_version": made.get("world_version"), "seed": made.get("seed"),
             "image_size": made.get("image_size"),
             "train": made.get("train", {}).get("num_samples"),
             "val": made.get("val", {}).get("num_samples", 0),
             "zeroshot": made.get("zeroshot", {}).get("num_images", 0),
             "train_mix": made.get("train_mix")}
    return found == wanted


def write_synthetic(out_dir: str | os.PathLike, *, train: int = 20_000, val: int = 1_000,
                    zeroshot_per_class: int = 50, seed: int = 0, image_size: int = 64,
                    shard_size: int = 1_000, workers: int | None = None,
                    progress: bool = True, train_mix: TrainMix | None = None) -> dict[str, Any]:
    """Write the synthetic world to ``out_dir`` (``train/``, ``val/``, ``zeroshot/``).

    Returns statistics: samples per split, shards, id spaces, distinct captions, wall seconds and
    ``samples_per_second`` (all images, zero-shot included). ``workers`` defaults to the CPU count;
    the output does not depend on it. ``train_mix`` changes the training split's scene and caption
    mix (``TrainMix``); validation and zero-shot samples do not depend on it.
    """
    train_mix = train_mix or TrainMix()
    if train < 1:
        raise DataPrepError(f"prep synthetic: --train={train}: must be >= 1 (training samples)")
    if val < 0 or zeroshot_per_class < 0:
        raise DataPrepError(f"prep synthetic: --val={val}, --zeroshot-per-class="
                            f"{zeroshot_per_class}: must be >= 0")
    if not 1 <= shard_size <= 10_000:
        raise DataPrepError(f"prep synthetic: --shard-size={shard_size}: must be in [1, 10000] "
                            "(9-digit keys)")
    if image_size < 16:
        raise DataPrepError(f"prep synthetic: --image-size={image_size}: must be >= 16")
    out = Path(out_dir)
    start = time.perf_counter()
    command, elsewhere = "prep synthetic", "another --out"
    fix = f"remove them or choose {elsewhere}"
    # What an earlier prep left in OUT: shards in another layout (OUT's own) are refused, its
    # train/ and val/ are replaced (only what a prep wrote: shard files no prep recorded are
    # refused), and the parts this world does not have (--val 0, --zeroshot-per-class 0) go, so
    # that no earlier world is read beside this one.
    prepare_layout(out, split=True, overwrite=False, command=command, fix=fix,
                   elsewhere=elsewhere, synthetic=False)
    sizes_of = dict(zip(SPLITS, (train, val)))
    for split in SPLITS:
        if sizes_of[split]:
            refuse_unrecorded(out / split, earlier_prep(out / split), command, elsewhere)
    earlier = _read_record(out)
    if earlier is not None:
        (out / SYNTHETIC_FILE).unlink()  # no record of a world until this one is whole
        if not zeroshot_per_class:
            remove_files(zeroshot_files(out, earlier), out)
    for split in SPLITS:
        if sizes_of[split]:
            remove_earlier_prep(out / split, command, target=True, elsewhere=elsewhere)
        else:
            remove_files(earlier_prep(out / split).files, out)

    jobs: list[tuple] = []
    split_shards: dict[str, dict[str, int]] = {}
    for split, total in sizes_of.items():
        if total == 0:
            continue
        directory = out / split
        directory.mkdir(parents=True, exist_ok=True)
        num_shards = math.ceil(total / shard_size)
        split_shards[split] = {}
        for shard in range(num_shards):
            count = min(shard_size, total - shard * shard_size)
            jobs.append((split, str(directory), shard, shard * shard_size, count, seed, image_size,
                         train_mix if split == "train" else TrainMix()))
            split_shards[split][shard_name(shard)] = count
    if zeroshot_per_class:
        zeroshot_dir = out / "zeroshot"
        zeroshot_dir.mkdir(parents=True, exist_ok=True)
        for class_index, shape in enumerate(SHAPES):
            for old in (zeroshot_dir / shape).glob("*.jpg"):
                old.unlink()
            jobs.append(("zeroshot", str(zeroshot_dir), class_index, zeroshot_per_class, seed, image_size))
    # Biggest jobs first keeps all workers busy until the end.
    jobs.sort(key=lambda job: -job[4] if job[0] != "zeroshot" else -job[3])

    total_images = train + val + zeroshot_per_class * len(SHAPES)
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    captions: dict[str, set[str]] = {"train": set(), "val": set()}
    bar = None
    if progress:
        from vlcontrast.progress import Progress  # a bar on a terminal, plain lines in a log

        bar = Progress(total=total_images, unit="img", desc=f"synthetic -> {out}")
    pool = None
    unfinished = dict(enumerate(jobs))
    try:
        if workers == 1:
            results = map(_run_numbered, enumerate(jobs))
        else:
            # fork: workers only need PIL/numpy and start instantly; spawn would re-import torch.
            method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
            # Workers ignore Ctrl-C from their start on (a forked one inherits it before its
            # initializer runs); the parent stops them (vlcontrast.data.prep.writer does the same).
            main = threading.current_thread() is threading.main_thread()
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
            try:
                pool = multiprocessing.get_context(method).Pool(workers,
                                                                initializer=_ignore_interrupts)
            finally:
                if main:
                    signal.signal(signal.SIGINT, previous)
            results = pool.imap_unordered(_run_numbered, enumerate(jobs))
        for number, result in results:
            del unfinished[number]
            if result["split"] in captions:
                captions[result["split"]].update(result["captions"])
            if bar is not None:
                bar.update(result["count"])
    except KeyboardInterrupt:
        # Ctrl-C: stop the workers (no waiting for every shard), then remove what the jobs not
        # seen finishing left; the command line says it in one line (exit 130). synthetic.json
        # is not written, so the folder is never taken for a finished world; a re-run rewrites it.
        with _no_interrupts():
            if pool is not None:
                pool.terminate()
                pool.join()
                pool = None
            _remove_unfinished(list(unfinished.values()))
        raise
    except BaseException:  # an error: stop the workers instead of waiting for every shard
        if pool is not None:
            pool.terminate()
            pool.join()
            pool = None
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        if bar is not None:
            bar.close()

    stats: dict[str, Any] = {"out_dir": str(out), "seed": seed, "image_size": image_size,
                             "workers": workers, "world_version": WORLD_VERSION}
    if not train_mix.is_default:
        stats["train_mix"] = dataclasses.asdict(train_mix)
    for split, sizes in split_shards.items():
        directory = out / split
        write_sizes(directory, sizes)
        manifest = build_manifest(sizes, stride=10_000, source="synthetic",
                                  split=split, seed=seed, image_size=image_size,
                                  generator="vlcontrast.data.prep.synthetic")
        write_manifest(directory, manifest)
        stats[split] = {"dir": str(directory), "num_samples": manifest["num_samples"],
                        "num_shards": manifest["num_shards"], "id_space": manifest["id_space"],
                        "distinct_captions": len(captions[split])}
    if zeroshot_per_class:
        classnames, templates = ZEROSHOT_LISTS
        (zeroshot_dir / classnames).write_text("\n".join(SHAPES) + "\n")
        (zeroshot_dir / templates).write_text("\n".join(TEMPLATES) + "\n")
        stats["zeroshot"] = {"dir": str(zeroshot_dir), "num_classes": len(SHAPES),
                             "num_images": zeroshot_per_class * len(SHAPES),
                             "chance_top1": 1.0 / len(SHAPES)}
    seconds = time.perf_counter() - start
    stats["seconds"] = round(seconds, 3)
    stats["num_images"] = total_images
    stats["samples_per_second"] = round(total_images / seconds, 1)
    with open(out / SYNTHETIC_FILE, "w") as f:
        json.dump(stats, f, indent=2)
    return stats
