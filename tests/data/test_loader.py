"""Training loader: shard specs, epoch/resampled splitting, sample ids, bad samples, resume."""

from __future__ import annotations

import collections
import json
import os
import tarfile

import pytest
import torch
import torchvision.transforms as T

from tests.data.helpers import (IMAGE_SIZE, KEY_STRIDE, PREPROCESS, CountingTokenizer, add_cut_shard,
                                add_member, caption_of, color_of, config, flat, jpeg_bytes,
                                make_shards, run_epoch, sample_row, write_shard)
from tests.distributed import run_distributed
from vlcontrast.data import loader as loader_module
from vlcontrast.data.loader import (LoaderError, build_train_loader, epoch_order, group_members,
                                    parse_train_spec, read_shard, virtual_segments)

# ---------------------------------------------------------------------------------------------
# specs and fail-fast errors


def test_spec_parses_sources_weights_and_pipe_urls():
    sources = parse_train_spec("/a/{00000..00003}.tar@2.5::pipe:curl -s http://h/{0..1}.tar"
                               "::/c/x.tar@1e-1")
    assert [s.pattern for s in sources] == ["/a/{00000..00003}.tar",
                                            "pipe:curl -s http://h/{0..1}.tar", "/c/x.tar"]
    assert [s.weight for s in sources] == [2.5, 1.0, 0.1]
    assert parse_train_spec("s3://user@bucket/{0..1}.tar")[0].weight == 1.0
    with pytest.raises(LoaderError, match="empty source"):
        parse_train_spec("/a.tar::::/b.tar")


def test_pattern_matching_nothing_names_the_pattern(tmp_path):
    pattern = str(tmp_path / "{00000..00009}.tar")
    with pytest.raises(LoaderError, match=r"matches no shard files: it expands to 10 paths"):
        build_train_loader(config(pattern), PREPROCESS, CountingTokenizer(), seed=0, rank=0,
                           world_size=1)
    with pytest.raises(LoaderError, match="matches no shard files"):
        build_train_loader(config(str(tmp_path / "*.tar")), PREPROCESS, CountingTokenizer(),
                           seed=0, rank=0, world_size=1)


def test_more_slots_than_shards_read_disjoint_row_ranges(uneven_shards):
    # 6 shards, 8 ranks x 1 slot (workers=0): ranges are cut in rows, so shards are shared.
    pattern, good = uneven_shards
    ranks = simulated_ranks(pattern, 8, workers=0, batch_size=3)
    steps = 128 // (3 * 8)
    assert [s for s, _ in ranks] == [steps] * 8
    ids = [i for _, batches in ranks for i in flat(batches)]
    assert len(ids) == len(set(ids)) == steps * 3 * 8 and set(ids) <= set(good)
    # resampled mode draws with replacement and never had a limit
    loader = build_train_loader(config(pattern, workers=2, mode="resampled"), PREPROCESS,
                                CountingTokenizer(), seed=0, rank=0, world_size=4)
    assert loader.steps_per_epoch == 128 // 16


def test_local_shards_without_sizes_are_counted_pipe_shards_need_num_samples(tmp_path):
    make_shards(tmp_path, [5, 4], metadata=False)
    pattern = str(tmp_path / "{00000..00001}.tar")
    loader = build_train_loader(config(pattern, batch_size=3), PREPROCESS, CountingTokenizer(),
                                seed=0, rank=0, world_size=1)
    assert loader.num_samples == 9 and loader.steps_per_epoch == 3  # counted from tar headers
    piped = "pipe:cat " + pattern
    with pytest.raises(LoaderError, match="set data.num_samples"):
        build_train_loader(config(piped), PREPROCESS, CountingTokenizer(), seed=0, rank=0,
                           world_size=1)
    make_shards(tmp_path, [5, 5], metadata=False)
    loader = build_train_loader(config(pattern, num_samples=10, batch_size=2), PREPROCESS,
                                CountingTokenizer(), seed=0, rank=0, world_size=1)
    assert loader.id_space == 0 and loader.steps_per_epoch == 5
    assert sorted(flat(run_epoch(loader))) == [0, 1, 2, 3, 4, 10000, 10001, 10002, 10003, 10004]


