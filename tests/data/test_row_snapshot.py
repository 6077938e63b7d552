"""The row snapshot of an image-free stream (data/row_snapshot.py): a run that loads it yields the
batches and bad-sample counts of a run that reads the shards, reads no shard in its first epoch
and tokenizes nothing; a changed shard, another feature set or a disagreeing tokenizer is never
served stale rows."""

from __future__ import annotations

import os

import pytest
import torch

from tests.data.helpers import CountingTokenizer, add_cut_shard, config, make_shards
from vlcontrast.data import row_snapshot
from vlcontrast.data import stream as stream_module
from vlcontrast.data.loader import build_train_loader
from vlcontrast.train.batches import SeededTransform
from vlcontrast.train.feature_cache import ImagePlaceholder

DEFECTS = {(0, 1): "undecodable", (1, 3): "empty_caption", (2, 5): "missing_image"}


class Tokenizer(CountingTokenizer):
    """The stand-in tokenizer, counting the texts it is asked for."""

    def __init__(self, shift: int = 0):
        self.texts = 0
        self.shift = shift

    def __call__(self, texts):
        self.texts += len(texts)
        return super().__call__(texts) + self.shift


@pytest.fixture
def shards(tmp_path):
    folder = tmp_path / "shards"
    good = make_shards(folder, [10, 10, 10, 10], defects=DEFECTS)
    return folder, good


def placeholder(good, missing=()) -> SeededTransform:
    ids = torch.tensor(sorted(set(good) - set(missing)))
    return SeededTransform(ImagePlaceholder(ids), seed=7, random=False)


def run(folder, transform, tokenizer, snapshot_dir="", *, epochs=3, cache_mb=64, probe=None):
    cfg = config(str(folder / "{00000..00003}.tar"), batch_size=2, workers=0, num_samples=40,
                 id_space=50000, cache_mb=cache_mb)
    loader = build_train_loader(cfg, transform, tokenizer, seed=3, rank=0, world_size=1,
                                row_snapshot_dir=str(snapshot_dir))
    out, bad = [], []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        if probe is not None and epoch == 1:
            probe()
        out.append([(b.sample_ids.tolist(), b.texts.tolist()) for b in loader])
        bad.append(dict(loader.bad_samples))
    return out, bad


def counting_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    for module in (stream_module, row_snapshot):
        real = module.read_shard
        monkeypatch.setattr(module, "read_shard",
                            lambda url, _real=real, **kw: reads.append(url) or _real(url, **kw))
    return reads


def test_a_snapshot_run_yields_the_batches_and_counts_of_a_reading_run(shards, tmp_path,
                                                                        monkeypatch):
    folder, good = shards
    transform = placeholder(good, missing=[good[4]])  # one image failed when features were made
    plain = run(folder, transform, Tokenizer())
    first_tokenizer = Tokenizer()
    built = run(folder, transform, first_tokenizer, tmp_path / "rows")
    files = list((tmp_path / "rows").glob("rows-*.pt"))
    assert len(files) == 1
    reads, tokenizer = counting_reads(monkeypatch), Tokenizer()
    loaded = run(folder, transform, tokenizer, tmp_path / "rows")
    assert built == plain and loaded == plain
    # the undecodable image and the one the features lack
    assert plain[1][0]["not_in_feature_cache"] == 2 and plain[1][0]["empty_caption"] == 1
    assert reads == [] and tokenizer.texts <= row_snapshot.TOKEN_PROBES  # only the probes


def test_a_truncated_shard_is_read_and_counted_as_without_the_snapshot(shards, tmp_path,
                                                                       monkeypatch):
    folder, good = shards
    add_cut_shard(folder, 3, 10)
    transform = placeholder(good)
    plain = run(folder, transform, Tokenizer())
    run(folder, transform, Tokenizer(), tmp_path / "rows")
    reads = counting_reads(monkeypatch)
    loaded = run(folder, transform, Tokenizer(), tmp_path / "rows")
    assert loaded == plain and plain[1][2]["truncated_tar"] >= 1
    assert reads and all(url.endswith("00003.tar") for url in reads)  # only the cut shard


