"""Findings of a fuzzing pass over the data entry points: compressed shards a directory leaves
out are named, ``prep wds`` counts the shard files it writes, and a zero-length shard's example
is one line."""

from __future__ import annotations

import gzip
import json
import logging
import shutil

import pytest

from tests.data.helpers import make_shards
from tests.data.test_prep_edges import wds_input
from vlcontrast.data import check_spec
from vlcontrast.data import spec as spec_module
from vlcontrast.data.prep.wds import prepare_wds
from vlcontrast.data.tar_reader import read_shard
from vlcontrast.errors import ShardsNotFoundError


def gzip_copy(source, target):
    with open(source, "rb") as raw, gzip.open(target, "wb") as packed:
        shutil.copyfileobj(raw, packed)


@pytest.fixture
def mixed(tmp_path):
    """``d/``: 00000.tar, 00001.tar and the compressed 00002.tar.gz, 00003.tar.gz."""
    folder = tmp_path / "d"
    make_shards(folder, [2, 2, 2, 2])
    for name in ("00002", "00003"):
        gzip_copy(folder / f"{name}.tar", folder / f"{name}.tar.gz")
        (folder / f"{name}.tar").unlink()
    for name in ("sizes.json", "manifest.json"):
        (folder / name).unlink(missing_ok=True)
    return folder


def test_a_directory_warns_once_about_the_compressed_shards_it_leaves_out(mixed, caplog):
    spec_module._WARNED_DIRECTORIES.discard(str(mixed.resolve()))
    with caplog.at_level(logging.WARNING, logger="vlcontrast.data.spec"):
        urls = check_spec("data.train", str(mixed))
        check_spec("data.train", str(mixed))  # resolved again: no second warning
    assert urls == [str(mixed / "00000.tar"), str(mixed / "00001.tar")]  # the rule stays *.tar
    warnings = [r.getMessage() for r in caplog.records if "compressed" in r.getMessage()]
    assert len(warnings) == 1, warnings
    line = warnings[0]
    assert "\n" not in line
    assert "2 compressed shards (00002.tar.gz, 00003.tar.gz)" in line
    assert repr(f"{mixed},{mixed}/{{00002,00003}}.tar.gz") in line  # how to include them
    # the spec the warning gives reads every shard, and warns no more
    caplog.clear()
    spec_module._WARNED_DIRECTORIES.clear()
    with caplog.at_level(logging.WARNING, logger="vlcontrast.data.spec"):
        urls = check_spec("data.train", f"{mixed},{mixed}/{{00002,00003}}.tar.gz")
    assert len(urls) == 4 and not [r for r in caplog.records if "compressed" in r.getMessage()]


def test_a_directory_of_compressed_shards_only_names_them_in_the_error(mixed):
    for name in ("00000.tar", "00001.tar"):
        (mixed / name).unlink()
    with pytest.raises(ShardsNotFoundError) as caught:
        check_spec("data.train", str(mixed))
    message = str(caught.value)
    assert "holds no .tar shards" in message
    assert "2 compressed shards (00002.tar.gz, 00003.tar.gz)" in message
    assert repr(f"{mixed}/{{00002,00003}}.tar.gz") in message


def test_prep_wds_counts_only_shard_files_as_written(tmp_path):
    source = wds_input(tmp_path / "src", 6)
    (source / "c.tar").write_bytes(b"")  # an empty input shard: no output shard
    out = tmp_path / "out"
    report = prepare_wds(str(source / "*.tar"), out, workers=1, progress=False)
    files = sorted(p.name for p in out.glob("*.tar"))
    assert report["num_shards"] == len(files) == 2
    assert report["shards_written"] == 2 and report["shards_done_before"] == 0
    again = prepare_wds(str(source / "*.tar"), out, workers=1, progress=False)
    assert again["shards_written"] == 0 and again["shards_done_before"] == 2
    assert json.loads((out / "prep_report.json").read_text())["shards_done_before"] == 2


def test_a_zero_length_shard_is_explained_in_one_line(tmp_path):
    empty = tmp_path / "00000.tar"
    empty.write_bytes(b"")
    counts, errors = {}, []
    assert list(read_shard(str(empty), counts=counts, errors=errors, exact=False)) == []
    assert counts == {"truncated_tar": 1}
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert "empty file (0 bytes)" in errors[0]
    cut = tmp_path / "00001.tar"
    cut.write_bytes(b"x" * 700)  # no tar header: tarfile lists every method it tried
    errors = []
    list(read_shard(str(cut), errors=errors, exact=False))
    assert errors and "\n" not in errors[0], errors
