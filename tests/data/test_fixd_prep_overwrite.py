"""``--overwrite`` into an OUT an earlier prep wrote in another layout (or shard size, or naming).

The earlier prep's files must not survive beside the new ones: ``--overwrite`` removes exactly
what a prep recorded (its shards, their per-shard files, its metadata), also in the other layout
(``OUT/train``, ``OUT/val`` of a ``--val-fraction`` run, or OUT's own shards for one), and refuses
in one line shard files no prep recorded, which would be read with the new ones. Without
``--overwrite`` an earlier prep in the other layout is refused in one line. ``prep synthetic``
(which always replaces its world) and ``prep cc3m --overwrite`` follow the same rule.
"""

from __future__ import annotations

import importlib.util
import json
import math
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from vlcontrast import cli
from vlcontrast.data.naming import list_shards
from vlcontrast.data.prep import cc3m as cc3m_module
from vlcontrast.data.prep.folder import prepare_folder
from vlcontrast.data.prep.synthetic import write_synthetic
from vlcontrast.data.prep.table import prepare_table
from vlcontrast.data.shards import read_manifest
from vlcontrast.data.spec import expand_spec
from vlcontrast.errors import DataPrepError

N = 12


def table(tmp_path: Path) -> Path:
    (tmp_path / "img").mkdir(exist_ok=True)
    lines = ["filepath,title"]
    for i in range(N):
        Image.new("RGB", (20, 12), (20 * i, 5, 5)).save(tmp_path / "img" / f"{i}.png")
        lines.append(f"img/{i}.png,photo {i}")
    path = tmp_path / "t.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def csv(path, out, **options):
    return prepare_table(path, out, image_size=8, progress=False, workers=1, **options)


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def trained_on(spec) -> int:
    """Samples the training spec ``spec`` reads (its shards' sizes as a prep recorded them)."""
    urls = expand_spec(str(spec))
    sizes = read_manifest(spec)["shards"]
    assert sorted(Path(u).name for u in urls) == sorted(sizes)  # no shard beside the recorded
    return sum(sizes.values())


def test_a_split_overwrite_removes_the_flat_layout_and_keeps_the_user_s_files(tmp_path):
    out = tmp_path / "out"
    csv(table(tmp_path), out, shard_size=2)
    (out / "check_report.json").write_text("{}")  # prep check of the earlier shards
    (out / "notes.txt").write_text("mine")
    with pytest.raises(DataPrepError) as refused:
        csv(tmp_path / "t.csv", out, shard_size=5, val_fraction=0.3)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"prep csv: {str(out)!r} holds the shards "
                                                      "of an earlier prep in another layout")
    assert "--overwrite" in message and not (out / "train").exists()  # refused before writing
    report = csv(tmp_path / "t.csv", out, shard_size=5, val_fraction=0.3, overwrite=True)
    assert names(out) == ["notes.txt", "train", "val"]
    assert trained_on(out / "train") + trained_on(out / "val") == N
    assert report["train"]["num_samples"] + report["val"]["num_samples"] == N


def test_a_flat_overwrite_removes_the_split_layout(tmp_path):
    out = tmp_path / "out"
    csv(table(tmp_path), out, shard_size=2, val_fraction=0.3)
    (out / "val" / "mine.txt").write_text("mine")
    with pytest.raises(DataPrepError, match=r"holds the shards of an earlier prep in another "
                                            r"layout: train/ and val/ .*pass --overwrite"):
        csv(tmp_path / "t.csv", out, shard_size=5)
    csv(tmp_path / "t.csv", out, shard_size=5, overwrite=True)
    assert not (out / "train").exists()  # emptied, so removed
    assert names(out / "val") == ["mine.txt"]  # the user's file keeps its folder
    assert trained_on(out) == N and len(list_shards(out)) == 3


def test_fewer_shards_after_an_overwrite_leave_none_of_the_earlier(tmp_path):
    out = tmp_path / "out"
    csv(table(tmp_path), out, shard_size=1)  # 12 shards
    (out / "00003.tar.tmp").write_bytes(b"left by a killed run")
    csv(tmp_path / "t.csv", out, shard_size=5, overwrite=True)  # 3 shards
    assert [Path(p).name for p in list_shards(out)] == ["00000.tar", "00001.tar", "00002.tar"]
    assert not (out / "00003.tar.tmp").exists() and trained_on(out) == N