# ---------------------------------------------------------------------------------------------
# epoch mode


def test_virtual_segments_cover_ranges_and_wrap():
    sizes = [3, 5, 2]
    assert list(virtual_segments(sizes, 2, 4)) == [(0, 2, 1), (1, 0, 3)]
    assert list(virtual_segments(sizes, 9, 4)) == [(2, 1, 1), (0, 0, 3)]


def test_epoch_covers_every_sample_once_with_aligned_images_and_texts(uneven_shards):
    pattern, good = uneven_shards
    loader = build_train_loader(config(pattern, workers=2), PREPROCESS, CountingTokenizer(),
                                seed=3, rank=0, world_size=1)
    assert (loader.steps_per_epoch, loader.num_samples, loader.id_space) == (32, 128, 60000)
    seen = []
    for batch in loader:
        assert batch.images.shape == (4, 3, IMAGE_SIZE, IMAGE_SIZE)
        assert batch.sample_ids.dtype == torch.long and batch.texts.dtype == torch.long
        for image, text, sample_id in zip(batch.images, batch.texts, batch.sample_ids.tolist()):
            assert text[0].item() == sample_id  # caption of this very sample
            expected = torch.tensor(color_of(sample_id), dtype=torch.float) / 255
            assert torch.allclose(image.mean(dim=(1, 2)), expected, atol=4 / 255)
            seen.append(sample_id)
    assert sorted(seen) == sorted(good)
    assert loader.seen_samples == 128 and loader.bad_samples == {}


def test_epochs_shuffle_deterministically(uneven_shards):
    pattern, _ = uneven_shards
    assert epoch_order(6, 0, 0) == epoch_order(6, 0, 0) != epoch_order(6, 0, 1)

    def first_epochs(seed):
        loader = build_train_loader(config(pattern, workers=1), PREPROCESS, CountingTokenizer(),
                                    seed=seed, rank=0, world_size=1)
        epoch0 = run_epoch(loader)
        loader.set_epoch(1)
        return epoch0, run_epoch(loader)

    a0, a1 = first_epochs(0)
    b0, b1 = first_epochs(0)
    assert a0 == b0 and a1 == b1
    assert a0 != a1 and sorted(flat(a0)) == sorted(flat(a1))
    assert first_epochs(1)[0] != a0


def simulated_ranks(pattern, world_size, **overrides):
    result = []
    for rank in range(world_size):
        loader = build_train_loader(config(pattern, **overrides), PREPROCESS,
                                    CountingTokenizer(), seed=0, rank=rank,
                                    world_size=world_size)
        result.append((loader.steps_per_epoch, run_epoch(loader)))
    return result


def test_ranks_get_disjoint_samples_and_equal_steps_with_uneven_shards(uneven_shards):
    pattern, good = uneven_shards
    ranks = simulated_ranks(pattern, 3, workers=2, batch_size=5)
    steps = 128 // (5 * 3)
    assert [s for s, _ in ranks] == [steps] * 3
    assert [len(batches) for _, batches in ranks] == [steps] * 3
    ids = [set(flat(batches)) for _, batches in ranks]
    assert all(len(i) == steps * 5 for i in ids)
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    assert set().union(*ids) <= set(good)


def _distributed_epoch(rank, world_size, pattern):
    import multiprocessing

    # Ranks started by torchrun/deepspeed fork their DataLoader workers; the test helper spawns
    # ranks, and spawned workers would re-import torch (20 s on two cores).
    multiprocessing.set_start_method("fork", force=True)
    loader = build_train_loader(config(pattern, workers=2, batch_size=4), PREPROCESS,
                                CountingTokenizer(), seed=0, rank=rank, world_size=world_size)
    ids = []
    for batch in loader:
        ids.append(batch.sample_ids.tolist())
        # every rank takes the same number of steps: this collective would hang otherwise
        torch.distributed.all_reduce(torch.ones(1))
    return loader.steps_per_epoch, ids


