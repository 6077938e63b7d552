"""The one shard-spec grammar: every entry point (loader, check, evaluation, preflight) accepts the
same specs and reads the same shards; training and evaluation skip and count the same samples."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.data.helpers import KEY_STRIDE, make_shards, sample_row, write_shard
from tests.data.helpers import PREPROCESS, CountingTokenizer, config, flat, run_epoch
from vlcontrast.config import ConfigError, RunConfig
from vlcontrast.data import check_shards, check_spec
from vlcontrast.errors import LoaderError, ShardsNotFoundError
from vlcontrast.data.loader import build_train_loader
from vlcontrast.data.spec import parse_spec, split_members
from vlcontrast.evaluation.datasets import (ROW_BITS, Skipped, build_retrieval_loader,
                                            resolve_shards)


def test_members_split_on_top_level_commas_only():
    assert split_members("/a/{0,1}.tar, /b/x.tar") == ["/a/{0,1}.tar", "/b/x.tar"]
    assert split_members("/a/0.tar,pipe:curl -s 'http://h/{0..1}.tar,x' ") == [
        "/a/0.tar", "pipe:curl -s 'http://h/{0..1}.tar,x'"]
    sources = parse_spec("/a/{0..1}.tar,/b/c.tar@2.5::s3://user@bucket/x.tar")
    assert [(s.pattern, s.weight) for s in sources] == [
        ("/a/{0..1}.tar,/b/c.tar", 2.5), ("s3://user@bucket/x.tar", 1.0)]


def test_an_existing_path_with_commas_is_one_member(tmp_path):
    odd = tmp_path / "a,b@2"
    make_shards(odd, [3])
    assert check_spec("data.val", str(odd)) == [str(odd / "00000.tar")]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """``img/`` four numbered shards of 6; ``cb/`` CLIP_benchmark layout (test/nshards.txt,
    test/0.tar, test/1.tar; img2dataset keys of shards 10 and 11, 5 rows each, no sizes.json)."""
    root = tmp_path_factory.mktemp("grammar")
    make_shards(root / "img", [6, 6, 6, 6])
    split = root / "cb" / "test"
    split.mkdir(parents=True)
    for index in range(2):
        write_shard(split / f"{index}.tar", [sample_row(10 + index, r) for r in range(5)])
    (split / "nshards.txt").write_text("2\n")
    return root


def img_ids(*shards):
    return {s * KEY_STRIDE + r for s in shards for r in range(6)}


CB_IDS = {s * KEY_STRIDE + r for s in (10, 11) for r in range(5)}

# spec (relative to the tree) -> (shard files, the sample ids they hold, needs resampled mode)
SPECS = {
    "comma list": ("img/00000.tar,img/00002.tar", ["img/00000.tar", "img/00002.tar"],
                   img_ids(0, 2), False),
    "glob": ("img/0000[13].tar", ["img/00001.tar", "img/00003.tar"], img_ids(1, 3), False),
    "CLIP_benchmark folder": ("cb", ["cb/test/0.tar", "cb/test/1.tar"], CB_IDS, False),
    "directory": ("img", [f"img/0000{i}.tar" for i in range(4)], img_ids(0, 1, 2, 3), False),
    ":: with weights": ("img/{00000..00001}.tar@3::cb@0.5",
                        ["img/00000.tar", "img/00001.tar", "cb/test/0.tar", "cb/test/1.tar"],
                        img_ids(0, 1) | CB_IDS, True),
}


def absolute(tree: Path, spec: str) -> str:
    return "::".join(",".join(str(tree / member) for member in source.split(","))
                     for source in spec.split("::"))


@pytest.mark.parametrize("name", list(SPECS))
def test_every_entry_point_accepts_the_same_spec(tree, name, tmp_path):
    relative, files, ids, weighted = SPECS[name]
    spec = absolute(tree, relative)
    urls = [str(tree / f) for f in files]
    rows = len(ids)

    # preflight: the data package's check, and the trainer's preflight itself
    assert check_spec("data.train", spec) == urls
    from vlcontrast.train.preflight import preflight

    run = RunConfig(output_dir=str(tmp_path / "run"))
    run.data.train = run.data.val = run.eval.retrieval = spec
    preflight(run)

    # evaluation
    assert resolve_shards(spec) == urls
    loader = build_retrieval_loader(spec, PREPROCESS, batch_size=4)
    keys = [k for batch in loader.loader for k in batch[2].tolist()]
    assert len(keys) == len(set(keys)) == rows

    # prep check
    report = check_shards(spec, progress=False)
    assert report["num_shards"] == len(urls) and report["num_samples"] == rows
    assert report["unreadable_shards"] == []

    # the training loader (pipe-free specs without sizes.json need num_samples)
    mode = "resampled" if weighted else "epoch"
    cfg = config(spec, batch_size=2, mode=mode, num_samples=rows, id_space=12 * KEY_STRIDE)
    train = build_train_loader(cfg, PREPROCESS, CountingTokenizer(), seed=0, rank=0,
                               world_size=1)
    seen = flat(run_epoch(train))
    assert set(seen) <= ids and train.bad_samples == {}
    if not weighted:
        assert sorted(seen) == sorted(ids)


@pytest.mark.parametrize("spec,match", [
    ("img/{00000..00009}.tar", r"6 of 10 shards do not exist"),
    ("nowhere/*.tar", r"matches no shard files"),
    ("img/00000.tar::::img/00001.tar", r"empty source"),
    ("img/00000.tar@0", r"weight 0 must be > 0"),
])
def test_every_entry_point_refuses_the_same_spec_naming_it(tree, tmp_path, spec, match):
    spec = str(tree / spec)
    with pytest.raises(ConfigError, match=match) as refused:
        check_spec("eval.retrieval", spec)
    assert "eval.retrieval" in str(refused.value)
    with pytest.raises(LoaderError, match=match):
        build_train_loader(config(spec), PREPROCESS, CountingTokenizer(), seed=0, rank=0,
                           world_size=1)
    with pytest.raises(ConfigError, match=match):
        resolve_shards(spec)
    with pytest.raises(ConfigError, match=match):
        check_shards(spec, progress=False)
    if "exist" in match or "matches" in match:  # callers that catch FileNotFoundError still do
        with pytest.raises(FileNotFoundError):
            resolve_shards(spec)
        assert issubclass(ShardsNotFoundError, FileNotFoundError)


def test_evaluation_and_training_skip_and_count_the_same_samples(tmp_path):
    defects = {(0, 1): "undecodable", (0, 2): "missing_image", (1, 0): "missing_caption",
               (1, 3): "empty_caption", (1, 5): "not_utf8", (0, 7): "bomb"}
    good = make_shards(tmp_path, [10, 10], defects=defects)
    pixels = 32 * 32  # the bomb PNG is 64 x 64

    cfg = config(str(tmp_path), batch_size=2, num_samples=len(good), shuffle_buffer=0)
    cfg.max_image_pixels = pixels
    train = build_train_loader(cfg, PREPROCESS, CountingTokenizer(), seed=0, rank=0,
                               world_size=1)
    trained = flat(run_epoch(train))

    evaluation = build_retrieval_loader(str(tmp_path), PREPROCESS, batch_size=3,
                                        max_image_pixels=pixels)
    reasons: dict[str, int] = {}
    kept = []
    for images, captions, keys, skipped in evaluation.loader:
        for reason, n in skipped.reasons.items():
            reasons[reason] = reasons.get(reason, 0) + n
        kept += [(k >> ROW_BITS) * KEY_STRIDE + (k & ((1 << ROW_BITS) - 1)) for k in keys.tolist()]

    assert reasons == train.bad_samples == {
        "undecodable_image": 1, "missing_image": 1, "missing_caption": 1, "empty_caption": 1,
        "caption_not_utf8": 1, "decompression_bomb": 1}
    assert sorted(kept) == sorted(trained) == sorted(good)
    assert isinstance(skipped, int)  # embed.py adds them up as ints
    import pickle

    batch_skipped = pickle.loads(pickle.dumps(Skipped({"empty_caption": 2, "truncated_tar": 1})))
    assert batch_skipped == 2 and batch_skipped.reasons["truncated_tar"] == 1  # from workers


@pytest.mark.parametrize("key, then", [
    ("data.train", "and train on OUT"),
    ("data.val", "and give data.val=OUT"),
    ("eval.retrieval", "and give eval.retrieval=OUT"),
    ("--data", "and evaluate OUT (--data OUT)"),
])
def test_the_prep_hint_for_images_says_what_to_do_with_the_shards_where_they_are_read(
        tmp_path, key, then):
    """An image folder or file given as shards: convert it with prep, then use the shards where
    this option reads them (every option's hint said "and train on OUT")."""
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "cat.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 600)
    with pytest.raises((ConfigError, ShardsNotFoundError)) as folder:
        check_spec(key, str(tmp_path / "photos"))
    assert str(folder.value).endswith(then), str(folder.value)
    with pytest.raises(ConfigError) as file:
        check_spec(key, str(tmp_path / "photos" / "cat.png"))
    assert str(file.value).endswith(then), str(file.value)
