"""The zero-shot image-feature file (evaluation/image_cache.py): a second evaluation with the same
frozen tower reads the features instead of opening the images and gives the same metrics bit
for bit; another tower, another set or a changed file is a miss; the global RNG is left as it
was found, hit or miss."""

import copy

import pytest
import torch

from tests.evaluation.helpers import write_image_folder
from vlcontrast.evaluation import evaluate_zeroshot


@pytest.fixture()
def folder(tmp_path):
    write_image_folder(tmp_path / "set", ["cat", "dog", "fish"], per_class=4)
    return tmp_path / "set"


def _evaluate(model, preprocess, tokenizer, folder, cache):
    return evaluate_zeroshot(model, preprocess, tokenizer, str(folder),
                             templates=["a photo of a {c}."], batch_size=5, workers=0,
                             progress=False, image_cache=cache)


def test_a_hit_reads_no_image_and_gives_the_same_metrics_bit_for_bit(tiny, folder, tmp_path,
                                                                      monkeypatch):
    model, preprocess, tokenizer = tiny
    cache = tmp_path / "cache" / "zeroshot.pt"
    plain = _evaluate(model, preprocess, tokenizer, folder, None)
    torch.manual_seed(7)
    first = _evaluate(model, preprocess, tokenizer, folder, cache)
    after_miss = torch.random.get_rng_state()
    assert cache.is_file() and first == plain

    import vlcontrast.evaluation.runner as runner

    monkeypatch.setattr(runner, "build_zeroshot_loader",
                        lambda *a, **k: pytest.fail("a hit opened the images"))
    torch.manual_seed(7)
    second = _evaluate(model, preprocess, tokenizer, folder, cache)
    assert second == first
    # hit and miss leave the global RNG as they found it (a loader draws a seed from it)
    assert torch.equal(torch.random.get_rng_state(), after_miss)
    torch.manual_seed(7)
    assert torch.equal(torch.random.get_rng_state(), after_miss)


def test_another_tower_set_or_file_is_a_miss(tiny, folder, tmp_path):
    from vlcontrast.evaluation.datasets import resolve_zeroshot_data
    from vlcontrast.evaluation.image_cache import cache_key

    model, preprocess, tokenizer = tiny
    data = resolve_zeroshot_data(str(folder), templates=["a photo of a {c}."])
    key = cache_key(model, data, preprocess, batch_size=5, dtype=torch.float32)
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.visual.parameters()).add_(1e-3)
    assert cache_key(other, data, preprocess, batch_size=5, dtype=torch.float32)["tower"] != key["tower"]
    # the text tower is not part of the key: a training run moves it between evaluations
    text_moved = copy.deepcopy(model)
    with torch.no_grad():
        next(p for n, p in text_moved.named_parameters() if not n.startswith("visual.")).add_(1.0)
    assert cache_key(text_moved, data, preprocess, batch_size=5, dtype=torch.float32) == key
    assert cache_key(model, data, preprocess, batch_size=6, dtype=torch.float32) != key
    first = sorted((folder / "cat").iterdir())[0]
    first.write_bytes(first.read_bytes() + b"\0")
    changed = resolve_zeroshot_data(str(folder), templates=["a photo of a {c}."])
    assert cache_key(model, changed, preprocess, batch_size=5, dtype=torch.float32)["set"] != key["set"]

    # a miss recomputes and replaces the file: the metrics are those of the live tower
    cache = tmp_path / "zeroshot.pt"
    _evaluate(model, preprocess, tokenizer, folder, cache)
    shifted = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in shifted.visual.parameters():
            parameter.mul_(-1.0)
    assert (_evaluate(shifted, preprocess, tokenizer, folder, cache)
            == _evaluate(shifted, preprocess, tokenizer, folder, None))
