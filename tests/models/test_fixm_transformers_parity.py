"""How closely a transformers export reproduces vlcontrast, measured as docs/evaluation.md states
it: the image processor's pixels (PIL backend equal up to the centre crop's rounding; the default
torchvision backend resizes differently), the tokenizer's ids (equal once the text is cleaned as
open_clip cleans it: HTML entities, ftfy's fixes) and long labels (the tokenizer truncates at the
model's context when asked; the zero-shot pipeline does not ask)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.models.test_transformers_clip import TEMPLATE, _ours, trained  # noqa: F401 - fixture

SIZE = 32  # vlc-micro's image size
# (width, height): resized so the short side is 32, the long side L = int(32 * long / short);
# the centre crop's offset is (L - 32) / 2, rounded to nearest (half to even) by torchvision and
# down by transformers: they differ by one pixel when L - 32 is 3 mod 4.
SIZES = {(32, 32): False, (40, 32): False, (37, 32): False, (35, 32): True, (39, 32): True,
         (32, 39): True, (100, 122): True, (200, 250): False, (43, 43): False, (90, 64): False}


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _crop(image: Image.Image, mean, std, round_offset) -> torch.Tensor:
    """Resize the short side to SIZE (PIL bicubic), crop SIZE x SIZE at ``round_offset``'s
    offsets, normalise: the evaluation transform with the crop rounding made explicit."""
    width, height = image.size
    short, long = min(width, height), max(width, height)
    new_long = int(SIZE * long / short)
    new = (SIZE, new_long) if width == short else (new_long, SIZE)
    resized = image.resize(new, Image.BICUBIC)
    left, top = round_offset((new[0] - SIZE) / 2), round_offset((new[1] - SIZE) / 2)
    array = np.asarray(resized.crop((left, top, left + SIZE, top + SIZE)), dtype=np.float32) / 255
    tensor = torch.from_numpy(array).permute(2, 0, 1)
    return (tensor - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]


def test_pil_processor_pixels_equal_vlcontrast_up_to_the_crop_rounding(trained):  # noqa: F811
    from transformers import AutoImageProcessor

    _, _, run, out = trained
    _, preprocess, _ = _ours(run)
    pil = AutoImageProcessor.from_pretrained(out, backend="pil")
    config = json.loads((out / "preprocessor_config.json").read_text())
    mean, std = config["image_mean"], config["image_std"]
    for seed, ((width, height), shifted) in enumerate(SIZES.items()):
        image = _image(width, height, seed)
        ours = preprocess(image)
        theirs = pil(images=[image], return_tensors="pt")["pixel_values"][0]
        # vlcontrast's pixels are the crop rounded to nearest, transformers' the crop rounded down
        torch.testing.assert_close(ours, _crop(image, mean, std, lambda x: int(round(x))),
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(theirs, _crop(image, mean, std, int), atol=1e-5, rtol=0)
        same = (ours - theirs).abs().max().item() < 1e-5
        assert same != shifted, (width, height)


def test_default_torchvision_processor_resizes_differently(trained):  # noqa: F811
    """The processor transformers picks by default (torchvision) gives other pixels than
    vlcontrast's for images it resizes, even where the crop rounds the same way; images whose
    short side is already the model's size are not resized and are equal."""
    from transformers import AutoImageProcessor

    _, _, run, out = trained
    _, preprocess, _ = _ours(run)
    default = AutoImageProcessor.from_pretrained(out)
    assert "Pil" not in type(default).__name__  # what the docs call the default backend
    differ = {}
    for seed, (width, height) in enumerate([(32, 32), (40, 32), (64, 48), (43, 43),
                                                       (200, 250)]):
        image = _image(width, height, seed)
        pixels = default(images=[image], return_tensors="pt")["pixel_values"][0]
        differ[(width, height)] = (preprocess(image) - pixels).abs().max().item() > 1e-3
    assert differ == {(32, 32): False, (40, 32): False, (64, 48): True, (43, 43): True,
                      (200, 250): True}


TOKEN_CASES = ["café &amp; crème", "a &lt;b&gt; tag", "don\u2019t", "\ufb01sh", "caf\u00c3\u00a9",
               "\uff26\uff55\uff4c\uff4c"]
SAME_CASES = ["A Photo of a CAT", "ünï cødé  food", "tabs\tand\nnewlines", "  leading",
              "emoji \U0001f431 cat", "\u65e5\u672c\u8a9e"]


