"""data.cache_mb: decoded rows kept in the loader worker, with batches identical to no cache."""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms as T

from tests.data.helpers import add_cut_shard, make_shards
from tests.data.helpers import PREPROCESS, CountingTokenizer, config
from vlcontrast.config import ConfigError, load_config
from vlcontrast.data import samples as samples_module
from vlcontrast.data import stream as stream_module
from vlcontrast.data.loader import build_train_loader
from vlcontrast.data.samples import Inspected
from vlcontrast.data.stream import SampleCache
from vlcontrast.train.batches import SeededTransform


class RandomShift:
    """A random augmentation that shows on flat-colour images."""

    def __call__(self, image):
        return T.functional.to_tensor(image) + torch.rand(())


def epochs(cfg, transform, n=3, *, probe=None):
    """Every batch of ``n`` epochs as (ids, texts, images); ``probe(loader)`` after each epoch."""
    loader = build_train_loader(cfg, transform, CountingTokenizer(), seed=3, rank=0, world_size=1)
    out = []
    for epoch in range(n):
        loader.set_epoch(epoch)
        if hasattr(transform, "epoch"):
            transform.epoch = epoch
        out.append([(b.sample_ids.tolist(), b.texts.tolist(), b.images) for b in loader])
        if probe is not None:
            probe(loader)
    return out, loader


def same(a, b) -> bool:
    return all(len(x) == len(y) and all(i == j and t == u and torch.equal(im, jm)
                                        for (i, t, im), (j, u, jm) in zip(x, y))
               for x, y in zip(a, b)) and len(a) == len(b)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("random", [False, True])
def test_cached_epochs_equal_uncached_epochs(uneven_shards, workers, random):
    pattern, _ = uneven_shards
    base = RandomShift() if random else PREPROCESS

    def run(cache_mb):
        transform = SeededTransform(base, seed=7, random=random)
        return epochs(config(pattern, workers=workers, cache_mb=cache_mb), transform)[0]

    plain, cached = run(0), run(64)
    assert same(plain, cached)
    assert [ids for ids, _, _ in plain[0]] != [ids for ids, _, _ in plain[1]]  # epochs differ


def test_later_epochs_read_no_shard_and_decode_nothing(uneven_shards, monkeypatch):
    pattern, good = uneven_shards
    reads, opened, transformed = [], [], []
    real_read, real_open = stream_module.read_shard, samples_module.open_image
    monkeypatch.setattr(stream_module, "read_shard",
                        lambda url, **kw: reads.append(url) or real_read(url, **kw))
    monkeypatch.setattr(samples_module, "open_image",
                        lambda *a, **kw: opened.append(1) or real_open(*a, **kw))

    class Counted:
        random = False

        def __call__(self, image):
            transformed.append(1)
            return PREPROCESS(image)

    counts = []
    _, loader = epochs(config(pattern, workers=0, cache_mb=64), Counted(),
                       probe=lambda _: counts.append((len(reads), len(opened), len(transformed))))
    first = counts[0]
    assert first[0] > 0 and first[1] == first[2] >= loader.steps_per_epoch * 4
    assert counts[1] == counts[2] == first  # epochs 2 and 3 came from memory
    cache = loader._stream.cache
    assert cache.after_transform and len(cache) == len(good) and not cache.full


def test_a_random_transform_runs_on_kept_images_every_epoch(uneven_shards, monkeypatch):
    pattern, _ = uneven_shards
    opened = []
    real_open = samples_module.open_image
    monkeypatch.setattr(samples_module, "open_image",
                        lambda *a, **kw: opened.append(1) or real_open(*a, **kw))
    transform = SeededTransform(RandomShift(), seed=1)
    counts = []
    out, loader = epochs(config(pattern, workers=0, cache_mb=64), transform,
                         probe=lambda _: counts.append(len(opened)))
    assert counts[0] > 0 and counts[1] == counts[2] == counts[0]
    cache = loader._stream.cache
    assert not cache.after_transform
    assert all(isinstance(cache.get(*row)[1], Inspected) for row in list(cache._rows)[:5])
    # a new shift each epoch: the same sample's image differs between epochs
    first = {i: im for ids, _, images in out[0] for i, im in zip(ids, images)}
    second = {i: im for ids, _, images in out[1] for i, im in zip(ids, images)}
    assert any(not torch.equal(first[i], second[i]) for i in first.keys() & second.keys())


