"""``prep cc3m`` / ``prep csv`` of URLs when the download is interrupted or gets nothing, and
``prep csv`` of JSON lines / parquet tables.

Everything is local: a 127.0.0.1 image server (``image_server``) and a closed port for "no
network"; the interrupted run is a real ``vlcontrast prep cc3m`` process whose process group gets
SIGINT, as a terminal's Ctrl-C sends it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.data.helpers import jpeg_of
from vlcontrast.cli import main
from vlcontrast.data.prep.cc3m import DownloadFailed, prepare_cc3m
from vlcontrast.data.prep.table import prepare_table, read_table
from vlcontrast.data.shards import read_manifest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _direct(monkeypatch):
    # urllib honours *_proxy variables; the closed local port must be reached directly.
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                 "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_ALBUMENTATIONS_UPDATE", "1")


def _closed_port_url(path: str) -> str:
    with socket.socket() as s:  # a port nothing listens on: "connection refused"
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}{path}"


def test_ctrl_c_keeps_the_earlier_manifest_and_exits_130(tmp_path, image_server):
    small = tmp_path / "small.tsv"
    small.write_text("".join(f"good {i}\t{image_server.url(f'/good/{i}.jpg')}\n" for i in range(5)))
    big = tmp_path / "big.tsv"  # then slow images (3 s each): shard 1 is being written for seconds
    big.write_text(small.read_text()
                   + "".join(f"slow {i}\t{image_server.url('/slow.jpg')}\n" for i in range(40)))
    out = tmp_path / "out"
    cli = [sys.executable, "-m", "vlcontrast.cli", "prep", "cc3m", "--out", str(out),
           "--processes", "1", "--threads", "4", "--number-sample-per-shard", "5",
           "--image-size", "16", "--timeout", "10"]
    if not (REPO / "vlcontrast" / "cli" / "__main__.py").exists():
        cli[1:3] = ["-c", "import sys; from vlcontrast.cli import main; sys.exit(main())"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.run(cli + ["--tsv", str(small)], env=env, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    (out / "check_report.json").write_text('{"kept": true}')
    earlier = {name: (out / name).read_bytes() for name in ("manifest.json", "sizes.json")}

    proc = subprocess.Popen(cli + ["--tsv", str(big)], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "00001.tar").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        assert (out / "00001.tar").exists(), "shard 1 never started"
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "interrupted" in line]
    assert lines and "re-run the same command to continue" in lines[-1], stderr[-3000:]
    for name, data in earlier.items():  # put back, never lost or rewritten for a partial run
        assert (out / name).read_bytes() == data, name
    assert json.loads((out / "check_report.json").read_text()) == {"kept": True}
    assert not (out / "_aside").exists()
    assert (out / "00000.tar").exists() and (out / "00000_stats.json").exists()
    assert not (out / "00001.tar").exists()  # the half-written shard (no _stats.json) is gone


def test_a_download_that_gets_nothing_fails_naming_the_cause(tmp_path, capsys):
    tsv = tmp_path / "offline.tsv"
    tsv.write_text("".join(f"thing {i}\t{_closed_port_url(f'/img{i}.jpg')}\n" for i in range(6)))
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text('{"earlier": 1}')
    with pytest.raises(DownloadFailed, match=r"Connection refused.*firewall, or a proxy"):
        prepare_cc3m(tsv, out, processes=1, threads=2, number_sample_per_shard=3, timeout=2,
                     retries=0)
    assert (out / "manifest.json").read_text() == '{"earlier": 1}'  # not replaced, not lost
    assert not (out / "_aside").exists()
    # The shards that got nothing are tried again by a re-run (their stats are renamed).
    assert not list(out.glob("*_stats.json")) and list(out.glob("*_stats.json.failed"))

    # The command line: exit status 1 and one line.
    code = main(["prep", "cc3m", "--tsv", str(tsv), "--out", str(out), "--processes", "1",
                 "--threads", "2", "--number-sample-per-shard", "3", "--timeout", "2",
                 "--retries", "0"])
    assert code == 1
    err = capsys.readouterr().err
    assert "vlcontrast: error: prep cc3m:" in err and "Connection refused" in err
    assert len([line for line in err.splitlines() if "vlcontrast: error" in line]) == 1


def test_no_network_stops_after_the_first_shard(tmp_path):
    tsv = tmp_path / "offline.tsv"
    url = _closed_port_url("/img.jpg")
    tsv.write_text("".join(f"thing {i}\t{url}?{i}\n" for i in range(3000)))
    out = tmp_path / "out"
    with pytest.raises(DownloadFailed, match=r"stopped after the first shard"):
        prepare_cc3m(tsv, out, processes=1, threads=2, number_sample_per_shard=5, timeout=2,
                     retries=0)
    assert len(list(out.glob("*_stats.json.failed"))) < 600  # of 600 shards


def test_csv_of_urls_writes_its_report_and_counts_failed_downloads(tmp_path, image_server,
                                                                     capsys, monkeypatch):
    table = tmp_path / "urls.csv"
    table.write_text("url,caption\n"
                     f"{image_server.url('/good/0.jpg')},a red photo\n"
                     f"{image_server.url('/missing.jpg')},gone\n"
                     f"{image_server.url('/good/1.jpg')},\n")
    out = tmp_path / "out"
    report = prepare_table(table, out, image_key="url", caption_key="caption", image_size=16,
                           progress=False, url_options=dict(processes=1, threads=2, timeout=5,
                                                            retries=0))
    manifest = read_manifest(out)
    assert manifest["source"] == "csv" and manifest["downloader"] == "img2dataset"
    assert manifest["table"] == str(table.resolve())
    assert manifest["skipped"] == {"empty_caption": 1, "failed_to_download": 1}
    saved = json.loads((out / "prep_report.json").read_text())
    assert saved["num_samples"] == 1 == report["num_samples"]
    assert saved["skipped"] == manifest["skipped"] and saved["out_dir"] == str(out.resolve())

    from vlcontrast.data.prep.writer import summary
    assert "skipped 1 empty_caption, 1 failed_to_download" in summary(report)


def test_csv_of_urls_that_all_fail_exits_1(tmp_path, capsys):
    table = tmp_path / "urls.csv"
    table.write_text("url,caption\n" + "".join(f"{_closed_port_url(f'/{i}.jpg')},photo {i}\n"
                                               for i in range(2)))
    code = main(["prep", "csv", str(table), str(tmp_path / "out"), "--image-key", "url",
                 "--caption-key", "caption"])
    assert code == 1
    err = capsys.readouterr().err
    assert "vlcontrast: error: prep csv:" in err and "Connection refused" in err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_json_lines_and_parquet_tables(tmp_path):
    images = tmp_path / "img"
    images.mkdir()
    for i in range(3):
        (images / f"{i}.jpg").write_bytes(jpeg_of((50 * i, 80, 90), (20, 20)))
    records = [{"filepath": "img/0.jpg", "title": "a photo"},
               {"filepath": "img/1.jpg", "title": ["one", "two"]},
               {"filepath": "img/2.jpg", "title": ""},
               {"title": "no image"}]
    jsonl = tmp_path / "list.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records) + "not json\n")
    rows, skipped, _ = read_table(jsonl, "filepath", "title", "\t")
    assert rows == [(1, "img/0.jpg", "a photo"), (2, "img/1.jpg", "one"), (2, "img/1.jpg", "two")]
    assert skipped == {"empty_caption": 1, "missing_image": 1, "invalid_json": 1}
    report = prepare_table(jsonl, tmp_path / "out", progress=False, workers=1, image_size=16)
    assert report["num_samples"] == 2 and report["source"] == "csv"

    # A JSON-lines file under another name is recognised by its first line.
    renamed = tmp_path / "list.csv"
    renamed.write_text(jsonl.read_text())
    assert read_table(renamed, "filepath", "title", ",")[0] == rows

    with pytest.raises(Exception, match=r"list\.jsonl:1 has no key 'path'; its keys are "
                                        r"\['filepath', 'title'\]"):
        read_table(jsonl, "path", "title", "\t")

    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    table = pa.table({"filepath": ["img/0.jpg", "img/2.jpg"], "title": ["first", None]})
    pq.write_table(table, tmp_path / "list.parquet")
    rows, skipped, _ = read_table(tmp_path / "list.parquet", "filepath", "title", "\t")
    assert rows == [(1, "img/0.jpg", "first")] and skipped == {"empty_caption": 1}