def _open_clip_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer([text])[0].tolist()
    return ids[:ids.index(49407) + 1]


def test_tokenizer_ids_differ_where_open_clip_cleans_the_text(trained):  # noqa: F811
    """open_clip fixes the text with ftfy and unescapes HTML entities before its BPE;
    transformers' CLIPTokenizer does neither. The ids are the same for text that needs no such
    cleaning, differ for text that does, and are the same again once the text is cleaned as
    open_clip cleans it (``open_clip.tokenizer.basic_clean``)."""
    from open_clip.tokenizer import basic_clean
    from transformers import AutoTokenizer

    _, _, run, out = trained
    _, _, tokenizer = _ours(run)
    theirs = AutoTokenizer.from_pretrained(out)
    for text in SAME_CASES:
        assert theirs(text, truncation=True).input_ids == _open_clip_ids(tokenizer, text), text
    for text in TOKEN_CASES:
        assert theirs(text, truncation=True).input_ids != _open_clip_ids(tokenizer, text), text
        cleaned = theirs(basic_clean(text), truncation=True).input_ids
        assert cleaned == _open_clip_ids(tokenizer, text), text


LONG = "a very long label about many small things that goes well past sixteen tokens of context"


def test_long_labels_truncate_at_the_models_context(trained, tmp_path):  # noqa: F811
    """The exported tokenizer's model_max_length is the model's context and ``truncation=True``
    cuts there as vlcontrast does (same ids, same probabilities through CLIPModel); the
    zero-shot pipeline calls the tokenizer without truncation, so a label past the context is
    refused there (the README and docs say so and give the CLIPModel code)."""
    from transformers import CLIPModel, CLIPProcessor, pipeline

    _, _, run, out = trained
    model, preprocess, tokenizer = _ours(run)
    context = json.loads((out / "config.json").read_text())["text_config"][
        "max_position_embeddings"]
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == context
    labels = [LONG, "a red circle", "two blue squares"]
    prompts = [TEMPLATE.replace("{c}", label) for label in labels]
    processor = CLIPProcessor.from_pretrained(out)
    ids = processor.tokenizer(prompts, padding=True, truncation=True, return_tensors="pt")
    assert ids.input_ids.shape[1] == context
    ours_ids = tokenizer(prompts)
    assert ids.input_ids[0].tolist() == ours_ids[0].tolist()  # the long one: no padding either

    image = _image(48, 40, 3)
    hf = CLIPModel.from_pretrained(out).eval()
    with torch.no_grad():
        pixels = preprocess(image)[None]
        texts = model.encode_text(ours_ids, normalize=True)
        ours = (model.logit_scale.exp() * model.encode_image(pixels, normalize=True)
                @ texts.T).softmax(-1)[0]
        theirs = hf(pixel_values=pixels, **ids).logits_per_image.softmax(-1)[0]
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)

    # the README's code for long labels runs as written and truncates as vlcontrast does
    readme = (out / "README.md").read_text()
    assert f"context ({context} tokens)" in readme
    code = readme.split("```python")[2].split("```")[0]
    path = tmp_path / "photo.jpg"
    image.save(path, quality=100)
    namespace: dict = {}
    exec(code.replace("THIS_DIRECTORY", str(out)).replace("photo.jpg", str(path))
         .replace('["a cat", "a dog"]', repr(labels)).replace("a photo of {label}.",
                                                             TEMPLATE.replace("{c}", "{label}")),
         namespace)
    torch.testing.assert_close(namespace["inputs"]["input_ids"], ids.input_ids)
    with torch.no_grad():
        readme_pixels = namespace["inputs"]["pixel_values"]
        torch.testing.assert_close(readme_pixels, preprocess(Image.open(path))[None], atol=1e-5,
                                   rtol=0)  # 48x40: the crop rounds the same way

    classify = pipeline("zero-shot-image-classification", model=str(out), device="cpu")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        classify(image, candidate_labels=labels, hypothesis_template=TEMPLATE.replace("{c}", "{}"))
    # labels within the context go through the pipeline
    short = classify(image, candidate_labels=labels[1:],
                     hypothesis_template=TEMPLATE.replace("{c}", "{}"))
    assert sorted(item["label"] for item in short) == sorted(labels[1:])
