"""Bring your own data: webdataset shards as they come (non-numeric keys, no sizes file, other
shard names, other members), the id check before training, several captions, and prep check."""

from __future__ import annotations

import json
import tarfile

import pytest
import torch
import torchvision.transforms as T

from tests.data.helpers import IMAGE_SIZE, add_member, jpeg_bytes, make_shards, write_shard
from vlcontrast import cli
from vlcontrast.config import DataConfig
from vlcontrast.data import check_ids_available
from vlcontrast.data.check import check_shards
from vlcontrast.data.counting import count_shard
from vlcontrast.data.loader import LoaderError, build_train_loader
from vlcontrast.errors import ConfigError, ShardSpecError

PREPROCESS = T.Compose([T.Resize(IMAGE_SIZE), T.CenterCrop(IMAGE_SIZE), T.ToTensor()])


class WordTokenizer:
    """Token 0 = a number after '#' in the caption (-1 if none)."""

    def __call__(self, texts):
        return torch.tensor([[int(t.split("#")[1].split()[0]) if "#" in t else -1, len(t)]
                             for t in texts])


def config(train: str, **overrides) -> DataConfig:
    values = dict(train=train, batch_size=2, workers=0, shuffle_buffer=0, max_bad_fraction=0.5)
    values.update(overrides)
    return DataConfig(**values)


def hex_shards(directory, shards: int = 2, rows: int = 5, *, member="txt") -> list[str]:
    """Shards named data-000.tar ... with hex keys and no metadata; captions '#<n>'."""
    directory.mkdir(parents=True, exist_ok=True)
    keys = []
    for s in range(shards):
        samples = []
        for r in range(rows):
            n = s * rows + r
            key = f"img_{n * 2654435761 % 16**6:06x}"
            keys.append(key)
            row = {"__key__": key, "jpg": jpeg_bytes((n * 20 % 255, 40, 90))}
            if member == "txt":
                row["txt"] = f"caption #{n}".encode()
            else:
                row["json"] = json.dumps({"caption": f"caption #{n}", "uid": key}).encode()
            samples.append(row)
        write_shard(directory / f"data-{s:03d}.tar", samples)
    return keys


def epoch_tokens(loader) -> list[int]:
    return sorted(t for batch in loader for t in batch.texts[:, 0].tolist())


# ---------------------------------------------------------------------------------------------
# layouts that train without prep


def test_non_numeric_keys_train_without_ids_and_stop_a_loss_that_needs_them(tmp_path):
    hex_shards(tmp_path / "d")
    spec = str(tmp_path / "d" / "*.tar")
    loader = build_train_loader(config(spec), PREPROCESS, WordTokenizer(), seed=0, rank=0,
                                world_size=1)
    assert loader.num_samples == 10 and loader.id_space == 0  # counted from tar headers
    batches = list(loader)
    assert epoch_tokens(batches) == list(range(10))
    assert all((b.sample_ids == -1).all() for b in batches) and loader.bad_samples == {}
    with pytest.raises(LoaderError, match=r"data-000\.tar.*img_[0-9a-f]{6}.*prep wds"):
        check_ids_available(config(spec), True, who="loss=decl")
    check_ids_available(config(spec), False)  # no ids needed: fine