@pytest.mark.slow
def test_two_process_ranks_disjoint_with_equal_step_counts(uneven_shards):
    pattern, good = uneven_shards
    (steps0, ids0), (steps1, ids1) = run_distributed(_distributed_epoch, 2, pattern)
    assert steps0 == steps1 == 128 // 8
    assert len(ids0) == len(ids1) == steps0
    assert not set(flat(ids0)) & set(flat(ids1))
    assert sorted(flat(ids0) + flat(ids1)) == sorted(good)


def test_num_samples_above_the_shards_is_an_error(uneven_shards):
    pattern, _ = uneven_shards
    with pytest.raises(LoaderError, match="num_samples=500 exceeds the 128 samples"):
        build_train_loader(config(pattern, num_samples=500), PREPROCESS, CountingTokenizer(),
                           seed=0, rank=0, world_size=1)


def test_fewer_samples_than_one_global_batch_names_the_batch_size_to_use(uneven_shards):
    from vlcontrast.errors import ConfigError

    pattern, _ = uneven_shards
    with pytest.raises(ConfigError, match=r"^data: 128 samples per epoch are fewer than one global "
                                          r"batch \(100 x 2 ranks = 200\); set data.batch_size "
                                          r"to at most 64, or train on more data$"):
        build_train_loader(config(pattern, batch_size=100), PREPROCESS, CountingTokenizer(),
                           seed=0, rank=0, world_size=2)


def test_a_missing_shard_pattern_says_what_to_give():
    from vlcontrast.data.spec import expand_member

    with pytest.raises(LoaderError, match=r"data.train pattern 'data/nope' matches no shard files"
                                          r".*; give a folder of .tar shards, a brace pattern"):
        expand_member("data/nope")


# ---------------------------------------------------------------------------------------------
# resampled mode and mixing


def test_resampled_mode_nominal_epoch_and_weights(tmp_path):
    make_shards(tmp_path / "a", [20, 20])
    make_shards(tmp_path / "b", [20, 20])
    spec = f"{tmp_path}/a/{{00000..00001}}.tar@4::{tmp_path}/b/{{00000..00001}}.tar"
    loader = build_train_loader(config(spec, mode="resampled", num_samples=400, workers=2),
                                PREPROCESS, CountingTokenizer(), seed=0, rank=0, world_size=1)
    # Two sources, each with its own manifest: source b's ids are shifted past source a's space.
    assert loader.id_space == 2 * 2 * KEY_STRIDE and loader.steps_per_epoch == 100
    ids = flat(run_epoch(loader))
    assert len(ids) == 400
    from_a = sum(i < 2 * KEY_STRIDE for i in ids)
    assert from_a / len(ids) > 0.65  # expected 4/5; whole shards are drawn, so it is lumpy
    assert len(set(ids)) < len(ids)  # drawn with replacement
    with pytest.raises(LoaderError, match="weights need data.mode=resampled"):
        build_train_loader(config(spec), PREPROCESS, CountingTokenizer(), seed=0, rank=0,
                           world_size=1)


# ---------------------------------------------------------------------------------------------
# ids


def test_sample_id_comes_from_json_key_else_tar_key(tmp_path):
    rows = [sample_row(0, r) for r in range(4)]
    for row in rows[:2]:  # tar keys renamed; json still holds the img2dataset key
        row["__key__"] = "renamed_" + row["__key__"]
    rows[3]["json"] = b"{}"  # no key in json: the tar key is the id
    write_shard(tmp_path / "00000.tar", rows)
    (tmp_path / "sizes.json").write_text(json.dumps({"00000.tar": 4}))
    loader = build_train_loader(config(str(tmp_path / "00000.tar"), batch_size=4, id_space=10),
                                PREPROCESS, CountingTokenizer(), seed=0, rank=0, world_size=1)
    assert loader.id_space == 10
    assert sorted(flat(run_epoch(loader))) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------