def test_a_shard_file_no_prep_recorded_is_refused_and_nothing_is_removed(tmp_path):
    out = tmp_path / "out"
    csv(table(tmp_path), out, shard_size=4)
    (out / "00042.tar").write_bytes((out / "00000.tar").read_bytes())  # the user's own
    before = names(out)
    with pytest.raises(DataPrepError) as refused:
        csv(tmp_path / "t.csv", out, shard_size=5, overwrite=True)
    assert str(refused.value) == (
        f"prep csv: {str(out)!r} holds 1 shard file no vlcontrast prep recorded (e.g. "
        "'00042.tar'; no manifest.json, _prep_state.json or NNNNN_stats.json names it), which "
        "would be read with the new shards, and prep removes only what a prep wrote: move it "
        "out of the folder or choose another OUT")
    assert names(out) == before
    # A split run reads OUT/train and OUT/val: the earlier prep's files in OUT go, the user's
    # shard stays where it is.
    csv(tmp_path / "t.csv", out, shard_size=5, val_fraction=0.3, overwrite=True)
    assert names(out) == ["00042.tar", "train", "val"]


def test_the_split_run_checks_both_of_its_folders_before_writing(tmp_path):
    out = tmp_path / "out"
    csv(table(tmp_path), out, shard_size=4, val_fraction=0.3)
    (out / "val" / "00099.tar").write_bytes((out / "train" / "00000.tar").read_bytes())
    train_before = names(out / "train")
    with pytest.raises(DataPrepError, match=r"'00099.tar'"):
        csv(tmp_path / "t.csv", out, shard_size=2, val_fraction=0.3, overwrite=True)
    assert names(out / "train") == train_before  # train/ was not rewritten first


def test_prep_folder_overwrite_removes_the_other_layout_and_its_class_files(tmp_path):
    src = tmp_path / "src"
    for i in range(8):
        path = src / ("red" if i % 2 else "blue") / f"thing_{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (16, 16), (20 * i, 0, 0)).save(path)
    out = tmp_path / "out"
    prepare_folder(src, out, caption_from="class", image_size=8, shard_size=3, progress=False)
    assert (out / "classnames.txt").is_file()
    prepare_folder(src, out, caption_from="name", image_size=8, shard_size=2, val_fraction=0.4,
                   progress=False, overwrite=True)
    assert names(out) == ["train", "val"]
    assert trained_on(out / "train") + trained_on(out / "val") == 8


