"""The local converters: prep folder, prep csv, prep wds (shared writer: keys, resume, skips)."""

from __future__ import annotations

import io
import json
import os

import pytest
from PIL import Image

from tests.data.helpers import jpeg_bytes, write_shard
from vlcontrast import cli
from vlcontrast.data.prep.folder import clean_name, learn_authors, prepare_folder
from vlcontrast.data.prep.table import prepare_table
from vlcontrast.data.prep.wds import prepare_wds
from vlcontrast.data.prep.writer import STATE_FILE, encode_image
from vlcontrast.data.shards import read_manifest, read_sizes
from vlcontrast.data.tar_reader import read_shard
from vlcontrast.errors import DataPrepError


def image_file(path, size=(40, 20), mode="RGB", color=(200, 10, 10)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color).save(path)


def samples(out) -> list[tuple[str, dict]]:
    rows = []
    for name in sorted(read_sizes(out)):
        for _, key, members in read_shard(str(out / name)):
            rows.append((key, members))
    return rows


def test_folder_sidecars_any_nesting_skips_counted_and_resume(tmp_path):
    src = tmp_path / "src"
    image_file(src / "a" / "b" / "cat.png", size=(64, 32))
    (src / "a" / "b" / "cat.txt").write_text("a red cat\n")
    image_file(src / "dog.jpg")
    (src / "dog.json").write_text(json.dumps({"captions": ["a dog", "a red dog"]}))
    image_file(src / "nocap.jpg")                                   # missing caption
    (src / "broken.jpg").write_bytes(b"\xff\xd8 not really")        # unreadable image
    (src / "broken.txt").write_text("broken")
    image_file(src / "empty.webp")
    (src / "empty.txt").write_text("   ")                           # empty caption
    out = tmp_path / "out"
    report = prepare_folder(src, out, shard_size=1, workers=2, progress=False, image_size=16)
    assert report["num_samples"] == 2 and report["inputs"] == 5
    assert report["skipped"] == {"empty_caption": 1, "missing_caption": 1,
                                 "undecodable_image": 1}
    assert report["examples"]["missing_caption"] == ["nocap.jpg"]
    rows = dict(samples(out))
    assert list(rows) == [json.loads(m["json"])["key"] for m in rows.values()]
    captions = {json.loads(m["json"])["source_path"]: m["txt"].decode() for m in rows.values()}
    assert captions == {"a/b/cat.png": "a red cat", "dog.jpg": "a dog"}
    dog = next(m for m in rows.values() if m["txt"] == b"a dog")
    assert json.loads(dog["json"])["captions"] == ["a dog", "a red dog"]
    cat = Image.open(io.BytesIO(next(m for m in rows.values() if m["txt"] == b"a red cat")["jpg"]))
    assert cat.size == (32, 16)  # keep_ratio: shorter side to 16
    assert read_manifest(out)["id_space"] > 0 and read_manifest(out)["source"] == "folder"
    # resume: the same command keeps every finished shard
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")}
    again = prepare_folder(src, out, shard_size=1, workers=1, progress=False, image_size=16)
    # the shard counts count shard files: the three jobs whose only input was skipped left none
    assert again["shards_written"] == 0 and again["shards_done_before"] == len(mtimes)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")} == mtimes
    with pytest.raises(DataPrepError, match="--overwrite"):
        prepare_folder(src, out, shard_size=1, progress=False, image_size=32)