# bad samples


def test_bad_samples_are_skipped_and_counted_per_reason(tmp_path):
    defects = {(0, 1): "undecodable", (0, 2): "missing_image", (1, 0): "missing_caption",
               (1, 3): "empty_caption", (2, 5): "not_utf8", (3, 7): "bomb"}
    good = make_shards(tmp_path, [10, 10, 10, 10], defects=defects)
    add_cut_shard(tmp_path, 4, 10)  # a fifth shard cut in the middle of a member: truncated tar

    cfg = config(str(tmp_path / "{00000..00004}.tar"), batch_size=2, workers=2, num_samples=40,
                 id_space=50000)
    cfg.max_image_pixels = 32 * 32  # proposed DataConfig field; the bomb PNG is 64 x 64
    loader = build_train_loader(cfg, PREPROCESS, CountingTokenizer(), seed=0, rank=0,
                                world_size=1)
    ids = flat(run_epoch(loader))
    assert len(ids) == 40
    assert set(ids) <= set(good) | {4 * KEY_STRIDE + r for r in range(10)}
    bad = loader.bad_samples
    # short slots read on into the 10 unused samples, then wrap: repeats <= skipped samples
    assert len(ids) - len(set(ids)) <= sum(v for k, v in bad.items() if k != "truncated_tar") - 10
    for reason in ("undecodable_image", "missing_image", "missing_caption", "empty_caption",
                   "caption_not_utf8", "decompression_bomb"):
        assert bad.get(reason) == 1, (reason, bad)
    assert bad["truncated_tar"] >= 1  # per read of the cut shard
    # each read of the cut shard loses the rows after the cut (and the partial row before it)
    assert bad["truncated_tar"] <= bad["missing_samples"] <= 9 * bad["truncated_tar"]
    assert loader.state_dict()["bad_samples"] == bad


def test_bad_sample_rate_above_limit_stops_with_a_clear_error(tmp_path):
    defects = {(s, r): "undecodable" for s in range(2) for r in range(0, 40, 2)}
    make_shards(tmp_path, [40, 40], defects=defects)
    cfg = config(str(tmp_path / "{00000..00001}.tar"), num_samples=40, batch_size=4,
                 max_bad_fraction=0.05, workers=1)
    loader = build_train_loader(cfg, PREPROCESS, CountingTokenizer(), seed=0, rank=0,
                                world_size=1)
    with pytest.raises(LoaderError, match=r"undecodable_image.*max_bad_fraction|"
                                          r"max_bad_fraction.*undecodable_image"):
        run_epoch(loader)
    # the same shards pass with a tolerant limit
    cfg.max_bad_fraction = 0.6
    loader = build_train_loader(cfg, PREPROCESS, CountingTokenizer(), seed=0, rank=0,
                                world_size=1)
    assert len(flat(run_epoch(loader))) == 40
    assert loader.bad_samples["undecodable_image"] >= 10


def test_rate_is_checked_in_main_process_across_workers():
    bad = {"undecodable_image": 3, "truncated_tar": 5}
    assert loader_module.bad_rate_error(bad, 100, 0.05, "x") is None
    error = loader_module.bad_rate_error(bad, 50, 0.05, "data (rank 0)")
    assert error is not None and "3 of 50 samples were bad" in str(error)


# ---------------------------------------------------------------------------------------------
# tar format: webdataset's end-of-shard marker, odd members, img2dataset's own writer


