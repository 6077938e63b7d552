"""One shard taxonomy for the readers and ``prep check``: a file that is no tar at all (its first
header is not a tar header) is an ``unreadable_shard`` for the tar reader as for the check; a file
cut after valid headers (or empty) stays ``truncated_tar``."""

import json
import os

from tests.data.helpers import make_shards
from vlcontrast.data.check import check_shards
from vlcontrast.data.tar_reader import read_shard


def _events(path) -> tuple[int, dict, list]:
    counts, errors = {}, []
    rows = sum(1 for _ in read_shard(str(path), counts=counts, errors=errors, exact=False))
    return rows, counts, errors


def test_a_file_that_is_no_tar_is_unreadable_for_the_reader_as_for_prep_check(tmp_path):
    make_shards(tmp_path, [4, 4], metadata=False)
    cut = tmp_path / "00001.tar"
    os.truncate(cut, os.path.getsize(cut) // 2 + 100)       # cut after valid headers
    garbage = tmp_path / "00002.tar"
    garbage.write_bytes(b"not a tar shard, only bytes. " * 200)  # no tar header at all
    (tmp_path / "00003.tar").write_bytes(b"")               # an empty file: a cut one

    rows, counts, errors = _events(garbage)
    assert (rows, counts) == (0, {"unreadable_shard": 1}), (counts, errors)
    assert len(errors) == 1 and "\n" not in errors[0] and "header" in errors[0], errors
    assert _events(cut)[1] == {"truncated_tar": 1}
    assert _events(tmp_path / "00003.tar")[1] == {"truncated_tar": 1}
    assert _events(tmp_path / "00000.tar")[1] == {}

    report = check_shards(str(tmp_path), progress=False, decode_images=False)
    assert [u["shard"] for u in report["unreadable_shards"]] == ["00002.tar"]
    truncated = json.dumps(report.get("truncated_shards"))
    assert "00001.tar" in truncated and "00002.tar" not in truncated
