"""Shard check: broken images, missing/empty captions, duplicate keys, truncated and missing shards."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import webdataset as wds

from vlcontrast.data.check import check_shards
from vlcontrast.data.synthetic import write_synthetic

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def shards(tmp_path) -> Path:
    write_synthetic(tmp_path, train=90, val=0, zeroshot_per_class=0, shard_size=30, workers=1,
                    progress=False)
    return tmp_path / "train"


def _read(path: Path) -> list[dict]:
    samples: dict[str, dict] = {}
    with tarfile.open(path) as tar:
        for member in tar:
            key, ext = member.name.split(".", 1)
            samples.setdefault(key, {"__key__": key})[ext] = tar.extractfile(member).read()
    return list(samples.values())


def _write(path: Path, samples: list[dict]) -> None:
    with open(path, "wb") as stream:
        writer = wds.TarWriter(stream)
        for sample in samples:
            writer.write(sample)
        writer.close()


def test_clean_shards_pass(shards):
    report = check_shards(shards, progress=False)
    assert report["ok"] and report["num_samples"] == 90 and report["num_shards"] == 3
    assert report["unreadable_shards"] == [] and report["size_mismatches"] == []
    assert report["max_id"] == 20_029 and report["id_space"] == 30_000
    assert json.loads((shards / "check_report.json").read_text())["num_samples"] == 90


def test_problems_are_counted_and_unreadable_shard_fails(shards, tmp_path):
    first = _read(shards / "00000.tar")
    first[3]["jpg"] = b"\xff\xd8\xff\xe0 these are not jpeg bytes" * 4
    first[5]["txt"] = b"   "
    del first[7]["txt"]
    _write(shards / "00000.tar", first)

    second = _read(shards / "00001.tar")
    second.append(dict(first[0]))  # a key that already lives in shard 00000
    _write(shards / "00001.tar", second)

    data = (shards / "00002.tar").read_bytes()
    (shards / "00002.tar").write_bytes(data[: len(data) // 2 + 100])

    report_path = tmp_path / "report" / "check.json"
    report = check_shards(shards, report_path=report_path, progress=False)

    assert report["undecodable_images"] == 1
    assert report["examples"]["undecodable_images"] == [first[3]["__key__"]]
    assert report["empty_captions"] == 1 and report["missing_captions"] == 1
    assert report["examples"]["missing_captions"] == [first[7]["__key__"]]
    assert report["duplicate_keys"] == 1
    assert report["examples"]["duplicate_keys"] == [str(int(first[0]["__key__"]))]
    assert [u["shard"] for u in report["unreadable_shards"]] == ["00002.tar"]
    assert 0 < report["unreadable_shards"][0]["samples_read"] < 30
    assert {m["shard"] for m in report["size_mismatches"]} == {"00001.tar", "00002.tar"}
    assert report["shards"]["00000.tar"]["undecodable_images"] == 1
    assert not report["ok"] and "FAILED" in report["summary"]
    assert json.loads(report_path.read_text())["unreadable_shards"] == report["unreadable_shards"]

    # The script exits non-zero with a summary line.
    result = subprocess.run([sys.executable, str(ROOT / "data_prep" / "check_shards.py"), str(shards),
                             "--no-progress"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "UNREADABLE" in result.stderr and "00002.tar" in result.stderr


def test_truncation_at_a_block_boundary_is_caught(shards):
    path = shards / "00001.tar"
    with tarfile.open(path) as tar:
        cut = tar.getmembers()[6].offset  # the header of the third sample's first member
    # A file that stops exactly where a header should start: tarfile itself ends quietly there.
    path.write_bytes(path.read_bytes()[:cut])
    report = check_shards(shards, progress=False, workers=2)
    assert [u["shard"] for u in report["unreadable_shards"]] == ["00001.tar"]
    # Two whole samples precede the cut; the last one before a cut is never trusted.
    assert report["unreadable_shards"][0]["samples_read"] == 1
    assert report["shards"]["00000.tar"]["error"] is None


def test_missing_shard_listed_in_sizes_json(shards):
    (shards / "00001.tar").unlink()
    report = check_shards(str(shards), progress=False)
    assert [u["shard"] for u in report["unreadable_shards"]] == ["00001.tar"]
    assert "missing" in report["unreadable_shards"][0]["error"]


def test_pattern_input_and_no_shards(shards, tmp_path):
    report = check_shards(str(shards / "{00000..00001}.tar"), progress=False)
    assert report["num_shards"] == 2 and report["num_samples"] == 60 and report["ok"]
    assert "report_path" not in report  # no directory given: nothing written unless asked
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no shards"):
        check_shards(empty, progress=False)