def test_end_of_shard_marker_and_odd_members(tmp_path):
    # webdataset >= 0.2.96 puts {} between shards in the member stream; open_clip's own grouping
    # (group_by_keys_nothrow) raises KeyError('fname') on it.
    entries = [{"fname": "a/001.jpg", "data": b"1"}, {"fname": "a/001.txt", "data": b"t1"}, {},
               {"fname": "a/001.jpg", "data": b"2"}, {"fname": "a/002.txt", "data": b"t2"}, {}]
    rows = list(group_members(entries))
    assert [(r, k, sorted(m)) for r, k, m in rows] == [
        (0, "a/001", ["jpg", "txt"]), (1, "a/001", ["jpg"]), (2, "a/002", ["txt"])]
    from open_clip_train.data import group_by_keys_nothrow

    with pytest.raises(KeyError, match="fname"):
        list(group_by_keys_nothrow(iter([dict(e, __url__="u") if e else e for e in entries])))

    # A shard whose last member group has no extension (the marker as a tar entry), plus
    # webdataset metadata members: the samples are read as if those were not there.
    path = tmp_path / "00000.tar"
    with tarfile.open(path, "w") as tar:
        add_member(tar, "__index__", b"meta")
        for r in range(3):
            row = sample_row(0, r)
            for ext in ("jpg", "txt", "json"):
                add_member(tar, f"{row['__key__']}.{ext}", row[ext])
        add_member(tar, "000000099", b"")
        add_member(tar, "__end__", b"")
    keys = [key for _, key, _ in read_shard(str(path))]
    assert keys == ["000000000", "000000001", "000000002"]
    (tmp_path / "sizes.json").write_text(json.dumps({"00000.tar": 3}))
    loader = build_train_loader(config(str(path), batch_size=3), PREPROCESS,
                                CountingTokenizer(), seed=0, rank=0, world_size=1)
    assert sorted(flat(run_epoch(loader))) == [0, 1, 2] and loader.bad_samples == {}


def test_reads_the_member_stream_of_the_installed_webdataset(uneven_shards):
    import webdataset as wds
    from webdataset.tariterators import tar_file_expander, url_opener

    pattern, _ = uneven_shards
    urls = [pattern.replace("{00000..00005}", f"{i:05d}") for i in (0, 1)]
    stream = tar_file_expander(url_opener([{"url": u} for u in urls]))
    keys = [key for _, key, _ in group_members(stream)]
    assert keys == [f"{r:09d}" for r in range(23)] + [f"{10000 + r:09d}" for r in range(17)], \
        wds.__version__


def test_shards_written_by_img2dataset_writer(tmp_path):
    pa = pytest.importorskip("pyarrow")
    writer_module = pytest.importorskip("img2dataset.writer")
    logger_module = pytest.importorskip("img2dataset.logger")
    schema = pa.schema([pa.field("key", pa.string()), pa.field("caption", pa.string()),
                        pa.field("status", pa.string())])
    sizes = []
    for shard in range(2):
        writer = writer_module.WebDatasetSampleWriter(shard, str(tmp_path), True, 5, schema,
                                                      "jpg")
        for row in range(6):
            key = f"{shard * KEY_STRIDE + row:09d}"
            meta = {"key": key, "caption": caption_of(int(key)), "status": "success"}
            writer.write(jpeg_bytes(color_of(int(key))), key, caption_of(int(key)), meta)
        writer.close()
        sizes.append(6)
        logger_module.write_stats(str(tmp_path), shard, 6, 6, 0, 0, 0.0, 1.0,
                                  logger_module.CappedCounter(), 5)
    assert not (tmp_path / "sizes.json").exists()  # sizes come from img2dataset's *_stats.json
    loader = build_train_loader(config(str(tmp_path / "{00000..00001}.tar"), batch_size=3),
                                PREPROCESS, CountingTokenizer(), seed=0, rank=0, world_size=1)
    assert loader.num_samples == 12
    batches = list(loader)
    assert sorted(flat([b.sample_ids.tolist() for b in batches])) == \
        [r for r in range(6)] + [KEY_STRIDE + r for r in range(6)]
    assert all((b.texts[:, 0] == b.sample_ids).all() for b in batches)


