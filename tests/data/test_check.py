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
from vlcontrast.data.prep.synthetic import write_synthetic

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
    assert not any(report["bad_samples"].values())
    assert json.loads((shards / "check_report.json").read_text())["num_samples"] == 90


def test_progress_in_a_log_is_plain_lines_without_carriage_returns(shards, tmp_path, capsys):
    """stderr is not a terminal (a SLURM log, a pipe): check and prep write whole lines."""
    from vlcontrast.data.prep.wds import prepare_wds

    check_shards(shards, progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err and "check " in err and "3/3" in err
    prepare_wds(str(shards), tmp_path / "rekeyed", progress=True, workers=1)
    err = capsys.readouterr().err
    assert "\r" not in err and "prep wds" in err and "3/3" in err


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

    bad = report["bad_samples"]
    assert bad["undecodable_image"] == 1
    assert report["examples"]["undecodable_image"] == [first[3]["__key__"]]
    assert bad["empty_caption"] == 1 and bad["missing_caption"] == 1
    assert report["examples"]["missing_caption"] == [first[7]["__key__"]]
    assert bad["duplicate_key"] == 1
    assert report["examples"]["duplicate_key"] == [str(int(first[0]["__key__"]))]
    # A cut shard is truncated, as training calls it (not unreadable); the rows sizes.json
    # promises beyond the cut are the loader's missing_samples, which fail the bad fraction.
    assert report["unreadable_shards"] == []
    [truncated] = report["truncated_shards"]
    assert truncated["shard"] == "00002.tar" and 0 < truncated["samples"] < 30
    assert report["missing_samples"] == 30 - truncated["samples"]
    assert {m["shard"] for m in report["size_mismatches"]} == {"00001.tar", "00002.tar"}
    assert report["shards"]["00000.tar"]["bad_samples"]["undecodable_image"] == 1
    assert not report["ok"] and not report["trainable"] and "WOULD NOT TRAIN" in report["summary"]
    assert json.loads(report_path.read_text())["truncated_shards"] == report["truncated_shards"]

    # The script exits non-zero with a summary line.
    result = subprocess.run([sys.executable, str(ROOT / "data_prep" / "check_shards.py"), str(shards),
                             "--no-progress"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "WOULD NOT TRAIN" in result.stderr and "00002.tar" in result.stderr


def test_truncation_at_a_block_boundary_is_caught(shards):
    path = shards / "00001.tar"
    with tarfile.open(path) as tar:
        cut = tar.getmembers()[6].offset  # the header of the third sample's first member
    # A file that stops exactly where a header should start: tarfile itself ends quietly there.
    path.write_bytes(path.read_bytes()[:cut])
    report = check_shards(shards, progress=False, workers=2)
    assert report["unreadable_shards"] == []
    # Two whole samples precede the cut; the last one before a cut is never trusted.
    assert report["truncated_shards"] == [{"shard": "00001.tar", "samples": 1}]
    assert report["shards"]["00000.tar"]["error"] is None


def _bare(shards: Path) -> Path:
    """The shards alone: no sizes.json, manifest.json or *_stats.json (training counts them)."""
    for name in ["sizes.json", "manifest.json", *(p.name for p in shards.glob("*_stats.json"))]:
        (shards / name).unlink()
    return shards


def test_truncated_shard_counts_its_complete_samples_as_training_does(shards, caplog):
    """A shard cut in the middle is truncated, not unreadable: its complete samples are counted
    (the number the trainer's header count uses), it is named with a warning, and it does not
    fail the check, since training uses it."""
    import logging

    from vlcontrast import cli
    from vlcontrast.config import DataConfig
    from vlcontrast.data.sources import resolve_shard_set

    shards = _bare(shards)
    path = shards / "00001.tar"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with caplog.at_level(logging.WARNING):
        training = resolve_shard_set(DataConfig(train=str(shards)))
    used = training.sizes[1]
    assert 0 < used < 30 and "00001.tar ends before its end-of-archive block" in caplog.text

    report = check_shards(shards, progress=False)
    assert report["unreadable_shards"] == [] and report["missing_samples"] == 0
    assert report["truncated_shards"] == [{"shard": "00001.tar", "samples": used}]
    assert report["shards"]["00001.tar"]["truncated"] and report["num_samples"] == 30 + 30 + used
    assert report["trainable"] and not report["ok"]
    assert "1 truncated shards" in report["summary"] and "00001.tar" in report["summary"]
    assert "UNREADABLE" not in report["summary"]
    assert cli.main(["prep", "check", str(shards), "--no-progress", "--workers", "1",
                     "--report", str(shards.parent / "r.json")]) == 0


def test_garbage_shard_stays_unreadable(shards):
    (shards / "00001.tar").write_bytes(bytes(range(256)) * 400)  # not a tar from byte 0
    report = check_shards(_bare(shards), progress=False)
    assert [u["shard"] for u in report["unreadable_shards"]] == ["00001.tar"]
    assert report["truncated_shards"] == [] and not report["trainable"]
    assert "UNREADABLE" in report["summary"] and "FAILED" in report["summary"]


def test_missing_shard_listed_in_sizes_json(shards):
    (shards / "00001.tar").unlink()
    report = check_shards(str(shards), progress=False)
    # Training reads the shards that are there (with a warning), so a missing one fails ``ok``,
    # not ``trainable`` (tests/data/test_shard_edges.py covers manifest.json and *_stats.json).
    assert [m["shard"] for m in report["missing_shards"]] == ["00001.tar"]
    assert report["unreadable_shards"] == [] and not report["ok"] and report["trainable"]
    assert "MISSING shards: sizes.json" in report["summary"]


def test_pattern_input_and_no_shards(shards, tmp_path):
    report = check_shards(str(shards / "{00000..00001}.tar"), progress=False)
    assert report["num_shards"] == 2 and report["num_samples"] == 60 and report["ok"]
    assert "report_path" not in report  # no directory given: nothing written unless asked
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no .tar shards"):
        check_shards(empty, progress=False)


def test_truncated_jpeg_empty_and_non_utf8_captions_report_3_of_3(shards):
    samples = _read(shards / "00000.tar")
    samples[2]["jpg"] = samples[2]["jpg"][: len(samples[2]["jpg"]) // 2]  # a truncated JPEG
    samples[4]["txt"] = b""
    samples[6]["txt"] = b"\xff\xfe caption in latin-1: \xe9t\xe9"
    _write(shards / "00000.tar", samples)
    report = check_shards(shards, progress=False)
    bad = {k: v for k, v in report["bad_samples"].items() if v}
    assert bad == {"undecodable_image": 1, "empty_caption": 1, "caption_not_utf8": 1}
    assert report["examples"]["caption_not_utf8"] == [samples[6]["__key__"]]
    for kind in bad:
        assert f"1 {kind}" in report["summary"]
    assert not report["ok"] and report["unreadable_shards"] == []


def test_the_check_counts_what_the_loader_skips(tmp_path):
    from tests.data.helpers import make_shards
    from tests.data.helpers import PREPROCESS, CountingTokenizer, config, run_epoch
    from vlcontrast.data.loader import build_train_loader

    defects = {(0, 1): "undecodable", (0, 2): "missing_image", (1, 0): "missing_caption",
               (1, 3): "empty_caption", (1, 5): "not_utf8", (0, 7): "bomb"}
    make_shards(tmp_path, [10, 10], defects=defects)
    report = check_shards(tmp_path, progress=False, max_image_pixels=32 * 32)
    cfg = config(str(tmp_path), batch_size=2, num_samples=14, shuffle_buffer=0)
    cfg.max_image_pixels = 32 * 32
    loader = build_train_loader(cfg, PREPROCESS, CountingTokenizer(), seed=0, rank=0,
                                world_size=1)
    run_epoch(loader)
    checked = {k: v for k, v in report["bad_samples"].items() if v}
    assert checked == loader.bad_samples == {
        "undecodable_image": 1, "missing_image": 1, "missing_caption": 1, "empty_caption": 1,
        "caption_not_utf8": 1, "decompression_bomb": 1}


def test_prep_check_command_names_all_three_problems(shards, capsys):
    from vlcontrast.cli import main

    samples = _read(shards / "00001.tar")
    samples[0]["jpg"] = samples[0]["jpg"][:200]  # a JPEG cut after its headers
    samples[1]["txt"] = b" \n"
    samples[2]["txt"] = "légende".encode("latin-1")
    _write(shards / "00001.tar", samples)
    assert main(["prep", "check", str(shards), "--no-progress"]) == 0  # readable: exit 0
    summary = capsys.readouterr().err
    for problem in ("1 undecodable_image", "1 empty_caption", "1 caption_not_utf8"):
        assert problem in summary, summary
    assert main(["prep", "check", str(shards / "{00000..00009}.tar"), "--no-progress"]) == 2
    assert "7 of 10 shards do not exist" in capsys.readouterr().err