def test_folder_from_names_cleans_openclipart_titles_and_class_folders(tmp_path):
    src = tmp_path / "clipart"
    names = ["people/clothing/hats/pimp_hat_james_birkett_01.png",
             "office/clessidra_architetto_fra_01.png", "office/tavolo_architetto_fra_02.png",
             "office/sedia_architetto_fra_01.png", "geography/map_of_norway_jarno_vasa_01.png",
             "recreation/toys/rubik_s_cube_petri_lumme_01.png", "animals/hat_02.png",
             "top_level.png"]
    for name in names:
        image_file(src / name, mode="RGBA", color=(0, 0, 0, 0))  # fully transparent
    out = tmp_path / "out"
    report = prepare_folder(src, out, caption_from="name", progress=False, workers=1,
                            caption_template="{name}, {category} clip art", image_size=8)
    assert report["num_samples"] == len(names)
    got = {json.loads(m["json"])["source_path"]: m["txt"].decode() for _, m in samples(out)}
    assert got["people/clothing/hats/pimp_hat_james_birkett_01.png"] == "pimp hat, hats clip art"
    assert got["office/clessidra_architetto_fra_01.png"] == "clessidra, office clip art"
    assert got["recreation/toys/rubik_s_cube_petri_lumme_01.png"] == "rubik's cube, toys clip art"
    assert got["animals/hat_02.png"] == "hat, animals clip art"
    assert got["top_level.png"] == "top level clip art"
    pixel = Image.open(io.BytesIO(samples(out)[0][1]["jpg"])).convert("RGB").getpixel((0, 0))
    assert min(pixel) > 245  # transparent -> composited on white
    authors = learn_authors(["x_y_architetto_fra_01", "a_architetto_f_01", "b_architetto_fr_01",
                             "cigno_di_spalle_architet_01"])
    assert clean_name("cigno_di_spalle_architet_01", authors) == "cigno di spalle"
    assert clean_name("flourish_two_horizontal_01", authors) == "flourish two horizontal"
    assert clean_name("bordered_c_10", authors) == "bordered c 10"  # a card, not a copy mark
    assert clean_name("bordered_s_10", authors) == "bordered s 10"
    # a class word that ends every file name of its folder is the object, not a one-word author
    shapes = [f"{c}_circle_0{i}" for i, c in enumerate(("red", "green", "blue", "yellow"))]
    assert learn_authors(shapes).single == {"circle"}  # from the names alone: an author
    kept = learn_authors(shapes, folders=["shapes/circles"] * 4)
    assert not kept.single and clean_name("blue_circle_02", kept) == "blue circle"
    assert learn_authors(["bee1_mimooh_01", "cat_mimooh_01", "dog_mimooh_01"],
                         folders=["animals"] * 3).single == {"mimooh"}

    classes = tmp_path / "classes"
    for c, n in (("tabby_cat", 2), ("Dog", 1)):
        for i in range(n):
            image_file(classes / c / f"{i}.jpg")
    report = prepare_folder(classes, tmp_path / "cls", caption_from="class", progress=False,
                            workers=1, templates=["a photo of a {c}.", "art of a {c}."])
    assert report["classnames"] == ["dog", "tabby cat"]
    rows = [m for _, m in samples(tmp_path / "cls")]
    assert sorted(int(m["cls"]) for m in rows) == [0, 1, 1]
    tabby = [m for m in rows if m["cls"] == b"1"][0]
    assert tabby["txt"].decode() in ("a photo of a tabby cat.", "art of a tabby cat.")
    assert json.loads(tabby["json"])["captions"] == ["a photo of a tabby cat.",
                                                     "art of a tabby cat."]
    # a zero-shot set as it is: CLIP_benchmark's class names and templates beside the shards
    from vlcontrast.evaluation.datasets import resolve_zeroshot_data

    zeroshot = resolve_zeroshot_data(str(tmp_path / "cls"))
    assert list(zeroshot.classnames) == ["dog", "tabby cat"]
    assert list(zeroshot.templates) == ["a photo of a {c}.", "art of a {c}."]


def test_folder_errors_before_any_work(tmp_path):
    image_file(tmp_path / "src" / "a.jpg")
    with pytest.raises(DataPrepError, match="none of the 1 images.*--caption-from"):
        prepare_folder(tmp_path / "src", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()  # nothing created before the error
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataPrepError, match="no images"):
        prepare_folder(tmp_path / "empty", tmp_path / "out2", progress=False)
    with pytest.raises(DataPrepError, match="--template 'a {x}' has no {c}"):
        prepare_folder(tmp_path / "src", tmp_path / "out3", caption_from="class",
                       templates=["a {x}"], progress=False)