def test_default_synthetic_shards_with_open_clip_tokenizer_and_transform(tmp_path):
    synthetic = pytest.importorskip("vlcontrast.data.prep.synthetic")
    import open_clip

    synthetic.write_synthetic(tmp_path, train=40, val=8, zeroshot_per_class=1, seed=0,
                              image_size=32, shard_size=10, workers=1, progress=False)
    preprocess = open_clip.image_transform(24, is_train=True)
    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    cfg = config(str(tmp_path / "train" / "{00000..00003}.tar"), workers=2, batch_size=8)
    loader = build_train_loader(cfg, preprocess, tokenizer, seed=0, rank=0, world_size=1)
    assert loader.num_samples == 40 and loader.id_space > 0
    batches = list(loader)
    assert len(batches) == 5
    assert batches[0].images.shape == (8, 3, 24, 24) and batches[0].texts.shape == (8, 77)
    ids = flat([b.sample_ids.tolist() for b in batches])
    assert len(set(ids)) == 40 and max(ids) < loader.id_space
    # the caption tokens belong to the sample: re-read one caption from its shard
    captions = {}
    for url in sorted((tmp_path / "train").glob("*.tar")):
        for _, key, members in read_shard(str(url)):
            captions[int(key)] = members["txt"].decode()
    first = batches[0]
    expected = tokenizer([captions[i] for i in first.sample_ids.tolist()])
    assert torch.equal(first.texts, expected)


def test_cached_tokenizer_gives_the_same_ids_and_tokenizes_each_caption_once():
    import open_clip

    from vlcontrast.data.stream import CachedTokenizer

    calls = []

    def tokenizer(texts):
        calls.append(list(texts))
        return open_clip.tokenize(texts, context_length=12)

    cached = CachedTokenizer(tokenizer, max_entries=3)
    first = ["a red star", "a blue ring", "a red star", "a small heart"]
    assert torch.equal(cached(first), open_clip.tokenize(first, context_length=12))
    assert calls == [["a red star", "a blue ring", "a small heart"]] and len(cached) == 3
    # Seen captions come from memory; a new one is tokenized but not kept once the cache is full.
    second = ["a small heart", "a green cross", "a red star"]
    assert torch.equal(cached(second), open_clip.tokenize(second, context_length=12))
    assert calls[1:] == [["a green cross"]] and len(cached) == 3
    cached(["a green cross"])
    assert calls[2:] == [["a green cross"]]


def test_second_epoch_tokenizes_nothing_again(uneven_shards):
    calls = []

    class Counting(CountingTokenizer):
        def __call__(self, texts):
            calls.append(len(texts))
            return super().__call__(texts)

    loader = build_train_loader(config(uneven_shards[0]), PREPROCESS, Counting(), seed=0, rank=0,
                                world_size=1)
    def pairs():
        return [(i, t[0]) for b in loader for i, t in zip(b.sample_ids.tolist(), b.texts.tolist())]

    first = pairs()
    tokenized = sum(calls)
    loader.set_epoch(1)
    second = pairs()
    assert tokenized == len(first) > 0
    assert sum(calls) == tokenized  # the same captions again: all from the cache
    assert second != first and all(i == t for i, t in first + second)  # ids still match captions


# ---------------------------------------------------------------------------------------------
# resume


@pytest.mark.parametrize("mode,workers", [("epoch", 2), ("epoch", 0), ("resampled", 2)])
def test_resume_mid_epoch_neither_repeats_nor_skips(uneven_shards, mode, workers):
    pattern, _ = uneven_shards
    cfg = config(pattern, mode=mode, workers=workers, batch_size=4, shuffle_buffer=16)

    def build(resume_state=None):
        return build_train_loader(cfg, PREPROCESS, CountingTokenizer(), seed=5, rank=0,
                                  world_size=1, epoch=1, resume_state=resume_state)

    full = build()
    uninterrupted = run_epoch(full)
    full.set_epoch(2)
    uninterrupted_next = run_epoch(full)

    first = build()
    consumed = []
    for batch in first:
        consumed.append(batch.sample_ids.tolist())
        if len(consumed) == 7:
            break
    state = json.loads(json.dumps(first.state_dict()))  # must survive JSON
    assert state["epoch"] == 1 and state["steps_done"] == 7
    resumed = build(resume_state=state)
    rest = run_epoch(resumed)
    assert len(consumed) + len(rest) == first.steps_per_epoch
    # the same batches (workers are polled from worker 0 again, so order may differ)
    assert sorted(map(sorted, consumed + rest)) == sorted(map(sorted, uninterrupted))
    assert resumed.seen_samples == full.steps_per_epoch * 4
    resumed.set_epoch(2)
    assert run_epoch(resumed) == uninterrupted_next