def test_the_command_line_says_it_in_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    path = table(tmp_path)
    args = ["prep", "csv", str(path), str(out), "--image-size", "8", "--no-progress",
            "--workers", "1"]
    assert cli.main([*args, "--shard-size", "3"]) == 0
    capsys.readouterr()
    assert cli.main([*args, "--shard-size", "4", "--val-fraction", "0.3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another layout" in err and "--overwrite" in err
    assert cli.main([*args, "--shard-size", "4", "--val-fraction", "0.3", "--overwrite"]) == 0
    assert names(out) == ["train", "val"]


# ---- prep synthetic: always replaces its world, never beside another --------------------------


def synthetic(out, **sizes):
    options = dict(train=6, val=4, zeroshot_per_class=1, image_size=16, shard_size=2, workers=1,
                   progress=False)
    return write_synthetic(out, **{**options, **sizes})


def test_synthetic_leaves_no_earlier_world_beside_its_own(tmp_path):
    out = tmp_path / "syn"
    synthetic(out)
    (out / "zeroshot" / "circle" / "mine.jpg").write_bytes(b"the user's")
    synthetic(out, val=0, zeroshot_per_class=0)  # this world has no val/ and no zero-shot set
    assert names(out) == ["synthetic.json", "train", "zeroshot"]
    assert names(out / "zeroshot") == ["circle"]
    assert names(out / "zeroshot" / "circle") == ["mine.jpg"]
    record = json.loads((out / "synthetic.json").read_text())
    assert "val" not in record and "zeroshot" not in record


def test_synthetic_replaces_a_csv_split_and_refuses_another_layout_or_a_user_shard(tmp_path):
    out = tmp_path / "out"
    csv(table(tmp_path), out, shard_size=2, val_fraction=0.3)
    synthetic(out)
    assert names(out / "train") == ["00000.tar", "00000_stats.json", "00001.tar",
                                    "00001_stats.json", "00002.tar", "00002_stats.json",
                                    "manifest.json", "sizes.json"]  # no _prep_state.json left
    assert trained_on(out / "train") == 6 and trained_on(out / "val") == 4
    (out / "train" / "00007.tar").write_bytes((out / "train" / "00000.tar").read_bytes())
    with pytest.raises(DataPrepError, match=r"^prep synthetic: .* holds 1 shard file no "
                                            r"vlcontrast prep recorded .*choose another --out$"):
        synthetic(out)
    flat = tmp_path / "flat"
    csv(tmp_path / "t.csv", flat, shard_size=4)
    with pytest.raises(DataPrepError, match=r"^prep synthetic: .* another layout: its own shards "
                                            r".*remove them or choose another --out$"):
        synthetic(flat)


def test_synthetic_keeps_no_record_of_a_world_it_did_not_finish(tmp_path, monkeypatch):
    from vlcontrast.data.prep import synthetic as synthetic_module

    out = tmp_path / "syn"
    synthetic(out)

    def broken(job):
        raise OSError("disk full")
    monkeypatch.setattr(synthetic_module, "_run_job", broken)
    with pytest.raises(OSError):
        synthetic(out, train=8)
    assert not synthetic_module.is_current(out, train=6, val=4, zeroshot_per_class=1,
                                           image_size=16)


def test_a_csv_overwrite_of_a_synthetic_world_removes_its_record_and_zero_shot_set(tmp_path):
    out = tmp_path / "out"
    synthetic(out)
    csv(table(tmp_path), out, shard_size=5, overwrite=True)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == []
    assert not (out / "synthetic.json").exists() and trained_on(out) == N


# ---- prep cc3m --overwrite ---------------------------------------------------------------------


@pytest.fixture
def fake_download(monkeypatch):
    """img2dataset replaced by a writer of its layout: ``NNNNN.tar`` + ``NNNNN_stats.json``."""
    if importlib.util.find_spec("img2dataset") is None:
        pytest.skip("img2dataset is not installed")

    def run(options, out, done_before):
        import pyarrow.parquet as pq

        rows = pq.read_table(options["url_list"]).num_rows
        per_shard = options["number_sample_per_shard"]
        for shard in range(math.ceil(rows / per_shard)):
            count = min(per_shard, rows - shard * per_shard)
            with tarfile.open(out / f"{shard:05d}.tar", "w"):
                pass
            (out / f"{shard:05d}_stats.json").write_text(json.dumps(
                {"count": count, "successes": count, "failed_to_download": 0,
                 "failed_to_resize": 0}))
        return "done", None
    monkeypatch.setattr(cc3m_module, "_run_img2dataset", run)


def tsv(tmp_path: Path, rows: int = 6) -> Path:
    path = tmp_path / "list.tsv"
    path.write_text("".join(f"caption {i}\thttp://127.0.0.1:9/{i}.jpg\n" for i in range(rows)))
    return path


def test_cc3m_overwrite_removes_a_local_prep_s_files_and_the_split_layout(tmp_path, fake_download):
    out = tmp_path / "out"
    csv(table(tmp_path), out, shard_size=1, val_fraction=0.3)
    csv(tmp_path / "t.csv", out / "flat", shard_size=1)
    for name in ("train", "val"):
        (out / name / "check_report.json").write_text("{}")
    with pytest.raises(DataPrepError, match=r"^prep cc3m: .* another layout: train/ and val/"):
        cc3m_module.prepare_cc3m(tsv(tmp_path), out, number_sample_per_shard=4)
    cc3m_module.prepare_cc3m(tsv(tmp_path), out, number_sample_per_shard=4, incremental=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "00000.tar", "00000_stats.json", "00001.tar", "00001_stats.json", "_input", "flat",
        "manifest.json", "sizes.json"]
    # A local prep's files in OUT itself: its _prep_state.json, report and shards all go.
    flat = out / "flat"
    (flat / "check_report.json").write_text("{}")
    cc3m_module.prepare_cc3m(tsv(tmp_path), flat, number_sample_per_shard=5, incremental=False)
    assert names(flat) == ["00000.tar", "00000_stats.json", "00001.tar", "00001_stats.json",
                           "_input", "manifest.json", "sizes.json"]
    assert trained_on(flat) == 6


def test_cc3m_overwrite_refuses_a_shard_no_prep_recorded(tmp_path, fake_download):
    out = tmp_path / "out"
    out.mkdir()
    with tarfile.open(out / "00000.tar", "w"):
        pass
    with pytest.raises(DataPrepError, match=r"^prep cc3m: .* holds 1 shard file no vlcontrast "
                                            r"prep recorded \(e.g. '00000.tar'"):
        cc3m_module.prepare_cc3m(tsv(tmp_path), out, number_sample_per_shard=4, incremental=False)
    assert names(out) == ["00000.tar"]  # refused before the download cache was made