def test_csv_local_paths_merges_captions_and_counts_skips(tmp_path):
    image_file(tmp_path / "imgs" / "a.jpg")
    image_file(tmp_path / "imgs" / "b.jpg")
    (tmp_path / "data.csv").write_text(
        "filepath,title,other\n"
        "imgs/a.jpg,a photo,1\n"
        "imgs/a.jpg,\"another, with comma\",1\n"
        "imgs/b.jpg,,1\n"                 # empty caption
        "imgs/missing.jpg,lost,1\n"       # image file absent
        ",no image,1\n")
    out = tmp_path / "out"
    code = cli.main(["prep", "csv", str(tmp_path / "data.csv"), str(out), "--image-key",
                     "filepath", "--caption-key", "title", "--no-progress", "--workers", "1"])
    assert code == 0
    report = json.loads((out / "prep_report.json").read_text())
    assert report["num_samples"] == 1
    assert report["skipped"] == {"empty_caption": 1, "missing_image": 1,
                                 "missing_image_file": 1}
    ((_, members),) = samples(out)
    assert json.loads(members["json"])["captions"] == ["a photo", "another, with comma"]
    with pytest.raises(DataPrepError, match=r"data\.csv:1 has no column 'path'.*'filepath'"):
        prepare_table(tmp_path / "data.csv", tmp_path / "o2", image_key="path",
                      caption_key="title", progress=False)
    (tmp_path / "semi.csv").write_text("filepath;title\nimgs/a.jpg;x\n")
    with pytest.raises(DataPrepError, match=r"semi\.csv:1 has no column 'filepath'.* \(the header "
                                            r"seems to be separated by ';': give --sep ';'\)"):
        prepare_table(tmp_path / "semi.csv", tmp_path / "o4", progress=False)
    (tmp_path / "tabs.csv").write_text("filepath\ttitle\nimgs/a.jpg\tx\n")
    with pytest.raises(DataPrepError, match=r"separated by '\\t': give --sep '\\t'"):
        prepare_table(tmp_path / "tabs.csv", tmp_path / "o5", progress=False)
    (tmp_path / "mixed.tsv").write_text("filepath\ttitle\nimgs/a.jpg\tx\nhttp://h/b.jpg\ty\n")
    with pytest.raises(DataPrepError, match=r"mixed\.tsv:3.*mixes URLs"):
        prepare_table(tmp_path / "mixed.tsv", tmp_path / "o3", progress=False)


