"""The transparency rules of the readers (``vlcontrast.data.samples``): which images count as
transparent, ``white`` equal to the training reader, ``drop`` equal to ``convert("RGB")``."""

import io

import numpy as np
import pytest
from PIL import Image

from vlcontrast.data.samples import (ALPHA_RULES, check_alpha, decode_image, has_transparency,
                                     open_image)
from vlcontrast.errors import ConfigError


def _png(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", **options)
    return buffer.getvalue()


def _rgba(alpha_value: int) -> Image.Image:
    rng = np.random.default_rng(alpha_value)
    colour = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    alpha = np.full((8, 8), 255, np.uint8)
    alpha[:4] = alpha_value
    return Image.fromarray(np.dstack([colour, alpha]), "RGBA")


def test_which_images_have_transparency():
    assert has_transparency(_rgba(0)) and has_transparency(_rgba(200))
    assert not has_transparency(_rgba(255))  # an alpha channel, but every pixel opaque
    assert not has_transparency(Image.new("RGB", (4, 4)))
    assert has_transparency(_rgba(10).convert("LA"))
    for entry, expected in ((3, True), (9, False)):  # 9: a transparent entry no pixel uses
        palette = Image.new("P", (4, 4), 1)
        palette.putpixel((0, 0), 3)
        palette.info["transparency"] = entry
        assert has_transparency(palette) == expected


@pytest.mark.parametrize("image", [_rgba(0), _rgba(120), _rgba(120).convert("LA"),
                                   Image.new("RGB", (5, 3), (10, 20, 30))])
def test_white_is_the_training_reader_and_drop_is_convert_rgb(image):
    data = _png(image)
    white, white_flag = decode_image(data, alpha="white")
    dropped, drop_flag = decode_image(data, alpha="drop")
    assert white.mode == dropped.mode == "RGB"
    assert white.tobytes() == open_image(data).tobytes()
    assert dropped.tobytes() == Image.open(io.BytesIO(data)).convert("RGB").tobytes()
    assert white_flag == drop_flag == has_transparency(Image.open(io.BytesIO(data)))
    assert (white.tobytes() != dropped.tobytes()) == white_flag


def test_broken_images_and_unknown_rules():
    assert decode_image(b"not an image", alpha="drop") == "undecodable_image"
    assert decode_image(_png(_rgba(0)), max_image_pixels=10, alpha="drop") == "decompression_bomb"
    assert set(ALPHA_RULES) == {"white", "drop"} and check_alpha("drop") == "drop"
    with pytest.raises(ConfigError, match=r"^--alpha 'black': use white .* or drop"):
        check_alpha("black")
