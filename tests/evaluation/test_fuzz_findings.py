"""Findings of a fuzzing pass over evaluation: a truncated shard among good ones is a shard
event, listed apart from the skipped samples (whose reasons sum to the count) in the line and the
record, and warned about in the training loader's words; a file that is gone is counted under the
converters' reason, not as an undecodable image."""

from __future__ import annotations

import json
import logging
import os
import re

from tests.evaluation.helpers import image_bytes, write_retrieval_shards
from tests.inference.helpers import run_cli
from vlcontrast.evaluation.datasets import FolderEvalDataset

COMMON = ["--workers", "0", "--device", "cpu", "--batch-size", "4", "--no-progress"]


def test_a_truncated_shard_is_listed_apart_and_the_reasons_sum_to_the_skipped(
        tmp_path, tiny_checkpoint, capsys, caplog):
    shards = tmp_path / "shards"
    write_retrieval_shards(shards, 8, per_shard=4, broken=(1, 6), sizes_json=False)
    (shards / "00002.tar").write_bytes(b"")  # an empty (cut) shard among good ones
    out = tmp_path / "ret.json"
    with caplog.at_level(logging.WARNING):
        code, _, err = run_cli(capsys, "eval", "retrieval", "--checkpoint", str(tiny_checkpoint),
                               "--data", str(shards), "--out", str(out), *COMMON)
    assert code == 0, err
    line = next(l for l in err.splitlines() if "skipped" in l)
    match = re.search(r"skipped (\d+) of (\d+) samples \(([^)]*)\)", line)
    assert match, line
    counted = sum(int(part.split(": ")[1]) for part in match.group(3).split(", "))
    assert counted == int(match.group(1)) == 2, line
    assert int(match.group(2)) == 8
    assert "truncated_tar" not in match.group(3) and "; input shards: 1 truncated_tar" in line
    record = json.loads(out.read_text())
    assert record["metrics"]["num_skipped"] == sum(record["skipped_reasons"].values()) == 2
    assert record["skipped_reasons"] == {"undecodable_image": 2}
    assert record["shard_events"] == {"truncated_tar": 1}
    warned = [r.getMessage() for r in caplog.records if "00002.tar" in r.getMessage()]
    assert warned and "holds no complete sample (an empty or cut file)" in warned[0], warned


def test_a_file_gone_from_a_folder_is_a_missing_image_file(tmp_path):
    (tmp_path / "good.jpg").write_bytes(image_bytes(0))
    os.symlink(tmp_path / "nowhere.jpg", tmp_path / "dangling.jpg")
    (tmp_path / "folder.jpg").mkdir()
    samples = [(str(tmp_path / name), 0) for name in ("good.jpg", "dangling.jpg", "folder.jpg")]
    dataset = FolderEvalDataset(samples, lambda image: image, 0, 1)
    assert [dataset[i][1] for i in (1, 2)] == ["missing_image_file", "unreadable_file"]
    assert not isinstance(dataset[0][1], str)
