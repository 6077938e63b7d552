"""Findings of a fuzzing pass over classify and embed: a dangling link is a missing file, not an
undecodable image, and embedding shards says ``skipped N of M samples`` as every command does."""

from __future__ import annotations

import json
import os

from tests.evaluation.helpers import image_bytes
from tests.inference.helpers import run_cli
from tests.inference.test_max_image_pixels import write_sized_shard


def test_classify_and_embed_count_a_dangling_link_as_a_missing_file(trained, tmp_path, capsys):
    folder = tmp_path / "imgs"
    folder.mkdir()
    (folder / "good.jpg").write_bytes(image_bytes(0))
    os.symlink(folder / "gone.jpg", folder / "dangling.jpg")
    code, out, err = run_cli(capsys, "classify", "--checkpoint", str(trained[1]), "--labels",
                             "cat,dog", "--json", "--workers", "0", "--no-progress", str(folder))
    assert code == 0, err
    assert json.loads(out)["skipped_reasons"] == {"missing_image_file": 1}
    assert "skipped 1 of 2 images (missing_image_file: 1)" in err
    code, _, err = run_cli(capsys, "embed", "--checkpoint", str(trained[1]), "--images",
                           str(folder), "--out", str(tmp_path / "e.npy"), "--workers", "0",
                           "--no-progress")
    assert code == 0, err
    assert "skipped 1 of 2 images (missing_image_file: 1)" in err


def test_embed_shards_says_how_many_of_how_many_and_lists_shard_events_apart(
        trained, tmp_path, capsys):
    shards = tmp_path / "shards"
    write_sized_shard(shards / "00000.tar", [8, 16, 8])
    (shards / "00001.tar").write_bytes(b"")
    code, _, err = run_cli(capsys, "embed", "--checkpoint", str(trained[1]), "--images",
                           str(shards), "--out", str(tmp_path / "e.npy"), "--workers", "0",
                           "--no-progress", "--max-image-pixels", "100")
    assert code == 0, err
    assert ("vlcontrast embed: skipped 1 of 3 samples (decompression_bomb: 1); input shards: "
            "1 truncated_tar; raise --max-image-pixels") in err, err