def test_resume_at_epoch_end_continues_with_next_epoch(uneven_shards):
    pattern, _ = uneven_shards
    cfg = config(pattern, workers=1)
    loader = build_train_loader(cfg, PREPROCESS, CountingTokenizer(), seed=0, rank=0,
                                world_size=1)
    run_epoch(loader)
    resumed = build_train_loader(cfg, PREPROCESS, CountingTokenizer(), seed=0, rank=0,
                                 world_size=1, resume_state=loader.state_dict())
    assert resumed.epoch == 1
    loader.set_epoch(1)
    assert run_epoch(resumed) == run_epoch(loader)


def test_resume_after_bad_samples_is_exact_for_own_rank(tmp_path):
    defects = {(s, r): "undecodable" for s in range(4) for r in (1, 4)}
    make_shards(tmp_path, [12, 12, 12, 12], defects=defects)
    cfg = config(str(tmp_path / "{00000..00003}.tar"), workers=2, batch_size=4, num_samples=40)

    def build(resume_state=None):
        return build_train_loader(cfg, PREPROCESS, CountingTokenizer(), seed=0, rank=0,
                                  world_size=1, resume_state=resume_state)

    uninterrupted = run_epoch(build())
    first = build()
    consumed = []
    for batch in first:
        consumed.append(batch.sample_ids.tolist())
        if len(consumed) == 4:
            break
    resumed = build(first.state_dict())
    rest = run_epoch(resumed)
    assert sorted(flat(consumed + rest)) == sorted(flat(uninterrupted))
    assert resumed.bad_samples["undecodable_image"] >= first.bad_samples["undecodable_image"]


def test_changed_topology_skips_to_next_epoch(uneven_shards):
    pattern, _ = uneven_shards
    first = build_train_loader(config(pattern, workers=2), PREPROCESS, CountingTokenizer(),
                               seed=0, rank=0, world_size=1)
    for i, _ in enumerate(first):
        if i == 2:
            break
    resumed = build_train_loader(config(pattern, workers=1), PREPROCESS, CountingTokenizer(),
                                 seed=0, rank=0, world_size=1, resume_state=first.state_dict())
    assert resumed.epoch == 1 and resumed.seen_samples == 12


def test_counted_samples_survive_in_gathered_state(uneven_shards):
    pattern, _ = uneven_shards
    loader = build_train_loader(config(pattern), PREPROCESS, CountingTokenizer(), seed=0, rank=0,
                                world_size=1)
    next(iter(loader))
    gathered = loader.gather_state_dict()
    assert [s["rank"] for s in gathered["ranks"]] == [0]
    resumed = build_train_loader(config(pattern), PREPROCESS, CountingTokenizer(), seed=0,
                                 rank=0, world_size=1, resume_state=gathered)
    assert resumed.seen_samples == 4 and len(run_epoch(resumed)) == loader.steps_per_epoch - 1


