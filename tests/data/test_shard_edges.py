"""Shard folders at the edges: empty tars, unfinished prep output, shards the sizes list but that
are gone, and captions under another member than ``data.caption_key``."""

from __future__ import annotations

import json
import logging
import tarfile
from pathlib import Path

import pytest

from tests.data.helpers import make_shards, sample_row, write_shard
from vlcontrast import cli
from vlcontrast.config import DataConfig
from vlcontrast.data.check import check_shards
from vlcontrast.data.counting import count_shard
from vlcontrast.data.samples import Members, bad_rate_error
from vlcontrast.data.shards import unfinished_prep
from vlcontrast.data.sources import resolve_shard_set
from vlcontrast.data.tar_reader import read_shard


def _empty_tars(directory: Path) -> list[Path]:
    """Both forms of an empty archive: img2dataset's 10,240 zero bytes (a shard whose every
    download failed) and ``tarfile.open(mode="w")`` with nothing added; and a gzipped one."""
    zeros = directory / "00002.tar"
    zeros.write_bytes(b"\0" * 10240)
    with tarfile.open(directory / "00003.tar", "w"):
        pass
    gz = directory / "empty.tar.gz"
    with tarfile.open(gz, "w:gz"):
        pass
    return [zeros, directory / "00003.tar", gz]


def _check(spec, *args) -> int:
    return cli.main(["prep", "check", str(spec), "--no-progress", "--workers", "1", *args])


def test_an_empty_tar_is_a_whole_shard_of_no_samples(tmp_path):
    make_shards(tmp_path, [5, 4], metadata=False)
    for path in _empty_tars(tmp_path):
        events: dict[str, int] = {}
        errors: list[str] = []
        assert list(read_shard(str(path), counts=events, errors=errors)) == []
        assert events == {} and errors == []
        assert list(read_shard(f"pipe:cat {path}", counts=events, errors=errors)) == []
        assert events == {} and errors == []
        found = count_shard(str(path))
        assert found.rows == 0 and found.complete and found.error is None

    (tmp_path / "empty.tar.gz").unlink()
    report = check_shards(tmp_path, progress=False)
    assert report["ok"] and report["trainable"], report["summary"]
    assert report["num_shards"] == 4 and report["num_samples"] == 9
    assert report["unreadable_shards"] == [] and report["truncated_shards"] == []
    assert report["shards"]["00002.tar"] == {"samples": 0, "error": None, "truncated": False,
                                             "missing_samples": 0, "bad_samples": {}}
    assert _check(tmp_path, "--report", str(tmp_path.parent / "r.json")) == 0
    # training: the empty shards count as 0 rows, without a warning of a cut file
    assert resolve_shard_set(DataConfig(train=str(tmp_path))).sizes == [5, 4, 0, 0]
    # prep wds reads them as whole shards too (it counted each as a truncated_tar)
    from vlcontrast.data.prep.wds import prepare_wds

    report = prepare_wds(str(tmp_path), tmp_path.parent / "rekeyed", progress=False, workers=1)
    assert report["num_samples"] == 9 and "truncated_tar" not in json.dumps(report)


def _state(directory: Path, shards: dict[str, int]) -> None:
    """``_prep_state.json`` as the prep writer records finished shards."""
    (directory / "_prep_state.json").write_text(json.dumps({"fingerprint": "c740", "shards": {
        name: {"shard": name, "written": n, "skipped": {}, "examples": {}}
        for name, n in shards.items()}}))


def test_the_state_file_is_the_prep_writers():
    from vlcontrast.data.prep.writer import STATE_FILE
    from vlcontrast.data.shards import PREP_STATE_FILE

    assert PREP_STATE_FILE == STATE_FILE


def test_an_unfinished_prep_fails_the_check_and_names_the_fix(tmp_path, capsys):
    partial = tmp_path / "partial"
    make_shards(partial, [6], metadata=False)
    (partial / "00001.tar.tmp").write_bytes(b"half a shard")
    _state(partial, {"00000.tar": 6})
    report = check_shards(partial, progress=False)
    assert not report["ok"] and not report["trainable"]
    assert report["summary"].startswith(
        f"check: UNFINISHED PREP: {str(partial)!r} is an unfinished `vlcontrast prep` output "
        "(1 shard finished so far")
    assert "run the same prep command again to finish it" in report["summary"]
    assert "\n" not in report["summary"]
    assert _check(partial) == 1

    # A finished prep (its manifest written) and shards no prep wrote are unaffected.
    finished = tmp_path / "finished"
    make_shards(finished, [6])
    _state(finished, {"00000.tar": 6})
    own = tmp_path / "own"
    make_shards(own, [6], metadata=False)
    for folder in (finished, own):
        assert unfinished_prep(folder) is None
        assert (folder / "_prep_state.json").exists() == (folder == finished)
        assert check_shards(folder, progress=False)["ok"]
        assert _check(folder) == 0