def test_wds_rekeys_hex_keys_keeps_the_original_and_trains_with_ids(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rows = []
    for n in range(6):
        row = {"__key__": f"img_{n:04x}", "jpg": jpeg_bytes((n * 30, 0, 0)),
               "json": json.dumps({"caption": f"c{n}", "uid": n}).encode()}
        rows.append(row)
    rows[2]["jpg"] = b"broken"
    del rows[4]["json"]  # no caption at all
    write_shard(src / "part-a.tar", rows[:3])
    write_shard(src / "part-b.tar", rows[3:])
    out = tmp_path / "out"
    report = prepare_wds(str(src), out, caption_key="json:caption", progress=False, workers=1)
    assert report["num_samples"] == 4 and report["inputs"] == 6
    assert report["skipped"] == {"missing_caption": 1, "undecodable_image": 1}
    got = samples(out)
    assert [k for k, _ in got] == ["000000", "000001", "000010", "000011"]  # stride 10
    metas = [json.loads(m["json"]) for _, m in got]
    assert [m["source_key"] for m in metas] == ["img_0000", "img_0001", "img_0003", "img_0005"]
    assert [m["source_shard"] for m in metas] == ["part-a.tar"] * 2 + ["part-b.tar"] * 2
    assert [m["txt"].decode() for _, m in got] == ["c0", "c1", "c3", "c5"]
    assert metas[0]["uid"] == 0 and read_manifest(out)["id_space"] == 20
    from vlcontrast.config import DataConfig
    from vlcontrast.data import check_ids_available

    shard_set = check_ids_available(DataConfig(train=str(out), batch_size=2), True)
    assert shard_set.id_space == 20 and shard_set.num_samples == 4
    with pytest.raises(DataPrepError, match="caption-key"):
        prepare_wds(str(src), tmp_path / "o2", caption_key="json:", progress=False)
    assert os.path.isfile(out / STATE_FILE)


def test_encode_image_alpha_palette_and_sixteen_bit(tmp_path):
    palette = Image.new("P", (10, 10), 0)
    palette.putpalette([0, 0, 0] * 256)
    buffer = io.BytesIO()
    palette.save(buffer, format="PNG", transparency=0)
    white = Image.open(io.BytesIO(encode_image(buffer.getvalue(), image_size=10)))
    assert min(white.getpixel((5, 5))) > 245
    deep = Image.new("I;16", (30, 10), 40000)
    buffer = io.BytesIO()
    deep.save(buffer, format="PNG")
    out = Image.open(io.BytesIO(encode_image(buffer.getvalue(), image_size=5)))
    assert out.size == (15, 5) and out.mode == "RGB"
    assert encode_image(b"garbage") == "undecodable_image"


def test_csv_of_urls_goes_through_img2dataset(tmp_path, image_server):
    rows = [("a red photo, with a comma", image_server.url("/good/0.jpg")),
            ("a green photo", image_server.url("/good/1.jpg")),
            ("gone", image_server.url("/missing.jpg")),
            ("", image_server.url("/good/2.jpg"))]          # empty caption: skipped before
    table = tmp_path / "urls.csv"
    table.write_text("url,caption\n" + "".join(f'{u},"{c}"\n' for c, u in rows))
    report = prepare_table(table, tmp_path / "out", image_key="url", caption_key="caption",
                           image_size=16, progress=False,
                           url_options=dict(processes=1, threads=2, number_sample_per_shard=10,
                                            timeout=5, retries=0))
    assert report["num_samples"] == 2 and report["failed_to_download"] == 1
    assert report["table_skipped"] == {"empty_caption": 1}
    captions = sorted(m["txt"].decode() for _, m in samples(tmp_path / "out"))
    assert captions == ["a green photo", "a red photo, with a comma"]


def test_prep_folder_val_fraction_holds_out_a_stable_hash_split(tmp_path):
    from PIL import Image

    from vlcontrast.data.prep.folder import prepare_folder
    from vlcontrast.data.prep.writer import held_out
    from vlcontrast.errors import DataPrepError

    root = tmp_path / "art"
    for i in range(40):
        path = root / ("animals" if i % 2 else "plants") / f"thing_{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (i, 2 * i, 3 * i)).save(path)
    report = prepare_folder(root, tmp_path / "out", caption_from="name", val_fraction=0.25,
                            workers=1, progress=False)
    expected_val = sum(held_out(p.relative_to(root).as_posix(), 0.25) for p in root.rglob("*.png"))
    assert 0 < expected_val < 40
    assert report["val"]["num_samples"] == expected_val
    assert report["train"]["num_samples"] == 40 - expected_val
    assert (tmp_path / "out" / "train" / "manifest.json").is_file()
    assert (tmp_path / "out" / "val" / "manifest.json").is_file()
    with pytest.raises(DataPrepError, match="--val-fraction=1.5"):
        prepare_folder(root, tmp_path / "bad", caption_from="name", val_fraction=1.5)


def test_transparency_is_white_in_every_reader_as_in_the_converters():
    """A transparent PNG read straight from a webdataset (training, evaluation, classify, embed)
    looks as the converters write it: transparency on white, not on black."""
    import io

    from PIL import Image

    from vlcontrast.data.prep.writer import encode_image
    from vlcontrast.data.samples import open_image

    art = Image.new("RGBA", (32, 32), (0, 0, 0, 0))
    art.paste((200, 0, 0, 255), (8, 8, 24, 24))
    palette = art.convert("P")  # palette transparency too
    for image in (art, palette, art.convert("LA")):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        decoded = open_image(buffer.getvalue())
        assert decoded.mode == "RGB"
        assert decoded.getpixel((0, 0)) == (255, 255, 255), image.mode
        written = encode_image(buffer.getvalue(), image_size=32, resize_mode="no")
        converted = Image.open(io.BytesIO(written)).convert("RGB")
        assert all(abs(a - b) <= 3 for a, b in zip(converted.getpixel((0, 0)), (255, 255, 255)))
    assert open_image(buffer.getvalue()).getpixel((16, 16)) != (255, 255, 255)


def test_prep_csv_val_fraction_splits_local_images_by_the_folder_rule(tmp_path, capsys):
    from vlcontrast.data.prep.writer import held_out

    lines = ["filepath,title"]
    for i in range(30):
        image_file(tmp_path / "imgs" / f"p{i}.jpg")
        lines.append(f"imgs/p{i}.jpg,picture number {i}")
    lines.append("imgs/p0.jpg,a second caption")        # merged with its image, same split
    (tmp_path / "data.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert cli.main(["prep", "csv", str(tmp_path / "data.csv"), str(out), "--val-fraction",
                     "0.3", "--no-progress", "--workers", "1"]) == 0
    expected_val = sum(held_out(f"imgs/p{i}.jpg", 0.3) for i in range(30))
    assert 0 < expected_val < 30
    # one line per split, naming its report; --json prints the reports instead
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith(f"val: prep: {expected_val} samples in 1 shards")
    assert lines[1].endswith(f"(report: {out / 'val' / 'prep_report.json'})")
    assert cli.main(["prep", "csv", str(tmp_path / "data.csv"), str(out), "--val-fraction",
                     "0.3", "--no-progress", "--workers", "1", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["val"]["num_samples"] == expected_val
    assert printed["train"]["num_samples"] == 30 - expected_val
    for split in ("train", "val"):
        assert (out / split / "manifest.json").is_file()
    (tmp_path / "urls.csv").write_text("filepath,title\nhttp://h/a.jpg,x\n")
    with pytest.raises(DataPrepError, match="--val-fraction works on local paths"):
        prepare_table(tmp_path / "urls.csv", tmp_path / "o4", val_fraction=0.1, progress=False)


def test_prep_csv_of_a_folder_says_it_takes_a_table(tmp_path, capsys):
    image_file(tmp_path / "mine" / "a.jpg")
    capsys.readouterr()
    assert cli.main(["prep", "csv", str(tmp_path / "mine"), str(tmp_path / "out"), "--image-key",
                     "filepath", "--caption-key", "title"]) == 2
    err = capsys.readouterr().err
    assert err == (f"vlcontrast: error: prep csv: {str(tmp_path / 'mine')!r} is a folder; prep csv "
                   "takes a CSV/TSV file with a header row (for a folder of images run `vlcontrast "
                   f"prep folder {tmp_path / 'mine'} OUT`)\n")
    # A table inside the folder is named.
    (tmp_path / "mine" / "images.csv").write_text("filepath,title\na.jpg,a cat\n")
    with pytest.raises(DataPrepError, match=r"takes a CSV/TSV file with a header row, e\.g\. "
                                            r"'.*mine/images\.csv'"):
        prepare_table(tmp_path / "mine", tmp_path / "out2", progress=False)


@pytest.mark.parametrize("args, message", [
    (["--caption-template", "{name}"], "--caption-template applies only to --caption-from name, "
     "not sidecar (the default); add --caption-from name or drop --caption-template"),
    (["--keep-author"], "--keep-author applies only to --caption-from name, not sidecar (the "
     "default); add --caption-from name or drop --keep-author"),
    (["--template", "a {c}"], "--template applies only to --caption-from class, not sidecar (the "
     "default); add --caption-from class or drop --template"),
    (["--caption-from", "name", "--template", "a {c}"], "--template applies only to "
     "--caption-from class, not name; add --caption-from class or drop --template"),
    (["--caption-from", "class", "--caption-template", "{name}"], "--caption-template applies "
     "only to --caption-from name, not class; add --caption-from name or drop --caption-template"),
    (["--caption-from", "class", "--keep-author"], "--keep-author applies only to --caption-from "
     "name, not class; add --caption-from name or drop --keep-author"),
])
def test_prep_folder_refuses_options_of_another_caption_source(tmp_path, capsys, args, message):
    image_file(tmp_path / "src" / "cats" / "a.jpg")
    (tmp_path / "src" / "cats" / "a.txt").write_text("a cat")
    capsys.readouterr()
    assert cli.main(["prep", "folder", str(tmp_path / "src"), str(tmp_path / "out"),
                     "--no-progress", *args]) == 2
    assert capsys.readouterr().err == f"vlcontrast: error: prep folder: {message}\n"
    assert not any((tmp_path / "out").glob("*"))  # refused before any image is read