def test_pipe_urls_are_read(uneven_shards):
    pattern, _ = uneven_shards
    directory = os.path.dirname(pattern)
    spec = f"pipe:cat {directory}/{{00000..00005}}.tar"
    loader = build_train_loader(config(spec, num_samples=128, workers=2), PREPROCESS,
                                CountingTokenizer(), seed=0, rank=0, world_size=1)
    ids = flat(run_epoch(loader))
    # Sizes of pipe: shards are unknown, assumed 22, 22, 21, 21, 21, 21: shorter shards (15 rows
    # short in all) are made up for from the rows of longer ones beyond their assumed size.
    assert len(ids) == 128 and len(set(ids)) >= 128 - 15
    assert loader.bad_samples == {}
    counts = collections.Counter(i // KEY_STRIDE for i in ids)
    assert set(counts) == set(range(6))


# ---------------------------------------------------------------------------------------------
# DataLoader options: pinned memory for CUDA, persistent workers


def test_dataloader_options_for_a_cuda_device_pin_and_persist():
    options = loader_module.dataloader_options(4, torch.device("cuda", 3))
    assert options["pin_memory"] is True and options["persistent_workers"] is True
    assert options["num_workers"] == 4 and options["prefetch_factor"] == 2
    cpu = loader_module.dataloader_options(4, "cpu")
    assert cpu["pin_memory"] is False and cpu["persistent_workers"] is True
    inline = loader_module.dataloader_options(0, "cuda")
    assert inline["pin_memory"] is True and inline["persistent_workers"] is False
    assert "prefetch_factor" not in inline  # DataLoader refuses it without workers


def test_build_passes_the_device_to_the_dataloader(uneven_shards):
    pattern, _ = uneven_shards
    loader = build_train_loader(config(pattern, workers=2), PREPROCESS, CountingTokenizer(),
                                seed=0, rank=0, world_size=1, device="cuda:1")
    assert loader.loader_options["pin_memory"] and loader.loader_options["persistent_workers"]


class EpochProbe:
    """A transform with an ``epoch`` attribute: the image becomes (epoch, worker pid)."""

    def __init__(self):
        self.epoch = -1

    def __call__(self, image):
        return torch.tensor([self.epoch, os.getpid()])


def test_persistent_workers_follow_the_epoch_and_its_transform(uneven_shards):
    pattern, good = uneven_shards
    loader = build_train_loader(config(pattern, workers=2), EpochProbe(), CountingTokenizer(),
                                seed=0, rank=0, world_size=1)
    pids, epochs = [], []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        batches = list(loader)
        assert sorted(i for b in batches for i in b.sample_ids.tolist()) == sorted(good)
        epochs.append({int(e) for b in batches for e in b.images[:, 0]})
        pids.append({int(p) for b in batches for p in b.images[:, 1]})
    assert epochs == [{0}, {1}]  # the workers' own copy of the transform saw each epoch
    assert pids[0] == pids[1] and len(pids[0]) == 2 and os.getpid() not in pids[0]


class RandomShift:
    """A random augmentation that shows on flat-colour images (a crop would not)."""

    def __call__(self, image):
        return T.functional.to_tensor(image) + torch.rand(())


def test_epoch_seeded_augmentation_is_the_same_with_persistent_workers(uneven_shards):
    from vlcontrast.train.batches import SeededTransform

    pattern, _ = uneven_shards
    shift = RandomShift()

    def second_epoch(workers):
        augment = SeededTransform(shift, seed=7)
        loader = build_train_loader(config(pattern, workers=workers), augment,
                                    CountingTokenizer(), seed=0, rank=0, world_size=1)
        images = {}
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            augment.epoch = epoch  # what the trainer does in the main process
            for batch in loader:
                images.update(zip(batch.sample_ids.tolist(), batch.images))
        return images

    inline, persistent = second_epoch(0), second_epoch(2)
    assert inline.keys() == persistent.keys()
    assert all(torch.equal(inline[i], persistent[i]) for i in inline)


def test_a_relative_pattern_that_matches_nothing_names_the_directory_it_was_read_from(
        tmp_path, monkeypatch):
    """A config's relative data.train, run from another folder, read as a typo; the error now
    says which directory the path was read from (an absolute one needs no such note)."""
    from vlcontrast.data.spec import expand_member

    monkeypatch.chdir(tmp_path)
    with pytest.raises(LoaderError) as err:
        expand_member("data/openclipart/train/{00000..00001}.tar")
    assert (f"(e.g. 'data/openclipart/train/00000.tar'), relative to the current directory "
            f"{str(tmp_path)!r}; give a folder") in str(err.value)
    with pytest.raises(LoaderError) as err:
        expand_member(str(tmp_path / "x" / "{0..1}.tar"))
    assert "relative to" not in str(err.value)
