"""CC3M preparation against a local HTTP server: successes, 404s, corrupt bytes, slow responses.

The server runs on 127.0.0.1 with an ephemeral port inside the test; nothing else is contacted.
"""

from __future__ import annotations

import io
import json
import tarfile

import pytest
from PIL import Image

from tests.data.helpers import ImageServer
from vlcontrast.data.prep.cc3m import check_tsv, prepare_cc3m
from vlcontrast.data.shards import read_manifest, read_sizes
from vlcontrast.errors import DataPrepError

TIMEOUT_S = 1
def _rows(server: ImageServer) -> list[tuple[str, str]]:
    # Google's format: caption<TAB>url, no header. A caption with a quote must survive verbatim.
    return [
        ('a "quoted" red photo', server.url("/good/0.jpg")),
        ("a green photo", server.url("/good/1.jpg")),
        ("a photo that is gone", server.url("/missing.jpg")),
        ("a broken photo", server.url("/corrupt.jpg")),
        ("a blue photo", server.url("/good/2.jpg")),
        ("a photo that takes forever", server.url("/slow.jpg")),
        ("a photo served on the second try", server.url("/flaky.jpg")),
        ("a yellow photo", server.url("/good/3.jpg")),
        ("a last photo", server.url("/good/4.jpg")),
    ]


def _write_tsv(path, rows) -> None:
    path.write_text("".join(f"{caption}\t{url}\n" for caption, url in rows))


def _read_tar(path) -> dict[str, dict[str, bytes]]:
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tar:
        for member in tar:
            key, ext = member.name.split(".", 1)
            samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
    return samples


def test_prepare_cc3m_counts_failures_and_resumes(tmp_path, image_server):
    rows = _rows(image_server)
    tsv = tmp_path / "Train_GCC-training.tsv"
    _write_tsv(tsv, rows)
    out = tmp_path / "cc3m"

    stats = prepare_cc3m(tsv, out, processes=1, threads=4, image_size=32, resize_mode="center_crop",
                         number_sample_per_shard=5, timeout=TIMEOUT_S, retries=1)

    # 9 rows, 5 per shard: two shards; keys are shard * 10 + row (img2dataset's oom rule).
    good_urls = {image_server.url(f"/good/{i}.jpg") for i in range(5)} | {image_server.url("/flaky.jpg")}
    assert stats["num_shards"] == 2
    assert stats["num_samples"] == 6  # five good images + the flaky one after its retry
    assert stats["attempted"] == 9
    assert stats["failed_to_download"] == 2  # the 404 and the slow one (timeout)
    assert stats["failed_to_resize"] == 1  # the corrupt bytes
    assert stats["incomplete_shards"] == []
    assert stats["shards_written"] == 2 and stats["shards_done_before"] == 0
    assert stats["id_space"] == 20 and stats["key_stride"] == 10
    assert read_sizes(out) == {"00000.tar": 3, "00001.tar": 3}
    manifest = read_manifest(out)
    assert manifest["shards"] == {"00000.tar": 3, "00001.tar": 3}
    assert manifest["source"] == "img2dataset"
    assert manifest["pattern"] == "{00000..00001}.tar"

    samples = {**_read_tar(out / "00000.tar"), **_read_tar(out / "00001.tar")}
    assert sorted(samples) == ["000000", "000001", "000004", "000011", "000012", "000013"]
    by_url = {}
    for key, sample in samples.items():
        meta = json.loads(sample["json"])
        assert meta["key"] == key and meta["status"] == "success"
        assert meta["caption"] == sample["txt"].decode()
        by_url[meta["url"]] = sample
        image = Image.open(io.BytesIO(sample["jpg"]))
        assert image.size == (32, 32)
    assert set(by_url) == good_urls
    assert by_url[image_server.url("/good/0.jpg")]["txt"].decode() == 'a "quoted" red photo'

    # A check report (any non-shard json) beside the shards must not break img2dataset's resume.
    (out / "check_report.json").write_text("{}")
    hits_before = len(image_server.hits)
    again = prepare_cc3m(tsv, out, processes=1, threads=4, image_size=32,
                         resize_mode="center_crop", number_sample_per_shard=5, timeout=TIMEOUT_S,
                         retries=1)
    assert len(image_server.hits) == hits_before, "the incremental re-run downloaded again"
    assert again["shards_done_before"] == 2 and again["shards_written"] == 0
    assert again["num_samples"] == 6 and read_sizes(out) == {"00000.tar": 3, "00001.tar": 3}
    assert (out / "check_report.json").read_text() == "{}"


def test_check_tsv_rejects_malformed_lines_before_work(tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_text("a caption\thttp://x/1.jpg\nno tab on this line\n")
    with pytest.raises(DataPrepError, match=r"bad\.tsv:2: expected 2 tab-separated columns"):
        prepare_cc3m(bad, tmp_path / "out", processes=1, threads=1)
    assert not (tmp_path / "out").exists()

    no_url = tmp_path / "no_url.tsv"
    no_url.write_text("a caption\tnot a url\n")
    with pytest.raises(DataPrepError, match=r"no_url\.tsv:1: expected one http\(s\) URL"):
        check_tsv(no_url)

    with pytest.raises(FileNotFoundError, match="missing.tsv"):
        prepare_cc3m(tmp_path / "missing.tsv", tmp_path / "out", processes=1, threads=1)

    headered = tmp_path / "headered.tsv"
    headered.write_text("caption\turl\na caption\thttp://x/1.jpg\n")
    assert check_tsv(headered) == {"header": True, "url_column": 1}
    swapped = tmp_path / "cc12m.tsv"
    swapped.write_text("http://x/1.jpg\ta caption\n")
    assert check_tsv(swapped) == {"header": False, "url_column": 0}
