"""The Python inference API checks what the command line checks, in one line naming the Python
parameter (``labels``, ``top_k=``, ``paths``, ``overwrite=True``), and computes on the model's own
device unless told otherwise.

A string where a list is expected used to be split into characters (seven one-letter "labels"),
one label got probability 1 for every image, ``embed_images`` without ``paths=`` or ``shards=``
failed deep in the shard reader (with both, ``shards`` was ignored), errors named ``--top-k`` or
``--overwrite``, and ``device`` defaulted to the CPU while ``vlcontrast.load`` put the model on
CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.inference.helpers import BROKEN
from vlcontrast.errors import ConfigError
from vlcontrast.inference import classify, embed_images, embed_texts

LABELS = ["cat", "dog", "car"]


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


# ------------------------------------------------------------------------- finding 1: lists, labels


def test_a_string_for_labels_templates_or_texts_is_refused(trained, user_images):
    (model, preprocess, tokenizer), _ = trained
    paths = user_images[1][:2]
    with pytest.raises(ConfigError, match=r"^labels='cat,dog': a single str, not a list; give a "
                                          r"list of labels, e.g. labels=\['cat'") as err:
        classify(model, preprocess, tokenizer, paths, "cat,dog", progress=False)
    one_line(err)
    with pytest.raises(ConfigError, match=r"^templates='a photo of \{c\}': a single str, not a "
                                          r"list; give a list of prompts with \{c\}") as err:
        classify(model, preprocess, tokenizer, paths, LABELS, templates="a photo of {c}",
                 progress=False)
    one_line(err)
    with pytest.raises(ConfigError, match=r"^texts='a cat': a single str, not a list; give a "
                                          r"list of texts") as err:
        embed_texts(model, tokenizer, "a cat", progress=False)
    one_line(err)
    with pytest.raises(ConfigError, match=r"^paths='photos': a single str, not a list; .*"
                                          r"find_images") as err:
        classify(model, preprocess, tokenizer, "photos", LABELS, progress=False)
    one_line(err)


def test_classify_refuses_what_the_command_line_refuses(trained, user_images):
    """The CLI's label check (parse_labels) and classify's are one function: fewer than two
    labels, or one given twice (case-insensitively), is refused from Python too."""
    (model, preprocess, tokenizer), _ = trained
    paths = user_images[1][:2]
    with pytest.raises(ConfigError, match=r"^labels: 1 label\(s\); zero-shot classification "
                                          r"needs at least two, e.g. labels=\[") as err:
        classify(model, preprocess, tokenizer, paths, ["cat"], progress=False)
    one_line(err)
    with pytest.raises(ConfigError, match=r"^labels: label 'Cat' is given twice; give each "
                                          r"label once") as err:
        classify(model, preprocess, tokenizer, paths, ["cat", "Cat"], progress=False)
    one_line(err)
    # The command line's wording is unchanged: the same check, named by its flag.
    from vlcontrast.inference import parse_labels

    with pytest.raises(ConfigError, match=r'^--labels: 1 label\(s\); .*--labels "cat,dog,car"'):
        parse_labels("cat")
    with pytest.raises(ConfigError, match=r"^--labels: label 'Cat' is given twice"):
        parse_labels("cat,Cat")


# -------------------------------------------------------------------- finding 2: paths= | shards=


def test_embed_images_needs_exactly_one_of_paths_and_shards(trained, user_images, tiny_data):
    (model, preprocess, _), _ = trained
    for arguments, given in (({}, "neither"),
                             ({"paths": user_images[1], "shards": str(tiny_data / "val")},
                              "both")):
        with pytest.raises(ConfigError, match=rf"^embed_images: {given} of paths= and shards= "
                                              r"given; give exactly one of them") as err:
            embed_images(model, preprocess, progress=False, **arguments)
        one_line(err)


# ----------------------------------------------------------- finding 3: the Python parameter named


def test_errors_name_the_python_parameters(trained, user_images):
    (model, preprocess, tokenizer), _ = trained
    folder, readable = user_images
    paths = readable[:2]
    cases = [
        (lambda: classify(model, preprocess, tokenizer, paths, LABELS, top_k=0, progress=False),
         r"^top_k=0: must be at least 1$"),
        (lambda: classify(model, preprocess, tokenizer, paths, LABELS, alpha="black",
                          progress=False),
         r"^alpha 'black': use white"),
        (lambda: classify(model, preprocess, tokenizer, paths, LABELS, templates=["a photo"],
                          progress=False),
         r"^templates=\['a photo'\]: template 'a photo' has no \{c\} placeholder"),
        (lambda: classify(model, preprocess, tokenizer, paths, LABELS, batch_size=0,
                          progress=False),
         r"^batch_size=0: must be a whole number >= 1$"),
        (lambda: classify(model, preprocess, tokenizer, paths, LABELS, workers=-1,
                          progress=False),
         r"^workers=-1: must be a whole number >= 0$"),
        (lambda: classify(model, preprocess, tokenizer, [folder], LABELS, progress=False),
         r"^paths: '.*' is a folder; give image files: expand folders with "
         r"vlcontrast.inference.find_images\("),
        (lambda: embed_images(model, preprocess, paths=[folder], progress=False),
         r"^paths: '.*' is a folder; .*find_images"),
        (lambda: embed_images(model, preprocess, paths=paths, batch_size=0, progress=False),
         r"^batch_size=0: must be a whole number >= 1$"),
        (lambda: embed_images(model, preprocess, paths=[folder / BROKEN], progress=False),
         r"^paths: none of the 1 images could be read \(\{'undecodable_image': 1\}\)"),
        (lambda: embed_texts(model, tokenizer, [], progress=False),
         r"^texts=\[\]: no texts; give a list of texts"),
        (lambda: embed_texts(model, tokenizer, ["a cat"], batch_size=0, progress=False),
         r"^batch_size=0: must be a whole number >= 1$"),
    ]
    for call, pattern in cases:
        with pytest.raises(ConfigError, match=pattern) as err:
            call()
        message = one_line(err)
        assert "--" not in message, message  # no command-line flag named to a Python caller


def test_write_embeddings_names_overwrite_true(tmp_path):
    import numpy as np

    from vlcontrast.inference import Embeddings, write_embeddings

    out = tmp_path / "e.npy"
    write_embeddings(Embeddings(np.eye(2, 4, dtype=np.float32), ["a", "b"]), out)
    with pytest.raises(ConfigError, match=rf"^out={str(out)!r} exists \(2 embeddings of "
                                          r"dimension 4, .*; add overwrite=True to replace "
                                          r"them, or name a new file$") as err:
        write_embeddings(Embeddings(np.ones((1, 4), np.float32), ["x"]), out)
    assert "--" not in one_line(err)
    with pytest.raises(ConfigError, match=r"^out='e.txt': unknown format '.txt'"):
        write_embeddings(Embeddings(np.ones((1, 4), np.float32), ["x"]), "e.txt")


# --------------------------------------------------------------- finding 4: the model's own device


class Reached(Exception):
    """Raised by a spy once it has seen the device the computation was sent to."""


def test_device_none_computes_on_the_models_own_device(trained, user_images, tiny_data,
                                                       monkeypatch):
    """``vlcontrast.load`` puts the model on CUDA when there is one; classify and embed_* sent
    their inputs to the CPU by default, so on a GPU machine the notebook code failed. The model is
    put on the meta device here (no GPU needed): the device the work is sent to must be its."""
    import vlcontrast.evaluation.embed as evaluation_embed
    import vlcontrast.evaluation.zeroshot as zeroshot
    import vlcontrast.inference.embed as inference_embed
    import vlcontrast.inference.images as images

    (model, preprocess, tokenizer), _ = trained
    meta = copy.deepcopy(model).to("meta")
    seen = []

    def spy(*args, device=None, **kwargs):
        seen.append(torch.device(device))
        raise Reached

    def spy_texts(model, tokens, device):
        seen.append(torch.device(device))
        raise Reached

    monkeypatch.setattr(zeroshot, "build_zeroshot_classifier", spy)
    monkeypatch.setattr(images, "embed_image_files", spy)
    monkeypatch.setattr(inference_embed, "_embed_shard_images", spy)
    monkeypatch.setattr(evaluation_embed, "encode_texts", spy_texts)
    paths = user_images[1][:2]
    calls = [lambda **d: classify(meta, preprocess, tokenizer, paths, LABELS, progress=False, **d),
             lambda **d: embed_images(meta, preprocess, paths=paths, progress=False, **d),
             lambda **d: embed_images(meta, preprocess, shards=str(tiny_data / "val"),
                                      progress=False, **d),
             lambda **d: embed_texts(meta, tokenizer, ["a cat"], progress=False, **d)]
    for call in calls:
        with pytest.raises(Reached):
            call()
    assert seen == [torch.device("meta")] * len(calls)
    seen.clear()
    for call in calls:  # a device given is used as given
        with pytest.raises(Reached):
            call(device="cpu")
    assert seen == [torch.device("cpu")] * len(calls)
    with pytest.raises(ConfigError, match=r"^device='gpu': not a device"):
        classify(model, preprocess, tokenizer, paths, LABELS, device="gpu", progress=False)


@pytest.mark.cuda
def test_a_model_loaded_on_cuda_classifies_and_embeds_without_a_device(trained, user_images):
    import vlcontrast

    model, preprocess, tokenizer = vlcontrast.load(trained[1], device="cuda")
    paths = user_images[1][:2]
    result = classify(model, preprocess, tokenizer, paths, LABELS, progress=False)
    assert result.probs.shape == (2, 3)
    assert embed_texts(model, tokenizer, ["a cat"], progress=False).vectors.shape[0] == 1
    assert embed_images(model, preprocess, paths=paths, progress=False).vectors.shape[0] == 2
