"""``--overwrite`` never loses the user's data: nothing is removed until every input check has
passed, and nothing that is an input of this prep is ever removed.

* ``prep wds 'OUT/train/00000.tar' OUT --overwrite`` (the input is a shard of the earlier
  ``--val-fraction`` prep in OUT) is refused in one line naming the input; the earlier shards
  stay (they used to be deleted before they were read);
* ``prep folder EMPTY OUT --overwrite`` / ``prep csv`` with a ``--val-fraction`` that leaves a
  split empty fail their input check before removing the earlier dataset in OUT (which used to
  be gone after the error).

Real images (PIL), the real command line (``vlcontrast.cli.main`` in-process).
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from vlcontrast import cli
from vlcontrast.data.naming import list_shards
from vlcontrast.data.shards import read_manifest
from vlcontrast.data.spec import expand_spec

SMALL = ["--image-size", "8", "--no-progress", "--workers", "1"]


def class_folder(root: Path, n: int = 12) -> Path:
    for i in range(n):
        path = root / ("red" if i % 2 else "blue") / f"thing_{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (16, 12), (20 * i, 40, 5)).save(path)
    return root


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def readable(spec: Path) -> int:
    """Samples a training run reads from ``spec`` (every recorded shard there, none beside)."""
    urls = expand_spec(str(spec))
    sizes = read_manifest(spec)["shards"]
    assert sorted(Path(u).name for u in urls) == sorted(sizes)
    return sum(sizes.values())


def run(args: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main(args)
    return code, capsys.readouterr().err


def test_prep_wds_overwrite_refuses_to_remove_its_own_input_shards(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    class_folder(tmp_path / "imgs")
    code, _ = run(["prep", "folder", "imgs", "data", "--caption-from", "class",
                   "--val-fraction", "0.25", *SMALL], capsys)
    assert code == 0
    before = snapshot(tmp_path / "data")
    train = readable(tmp_path / "data" / "train")
    code, err = run(["prep", "wds", "data/train/00000.tar", "data", "--overwrite",
                     "--workers", "1", "--no-progress"], capsys)
    assert code == 2
    assert err.count("\n") == 1, err
    assert "'data/train/00000.tar'" in err and "input" in err and "another OUT" in err
    assert snapshot(tmp_path / "data") == before  # nothing removed, nothing written
    assert readable(tmp_path / "data" / "train") == train
    # Written elsewhere, the same input works.
    code, _ = run(["prep", "wds", "data/train/00000.tar", "rekeyed", "--overwrite",
                   "--workers", "1", "--no-progress"], capsys)
    assert code == 0 and readable(tmp_path / "rekeyed") == train


def test_prep_wds_overwrite_refuses_an_input_reached_through_a_link(tmp_path, capsys,
                                                                    monkeypatch):
    monkeypatch.chdir(tmp_path)
    class_folder(tmp_path / "imgs")
    assert cli.main(["prep", "folder", "imgs", "data", "--caption-from", "class",
                     "--val-fraction", "0.25", *SMALL]) == 0
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.tar").symlink_to(tmp_path / "data" / "val" / "00000.tar")
    before = snapshot(tmp_path / "data")
    code, err = run(["prep", "wds", "in/a.tar", "data", "--overwrite", "--workers", "1",
                     "--no-progress"], capsys)
    assert code == 2 and "00000.tar" in err and "input" in err
    assert snapshot(tmp_path / "data") == before


def test_prep_folder_overwrite_with_no_images_keeps_the_earlier_dataset(tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    class_folder(tmp_path / "imgs")
    (tmp_path / "empty").mkdir()
    assert cli.main(["prep", "folder", "imgs", "data2", "--caption-from", "class", *SMALL]) == 0
    before = snapshot(tmp_path / "data2")
    assert "00000.tar" in before
    code, err = run(["prep", "folder", "empty", "data2", "--caption-from", "class",
                     "--val-fraction", "0.25", "--overwrite", *SMALL], capsys)
    assert code == 2 and err.count("\n") == 1 and "no images" in err
    assert snapshot(tmp_path / "data2") == before
    assert readable(tmp_path / "data2") == 12


def test_prep_folder_overwrite_with_an_empty_split_keeps_the_earlier_dataset(tmp_path, capsys,
                                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    class_folder(tmp_path / "imgs", n=2)
    assert cli.main(["prep", "folder", "imgs", "out", "--caption-from", "class", *SMALL]) == 0
    before = snapshot(tmp_path / "out")
    # 2 images and a fraction that holds out none or all of them: the split check fails
    code, err = run(["prep", "folder", "imgs", "out", "--caption-from", "class",
                     "--val-fraction", "0.001", "--overwrite", *SMALL], capsys)
    assert code == 2 and "--val-fraction" in err and "empty" in err
    assert snapshot(tmp_path / "out") == before


def test_prep_csv_overwrite_with_an_empty_split_keeps_the_earlier_dataset(tmp_path, capsys):
    (tmp_path / "img").mkdir()
    lines = ["filepath,title"]
    for i in range(2):
        Image.new("RGB", (20, 12), (60 * i, 5, 5)).save(tmp_path / "img" / f"{i}.png")
        lines.append(f"img/{i}.png,photo {i}")
    table = tmp_path / "t.csv"
    table.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert cli.main(["prep", "csv", str(table), str(out), *SMALL]) == 0
    before = snapshot(out)
    code, err = run(["prep", "csv", str(table), str(out), "--val-fraction", "0.001",
                     "--overwrite", *SMALL], capsys)
    assert code == 2 and "--val-fraction" in err and "empty" in err
    assert snapshot(out) == before
    assert readable(out) == 2


def test_prep_folder_overwrite_of_an_out_inside_the_image_folder_still_works(tmp_path, capsys):
    """The documented layout ``prep folder DIR DIR/shards``: the earlier prep's files lie inside
    the input folder but are not inputs, so ``--overwrite`` replaces them."""
    src = class_folder(tmp_path / "src")
    out = src / "shards"
    assert cli.main(["prep", "folder", str(src), str(out), "--caption-from", "class",
                     "--shard-size", "5", *SMALL]) == 0
    assert len(list_shards(out)) == 3
    code, err = run(["prep", "folder", str(src), str(out), "--caption-from", "class",
                     "--shard-size", "12", "--overwrite", *SMALL], capsys)
    assert code == 0, err
    assert [Path(p).name for p in list_shards(out)] == ["00000.tar"] and readable(out) == 12
    assert json.loads((out / "manifest.json").read_text())["num_samples"] == 12