def test_a_changed_shard_or_feature_set_builds_a_new_snapshot(shards, tmp_path, monkeypatch):
    folder, good = shards
    rows = tmp_path / "rows"
    run(folder, placeholder(good), Tokenizer(), rows, epochs=1)
    run(folder, placeholder(good, missing=[good[0]]), Tokenizer(), rows, epochs=1)
    assert len(list(rows.glob("rows-*.pt"))) == 2
    shard = folder / "00001.tar"
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    reads = counting_reads(monkeypatch)
    assert run(folder, placeholder(good), Tokenizer(), rows) == run(folder, placeholder(good),
                                                                   Tokenizer())
    assert len(list(rows.glob("rows-*.pt"))) == 3 and len(set(reads)) == 4


def test_a_disagreeing_tokenizer_tokenizes_again_and_an_unreadable_file_is_rebuilt(
        shards, tmp_path, caplog):
    folder, good = shards
    rows = tmp_path / "rows"
    run(folder, placeholder(good), Tokenizer(), rows, epochs=1)
    shifted = Tokenizer(shift=5)
    with caplog.at_level("WARNING"):
        out = run(folder, placeholder(good), shifted, rows)
    assert out == run(folder, placeholder(good), Tokenizer(shift=5))
    assert "differ from this tokenizer" in caplog.text
    assert shifted.texts > row_snapshot.TOKEN_PROBES  # the stored rows were not used
    (file,) = rows.glob("rows-*.pt")
    file.write_bytes(b"not a torch file")
    assert run(folder, placeholder(good), Tokenizer(), rows) == run(folder, placeholder(good),
                                                                   Tokenizer())
    assert torch.load(file, weights_only=True)["key"]["format"] == row_snapshot.FORMAT


def test_no_snapshot_without_a_feature_cache_a_sample_cache_or_local_shards(shards, tmp_path):
    from tests.data.helpers import PREPROCESS

    folder, good = shards
    rows = tmp_path / "rows"
    run(folder, SeededTransform(PREPROCESS, seed=7, random=False), Tokenizer(), rows, epochs=1)
    run(folder, placeholder(good), Tokenizer(), rows, epochs=1, cache_mb=0)
    assert not rows.exists()
    pipe = type("Shards", (), {"urls": [f"pipe:cat {folder / '00000.tar'}"]})()
    assert row_snapshot.snapshot_key(pipe, None, frozenset()) is None


def test_a_resumed_run_with_the_snapshot_continues_exactly(shards, tmp_path):
    folder, good = shards
    cfg = config(str(folder / "{00000..00003}.tar"), batch_size=2, workers=0, num_samples=40,
                 id_space=50000, cache_mb=64)
    build = dict(seed=3, rank=0, world_size=1, row_snapshot_dir=str(tmp_path / "rows"))
    loader = build_train_loader(cfg, placeholder(good), Tokenizer(), **build)
    loader.set_epoch(0)
    whole = [b.sample_ids.tolist() for b in loader]
    loader = build_train_loader(cfg, placeholder(good), Tokenizer(), **build)
    loader.set_epoch(0)
    batches = iter(loader)
    head = [next(batches).sample_ids.tolist() for _ in range(3)]
    state = loader.state_dict()
    resumed = build_train_loader(cfg, placeholder(good), Tokenizer(), resume_state=state, **build)
    assert head + [b.sample_ids.tolist() for b in resumed] == whole


def test_the_file_round_trips_reasons_single_and_several_captions(tmp_path):
    snapshot = row_snapshot.RowSnapshot(
        shard=[0, 0, 1], row=[0, 1, 0], key=["000000000", "000000001", "000010000"],
        value=["empty_caption", ("a dog", 1), (("a cat", "the cat"), 10000)],
        captions=["a dog", "a cat", "the cat"], tokens=torch.arange(6, dtype=torch.int32).view(3, 2))
    key = {"format": row_snapshot.FORMAT, "shards": []}
    path = tmp_path / "rows.pt"
    row_snapshot._save(path, key, snapshot)
    loaded = row_snapshot._load(path, key)
    for field in ("shard", "row", "key", "value", "captions"):
        assert getattr(loaded, field) == getattr(snapshot, field), field
    assert torch.equal(loaded.tokens, snapshot.tokens)
    assert isinstance(loaded.value[2][0], tuple)
    assert row_snapshot._load(path, {**key, "shards": [["x"]]}) is None  # another key: a miss
    kept = list(loaded.rows(lambda image: torch.zeros(1), after_transform=True))
    assert kept[0][3] == "empty_caption" and kept[2][3][1:] == (("a cat", "the cat"), 10000)
    assert torch.equal(kept[1][3][0], torch.zeros(1))