def test_counting_tar_headers_matches_the_reader_including_a_cut_shard(tmp_path):
    make_shards(tmp_path, [7], metadata=False)
    found = count_shard(str(tmp_path / "00000.tar"))
    assert (found.rows, found.max_id, found.non_numeric, found.complete) == (7, 6, 0, True)
    data = (tmp_path / "00000.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[: len(data) // 2])
    cut = count_shard(str(tmp_path / "cut.tar"))
    from vlcontrast.data.tar_reader import read_shard

    assert not cut.complete and cut.rows == len(list(read_shard(str(tmp_path / "cut.tar"))))


def test_a_foreign_or_empty_file_among_the_shards_is_skipped_with_one_warning(tmp_path, caplog):
    """A .tar-named file that is no tar (random bytes) used to stop training with tarfile's
    traceback, and an empty one was called "a truncated shard"; each is now one warning per
    shard and process (the shard set is resolved twice: before the model and in the loader)."""
    import logging
    import os

    from vlcontrast.data.sources import resolve_shard_set

    make_shards(tmp_path, [7], metadata=False)
    (tmp_path / "00001.tar").write_bytes(os.urandom(3000))
    (tmp_path / "00002.tar").write_bytes(b"")
    foreign = count_shard(str(tmp_path / "00001.tar"))
    assert (foreign.rows, foreign.complete) == (0, False) and "bad tar header" in foreign.error
    assert count_shard(str(tmp_path / "00002.tar")).error is None
    cfg = DataConfig(train=str(tmp_path / "{00000..00002}.tar"), batch_size=2, workers=0)
    with caplog.at_level(logging.WARNING, logger="vlcontrast.data.sources"):
        first = resolve_shard_set(cfg)
        resolve_shard_set(cfg)
    assert first.num_samples == 7
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "00001.tar is not a readable tar shard (" in messages[0] and "prep check" in messages[0]
    assert "00002.tar holds no complete sample (an empty or cut file): it is skipped" in messages[1]


def test_shards_without_a_single_sample_are_one_line_naming_prep_check(tmp_path):
    (tmp_path / "00000.tar").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"^data.train=.*: no complete sample in its 1 shards; "
                                          r"`vlcontrast prep check` says why$"):
        build_train_loader(DataConfig(train=str(tmp_path / "00000.tar"), batch_size=2, workers=0),
                           PREPROCESS, WordTokenizer(), seed=0, rank=0, world_size=1)


def test_open_clip_sizes_json_with_any_names_and_num_samples_above_the_data(tmp_path):
    hex_shards(tmp_path, shards=2, rows=4)
    (tmp_path / "sizes.json").write_text(json.dumps({"data-000.tar": 4, "data-001.tar": 4}))
    spec = str(tmp_path / "data-{000..001}.tar")
    loader = build_train_loader(config(spec), PREPROCESS, WordTokenizer(), seed=0, rank=0,
                                world_size=1)
    assert loader.num_samples == 8 and epoch_tokens(loader) == list(range(8))
    with pytest.raises(LoaderError, match=r"data\.num_samples=9 exceeds the 8 samples.*at most 8"):
        build_train_loader(config(spec, num_samples=9), PREPROCESS, WordTokenizer(), seed=0,
                           rank=0, world_size=1)


def test_keys_from_a_larger_dataset_id_space_is_the_largest_id_seen(tmp_path):
    rows = [{"__key__": f"{1_230_000 + r:09d}", "jpg": jpeg_bytes(), "txt": f"c #{r}".encode()}
            for r in range(6)]
    write_shard(tmp_path / "00000.tar", rows)
    (tmp_path / "sizes.json").write_text(json.dumps({"00000.tar": 6}))  # no manifest
    spec = str(tmp_path / "00000.tar")
    plain = build_train_loader(config(spec), PREPROCESS, WordTokenizer(), seed=0, rank=0,
                               world_size=1)
    ids = sorted(i for b in plain for i in b.sample_ids.tolist())
    assert ids == [1_230_000 + r for r in range(6)] and plain.bad_samples == {}
    needing = build_train_loader(config(spec), PREPROCESS, WordTokenizer(), seed=0, rank=0,
                                 world_size=1, needs_sample_ids=True)
    assert needing.id_space == 1_230_006
    assert sorted(i for b in needing for i in b.sample_ids.tolist()) == ids


def test_caption_and_image_keys_and_several_captions_drawn_per_epoch(tmp_path):
    rows = []
    for r in range(8):
        captions = [f"first #{r}", f"second #{r + 100}"]
        rows.append({"__key__": f"{r:09d}", "png": jpeg_bytes(),  # any bytes PIL decodes
                     "json": json.dumps({"key": f"{r:09d}", "captions": captions}).encode()})
    write_shard(tmp_path / "00000.tar", rows)
    spec = str(tmp_path / "00000.tar")
    with pytest.raises(LoaderError, match="missing_caption"):  # default data.caption_key=txt
        list(build_train_loader(config(spec, max_bad_fraction=0.1), PREPROCESS, WordTokenizer(),
                                seed=0, rank=0, world_size=1))

    def tokens(seed, epoch):
        cfg = config(spec, caption_key="json:captions", image_key="png")
        loader = build_train_loader(cfg, PREPROCESS, WordTokenizer(), seed=seed, rank=0,
                                    world_size=1, epoch=epoch)
        return {i: t for b in loader for i, t in zip(b.sample_ids.tolist(),
                                                     b.texts[:, 0].tolist())}

    first = tokens(0, 0)
    assert first == tokens(0, 0)  # deterministic: exact resume holds
    assert all(t in (i, i + 100) for i, t in first.items())
    draws = [tokens(0, e) for e in range(4)]
    assert any(a != b for a, b in zip(draws, draws[1:]))  # other epochs draw other captions
    assert {t >= 100 for d in draws for t in d.values()} == {True, False}
    with pytest.raises(ConfigError, match="data.caption_key"):
        config(spec, caption_key="txt;;json:").check()


