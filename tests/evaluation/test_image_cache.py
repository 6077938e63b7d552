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


# ------------------------------------------------------------------------------------ retrieval


def _retrieve(model, preprocess, tokenizer, shards, cache, **kw):
    from vlcontrast.evaluation import evaluate_retrieval

    return evaluate_retrieval(model, preprocess, tokenizer, str(shards), batch_size=4, workers=0,
                              progress=False, image_cache=cache, **kw)


@pytest.fixture()
def shards(tmp_path):
    from tests.evaluation.helpers import write_retrieval_shards

    # several captions per image (a JSON list) and a broken image: what the file must keep
    write_retrieval_shards(tmp_path / "shards", 15, per_shard=4,
                           captions_per_image=lambda i: 1 + i % 3, style="json", broken=(5,))
    return tmp_path / "shards"


def test_a_retrieval_hit_reads_no_shard_and_gives_the_same_metrics_bit_for_bit(
        tiny, shards, tmp_path, monkeypatch):
    import vlcontrast.evaluation.embed as embed

    model, preprocess, tokenizer = tiny
    cache = tmp_path / "cache" / "retrieval.pt"
    plain = _retrieve(model, preprocess, tokenizer, shards, None)
    assert plain["num_skipped"] == 1
    torch.manual_seed(3)
    first = _retrieve(model, preprocess, tokenizer, shards, cache)
    after_miss = torch.random.get_rng_state()
    assert cache.is_file() and first == plain
    monkeypatch.setattr(embed, "encode_in_lockstep",
                        lambda *a, **k: pytest.fail("a hit read the retrieval shards"))
    torch.manual_seed(3)
    second = _retrieve(model, preprocess, tokenizer, shards, cache)
    assert second == first
    assert torch.equal(torch.random.get_rng_state(), after_miss)
    # the text tower is live: a moved text tower gives its own metrics from the kept images
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for name, parameter in moved.named_parameters():
            if not name.startswith("visual.") and parameter.dim() > 1:
                parameter.mul_(0.5).add_(0.01)
    monkeypatch.undo()
    expected = _retrieve(moved, preprocess, tokenizer, shards, None)
    monkeypatch.setattr(embed, "encode_in_lockstep",
                        lambda *a, **k: pytest.fail("a hit read the retrieval shards"))
    assert _retrieve(moved, preprocess, tokenizer, shards, cache) == expected
    assert expected != first


def test_a_retrieval_miss_for_another_tower_shard_or_limit(tiny, shards, tmp_path):
    from vlcontrast.data.samples import DEFAULT_MEMBERS
    from vlcontrast.evaluation.datasets import resolve_shards
    from vlcontrast.evaluation.image_cache import retrieval_key

    model, preprocess, tokenizer = tiny
    paths = resolve_shards(str(shards))

    def key(m=model, **kw):
        args = dict(batch_size=4, dtype=torch.float32, max_samples=0, members=DEFAULT_MEMBERS)
        return retrieval_key(m, paths, preprocess, **{**args, **kw})

    base = key()
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.visual.parameters()).add_(1e-3)
    assert key(other)["tower"] != base["tower"]
    assert key(max_samples=8) != base and key(batch_size=5) != base
    first = shards / "00000.tar"
    first.write_bytes(first.read_bytes() + b"\0" * 1024)
    assert key()["shards"] != base["shards"]
    assert retrieval_key(model, [f"pipe:cat {first}"], preprocess, batch_size=4,
                         dtype=torch.float32, max_samples=0, members=DEFAULT_MEMBERS) is None
    # a miss recomputes and replaces the file: the metrics are the live tower's
    cache = tmp_path / "retrieval.pt"
    _retrieve(model, preprocess, tokenizer, shards, cache)
    shifted = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in shifted.visual.parameters():
            parameter.mul_(-1.0)
    assert (_retrieve(shifted, preprocess, tokenizer, shards, cache)
            == _retrieve(shifted, preprocess, tokenizer, shards, None))
    assert _retrieve(model, preprocess, tokenizer, shards, cache, max_samples=6) == \
        _retrieve(model, preprocess, tokenizer, shards, None, max_samples=6)