def test_bad_rows_and_a_truncated_shard_count_the_same_every_epoch(tmp_path):
    defects = {(0, 1): "undecodable", (1, 3): "empty_caption", (2, 5): "missing_image"}
    make_shards(tmp_path, [10, 10, 10, 10], defects=defects)
    add_cut_shard(tmp_path, 4, 10)

    def run(cache_mb):
        cfg = config(str(tmp_path / "{00000..00004}.tar"), batch_size=2, workers=0,
                     num_samples=40, id_space=50000, cache_mb=cache_mb)
        bad = []
        out, _ = epochs(cfg, PREPROCESS, probe=lambda loader: bad.append(loader.bad_samples))
        return out, bad

    (plain, plain_bad), (cached, cached_bad) = run(0), run(64)
    assert same(plain, cached) and plain_bad == cached_bad
    assert cached_bad[2]["truncated_tar"] > cached_bad[0]["truncated_tar"]  # read every epoch
    assert cached_bad[2]["undecodable_image"] == 3 * cached_bad[0]["undecodable_image"] == 3


def test_a_full_cache_keeps_the_first_rows_and_reads_the_rest(uneven_shards):
    pattern, good = uneven_shards
    cfg = config(pattern, workers=0, cache_mb=1)
    loader = build_train_loader(cfg, PREPROCESS, CountingTokenizer(), seed=3, rank=0,
                                world_size=1)
    loader._stream.cache.max_bytes = 20_000  # about 40 rows of 8 x 8 decoded images
    reference = epochs(config(pattern, workers=0), PREPROCESS)[0]
    out = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        out.append([(b.sample_ids.tolist(), b.texts.tolist(), b.images) for b in loader])
    cache = loader._stream.cache
    assert cache.full and 0 < len(cache) < len(good) // 2 and cache.bytes <= 20_000
    assert same(out, reference)


def test_sample_cache_holds_only_complete_segments():
    cache = SampleCache(10_000, after_transform=True)
    for row in (0, 1, 3):
        cache.keep(2, row, f"k{row}", (torch.zeros(3, dtype=torch.uint8), "cap", row))
    cache.keep(2, 2, "k2", "undecodable_image")
    assert cache.holds(2, 0, 4) and not cache.holds(2, 0, 5) and not cache.holds(1, 0, 1)
    assert cache.get(2, 2) == ("k2", "undecodable_image")
    assert cache.bytes == 4 * stream_module.ENTRY_OVERHEAD + 4 * 2 + 3 * (3 + 3)
    big = (torch.zeros(10_000, dtype=torch.uint8), "cap", 9)
    cache.keep(2, 4, "k4", big)
    assert cache.full and not cache.holds(2, 4, 1)
    cache.keep(2, 5, "k5", "missing_image")  # nothing more once full
    assert len(cache) == 4


def test_negative_cache_size_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"data\.cache_mb"):
        load_config(None, ["data.train=x", "train.steps=1", "data.cache_mb=-1"])


def test_a_feature_cache_placeholder_decodes_no_image_and_keeps_the_same_batches(tmp_path,
                                                                                 monkeypatch):
    """Under model.lock_image_features the loader opens no image; a sample the cache lacks (its
    image failed when the cache was written) is skipped like a bad image, so the ids and
    captions of every batch are those of the decoding loader."""
    from vlcontrast.train.feature_cache import ImagePlaceholder

    make_shards(tmp_path, [10, 10, 10], defects={(0, 1): "undecodable", (2, 5): "undecodable"})
    pattern = str(tmp_path / "{00000..00002}.tar")

    def cfg(cache_mb=0):
        return config(pattern, batch_size=2, workers=0, num_samples=30, id_space=50000,
                      cache_mb=cache_mb)

    decoded_bad = []
    decoded, _ = epochs(cfg(), PREPROCESS, n=2,
                        probe=lambda loader: decoded_bad.append(dict(loader.bad_samples)))
    good = {i for epoch in decoded for ids, _, _ in epoch for i in ids}
    opened = []
    real_open = samples_module.open_image
    monkeypatch.setattr(samples_module, "open_image",
                        lambda *a, **kw: opened.append(1) or real_open(*a, **kw))
    for cache_mb in (0, 64):
        placeholder = SeededTransform(ImagePlaceholder(torch.tensor(sorted(good))), seed=7,
                                      random=False)
        bad = []
        out, _ = epochs(cfg(cache_mb), placeholder, n=2,
                        probe=lambda loader: bad.append(dict(loader.bad_samples)))
        assert [[(ids, texts) for ids, texts, _ in e] for e in out] == \
               [[(ids, texts) for ids, texts, _ in e] for e in decoded]
        assert all(images.shape == (2, 0) for e in out for _, _, images in e)
        # counted where the decoding loader counted its bad images, under the cache's reason
        assert [b.get("not_in_feature_cache") for b in bad] == \
               [b.get("undecodable_image") for b in decoded_bad]
        assert not any(b.get("undecodable_image") for b in bad)
    assert opened == []