def test_globs_over_images_or_tables_and_image_folders_name_the_converter(tmp_path):
    (tmp_path / "a.png").write_bytes(jpeg_bytes())
    (tmp_path / "b.csv").write_text("filepath,title\na.png,x\n")
    with pytest.raises(ShardSpecError, match="not a tar shard.*prep folder"):
        build_train_loader(config(str(tmp_path / "*.png")), PREPROCESS, WordTokenizer(), seed=0,
                           rank=0, world_size=1)
    with pytest.raises(ShardSpecError, match="not a tar shard.*prep csv"):
        build_train_loader(config(str(tmp_path / "b.csv")), PREPROCESS, WordTokenizer(), seed=0,
                           rank=0, world_size=1)
    with pytest.raises(ShardSpecError, match="holds no .tar shards.*prep folder"):
        build_train_loader(config(str(tmp_path)), PREPROCESS, WordTokenizer(), seed=0, rank=0,
                           world_size=1)


def test_img2dataset_shards_with_manifest_keep_the_id_checks(tmp_path):
    make_shards(tmp_path, [4, 4])
    loader = build_train_loader(config(str(tmp_path)), PREPROCESS, WordTokenizer(), seed=0,
                                rank=0, world_size=1, needs_sample_ids=True)
    assert loader.id_space == 20_000
    assert sorted(i for b in loader for i in b.sample_ids.tolist()) == \
        [0, 1, 2, 3, 10_000, 10_001, 10_002, 10_003]


# ---------------------------------------------------------------------------------------------
# prep check


def test_prep_check_exit_status_follows_trainability_and_prints_json(tmp_path, capsys):
    hex_shards(tmp_path / "hex")
    assert cli.main(["prep", "check", str(tmp_path / "hex"), "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trainable"] and report["ids"]["non_numeric"] == 10
    assert "prep wds" in report["ids"]["note"]
    assert cli.main(["prep", "check", str(tmp_path / "hex"), "--no-progress",
                     "--require-ids"]) == 1
    capsys.readouterr()
    rows = [{"__key__": f"{r:09d}", "jpg": jpeg_bytes(), "txt": b"x"} for r in range(9)]
    rows.append({"__key__": f"{9:09d}", "jpg": b"not an image", "txt": b"x"})
    (tmp_path / "one").mkdir()
    write_shard(tmp_path / "one" / "00000.tar", rows)
    spec = str(tmp_path / "one")
    assert check_shards(spec, progress=False, max_bad_fraction=0.2)["trainable"]
    assert cli.main(["prep", "check", spec, "--no-progress", "--max-bad-fraction", "0.05"]) == 1
    assert "WOULD NOT TRAIN" in capsys.readouterr().err


def test_counting_handles_gnu_long_names(tmp_path):
    long_key = "x" * 120
    with tarfile.open(tmp_path / "long.tar", "w", format=tarfile.GNU_FORMAT) as tar:
        for r in range(3):
            add_member(tar, f"{long_key}{r}.jpg", jpeg_bytes())
            add_member(tar, f"{long_key}{r}.txt", b"c #1")
    found = count_shard(str(tmp_path / "long.tar"))
    assert found.rows == 3 and found.non_numeric == 3 and found.example_key.startswith("xxx")


def test_header_checksums_as_tarfile_accepts_them():
    """Unsigned (every writer today) and signed (some old ones) checksums pass, anything else is
    not a tar header: the counting's test for a foreign file."""
    import io

    from vlcontrast.data.counting import _checksum_ok

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as archive:
        info = tarfile.TarInfo("00000.txt")
        info.size, info.uname = 1, "\xfc"  # a byte above 127 in the header
        archive.addfile(info, io.BytesIO(b"x"))
    header = buffer.getvalue()[:512]
    unsigned, signed = tarfile.calc_chksums(header)
    assert unsigned != signed
    assert _checksum_ok(header, unsigned) and _checksum_ok(header, signed)
    assert not _checksum_ok(header, unsigned + 1)