def _img2dataset_folder(directory: Path, sizes: list[int]) -> None:
    make_shards(directory, sizes, metadata=False)
    for shard, n in enumerate(sizes):
        (directory / f"{shard:05d}_stats.json").write_text(json.dumps(
            {"count": n + 1, "successes": n, "failed_to_download": 1}))


@pytest.mark.parametrize("listing", ["stats", "manifest", "sizes"])
def test_a_shard_the_sizes_list_but_that_is_gone_is_reported(tmp_path, caplog, listing):
    folder = tmp_path / "i2d"
    if listing == "stats":
        _img2dataset_folder(folder, [9, 9, 8])
        listed_in = "00001_stats.json"
    else:
        make_shards(folder, [9, 9, 8])
        if listing == "manifest":
            (folder / "sizes.json").unlink()
        listed_in = f"{listing}.json"
    (folder / "00001.tar").unlink()

    report = check_shards(folder, progress=False)
    assert not report["ok"], report["summary"]
    assert report["unreadable_shards"] == [] and report["trainable"]
    assert report["missing_shards"] == [{"shard": "00001.tar", "path": str(folder / "00001.tar"),
                                         "listed_in": listed_in, "samples": 9}]
    assert report["num_shards"] == 2 and report["num_samples"] == 17
    assert f"MISSING shards: {listed_in} in {str(folder)!r} lists 1 shard that is not there " \
           "(00001.tar: 9 samples)" in report["summary"]
    # Training reads the shards that are there (with a warning naming the missing one), so the
    # check does not call the folder untrainable either.
    assert report["trainable"] and _check(folder) == 0
    with caplog.at_level(logging.WARNING):
        shard_set = resolve_shard_set(DataConfig(train=str(folder)))
    assert shard_set.num_samples == 17
    assert "00001.tar: 9 samples" in caplog.text and "training uses the shards" in caplog.text
    # A pattern naming only the shards there are is not short of anything.
    assert check_shards(str(folder / "{00000,00002}.tar"), progress=False)["missing_shards"] == []


def _json_caption_shards(directory: Path, shards: int = 3, rows: int = 12) -> None:
    """Shards whose captions are only in the .json (no .txt)."""
    directory.mkdir(parents=True, exist_ok=True)
    for shard in range(shards):
        samples = []
        for row in range(rows):
            sample = sample_row(shard, row)
            del sample["txt"]
            samples.append(sample)
        write_shard(directory / f"{shard:05d}.tar", samples)


def test_captions_in_the_json_are_named_by_the_check_and_the_sniff(tmp_path):
    _json_caption_shards(tmp_path / "s")
    report = check_shards(tmp_path / "s", progress=False, decode_images=False)
    assert report["bad_samples"]["missing_caption"] == 36 and not report["trainable"]
    assert ("most samples have no member matching --caption-key (sample '000000000' has .jpg, "
            ".json; its .json has 'caption'): set --caption-key=json:caption "
            "(data.caption_key=json:caption in training)") in report["summary"]
    assert check_shards(tmp_path / "s", progress=False, decode_images=False,
                        caption_key="json:caption")["ok"]

    from vlcontrast.data.check import sniff_member_keys

    urls = [str(p) for p in sorted((tmp_path / "s").glob("*.tar"))]
    error = sniff_member_keys(urls, Members())
    assert error == (f"data.train: none of the first 8 samples of {urls[0]!r} has a member "
                     "matching data.caption_key='txt' (sample '000000000' has .jpg, .json; its "
                     ".json has 'caption'): set data.caption_key=json:caption")
    assert sniff_member_keys(urls, Members.parse("", "json:caption")) is None
    assert "data.image_key='png'" in sniff_member_keys(urls, Members.parse("png", "json:caption"))
    assert sniff_member_keys([f"pipe:cat {urls[0]}"], Members()) is None  # streams: not read


def test_the_bad_rate_error_names_the_caption_key_and_counts_reads_truthfully():
    error = str(bad_rate_error({"missing_caption": 64}, 64, 0.05, "data (rank 0, worker 0)"))
    assert "64 of 64 samples were bad" in error and "counted per read" in error
    assert "data.caption_key=json:caption" in error and "\n" not in error
    assert "data.image_key" in str(bad_rate_error({"missing_image": 40}, 64, 0.05, "data"))
    few = str(bad_rate_error({"undecodable_image": 3}, 50, 0.05, "data"))
    assert "counted per read" not in few and "look damaged" in few
