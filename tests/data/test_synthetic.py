"""The synthetic world: determinism, img2dataset's shard format, readers, zero-shot set, captions."""

from __future__ import annotations

import argparse
import io
import json
import random
import re
import tarfile
from pathlib import Path

import pytest
import webdataset as wds
from PIL import Image

from vlcontrast.data.shards import read_manifest, read_sizes
from vlcontrast.data.prep.synthetic import (COLORLESS_PHRASE_WEIGHT, COLORS, SHAPES, TEMPLATES,
                                       WORLD_VERSION, TrainMix, _TarStream, _object_phrase,
                                       make_sample, sample_scene, write_caption, write_synthetic)

TRAIN, VAL, SHARD, PER_CLASS = 600, 100, 250, 3


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("synthetic")
    stats = write_synthetic(out, train=TRAIN, val=VAL, zeroshot_per_class=PER_CLASS, seed=0,
                            shard_size=SHARD, workers=2, progress=False)
    return out, stats


def _samples(tar_path: Path) -> list[dict]:
    samples: dict[str, dict] = {}
    with tarfile.open(tar_path) as tar:
        for member in tar:
            key, ext = member.name.split(".", 1)
            samples.setdefault(key, {"__key__": key})[ext] = tar.extractfile(member).read()
    return list(samples.values())


def test_same_seed_same_bytes_whatever_the_workers(world, tmp_path):
    out, _ = world
    again = tmp_path / "again"
    write_synthetic(again, train=TRAIN, val=VAL, zeroshot_per_class=PER_CLASS, seed=0,
                    shard_size=SHARD, workers=1, progress=False)
    for split in ("train", "val"):
        names = sorted(p.name for p in (out / split).glob("*.tar"))
        assert names == sorted(p.name for p in (again / split).glob("*.tar"))
        for name in names:
            assert (out / split / name).read_bytes() == (again / split / name).read_bytes(), name
    for image in sorted((out / "zeroshot").rglob("*.jpg")):
        assert image.read_bytes() == (again / image.relative_to(out)).read_bytes()
    assert (out / "train" / "manifest.json").read_text() == (again / "train" / "manifest.json").read_text()


def test_different_seed_differs(world, tmp_path):
    out, _ = world
    other = tmp_path / "other"
    write_synthetic(other, train=50, val=0, zeroshot_per_class=0, seed=1, shard_size=SHARD,
                    workers=1, progress=False)
    ours = _samples(out / "train" / "00000.tar")[:50]
    theirs = _samples(other / "train" / "00000.tar")
    assert sum(a["txt"] != b["txt"] for a, b in zip(ours, theirs)) > 40
    assert all(a["jpg"] != b["jpg"] for a, b in zip(ours, theirs))


def test_shards_are_written_like_img2dataset(world):
    out, _ = world
    rows_seen = 0
    for shard, expected in enumerate((250, 250, 100)):
        samples = _samples(out / "train" / f"{shard:05d}.tar")
        assert len(samples) == expected
        for row, sample in enumerate(samples):
            key = sample["__key__"]
            assert re.fullmatch(r"\d{9}", key) and key == f"{shard:05d}{row:04d}"
            assert int(key) == shard * 10_000 + row
            meta = json.loads(sample["json"])
            assert meta["key"] == key and meta["caption"] == sample["txt"].decode()
            assert meta["status"] == "success" and meta["error_message"] is None
            assert meta["url"] == f"synthetic://train/{shard * SHARD + row}"
            assert (meta["width"], meta["height"]) == (64, 64)
            assert 1 <= len(meta["objects"]) <= 3 and meta["background"]
            assert Image.open(io.BytesIO(sample["jpg"])).size == (64, 64)
            rows_seen += 1
        stats = json.loads((out / "train" / f"{shard:05d}_stats.json").read_text())
        assert stats["successes"] == stats["count"] == expected
    assert rows_seen == TRAIN


def test_tar_bytes_match_webdataset_tarwriter():
    samples = []
    for index in range(7):
        jpeg, caption, _ = make_sample(0, "train", index)
        samples.append({"__key__": f"{index:09d}", "jpg": jpeg, "json": b"{}", "txt": caption.encode()})
    reference = io.BytesIO()
    writer = wds.TarWriter(reference, mtime=0)
    for sample in samples:
        writer.write(sample)
    writer.close()
    ours = io.BytesIO()
    stream = _TarStream(ours)
    for sample in samples:
        for ext in ("jpg", "json", "txt"):
            stream.add(f"{sample['__key__']}.{ext}", sample[ext])
    stream.close()
    assert ours.getvalue() == reference.getvalue()


def test_sizes_and_manifest(world):
    out, stats = world
    assert read_sizes(out / "train") == {"00000.tar": 250, "00001.tar": 250, "00002.tar": 100}
    manifest = read_manifest(out / "train")
    assert manifest["num_samples"] == TRAIN and manifest["num_shards"] == 3
    assert manifest["id_space"] == 30_000 and manifest["source"] == "synthetic"
    assert manifest["shards"] == read_sizes(out / "train")
    assert manifest["pattern"] == "{00000..00002}.tar"
    assert read_manifest(str(out / "train" / "{00000..00002}.tar")) == manifest
    val = read_manifest(out / "val")
    assert val["num_samples"] == VAL and val["id_space"] == 10_000
    assert stats["train"]["num_samples"] == TRAIN and stats["samples_per_second"] > 0
    assert stats["num_images"] == TRAIN + VAL + PER_CLASS * len(SHAPES)


def test_validation_split_is_not_training_data(world):
    out, _ = world
    train_images = {s["jpg"] for s in _samples(out / "train" / "00000.tar")}
    val_images = {s["jpg"] for s in _samples(out / "val" / "00000.tar")}
    assert not train_images & val_images


def test_plain_webdataset_reads_it(world):
    out, _ = world
    dataset = wds.WebDataset(str(out / "train" / "{00000..00002}.tar"), shardshuffle=False).decode("pil")
    count = 0
    for sample in dataset:
        assert sample["jpg"].size == (64, 64) and isinstance(sample["txt"], str)
        assert sample["json"]["key"] == sample["__key__"]
        count += 1
    assert count == TRAIN


def test_open_clip_training_loader_reads_it(world):
    open_clip = pytest.importorskip("open_clip")
    data = pytest.importorskip("open_clip_train.data")
    import torch
    from torchvision import transforms

    out, _ = world
    args = argparse.Namespace(
        train_data=str(out / "train" / "{00000..00002}.tar"), val_data=None,
        train_num_samples=None, dataset_resampled=False, train_data_upsampling_factors=None,
        seed=0, batch_size=50, workers=0, world_size=1)
    tokenizer = open_clip.get_tokenizer("RN50")
    info = data.get_wds_dataset(args, transforms.ToTensor(), is_train=True, epoch=0,
                                tokenizer=tokenizer)
    # open_clip read the sample count from sizes.json.
    assert info.dataloader.num_samples == TRAIN and info.dataloader.num_batches == TRAIN // 50
    batches = list(info.dataloader)
    assert len(batches) == TRAIN // 50
    images, texts = batches[0]
    assert images.shape == (50, 3, 64, 64) and texts.shape == (50, 77)
    assert texts.dtype == torch.long and (texts[:, 0] == texts[0, 0]).all()


def test_zeroshot_layout(world):
    out, stats = world
    root = out / "zeroshot"
    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert folders == sorted(SHAPES) and len(folders) >= 8
    classnames = (root / "classnames.txt").read_text().splitlines()
    assert classnames == folders  # ImageFolder's label i is classnames[i]
    for folder in folders:
        images = sorted((root / folder).glob("*.jpg"))
        assert len(images) == PER_CLASS
        assert Image.open(images[0]).size == (64, 64)
    templates = (root / "templates.txt").read_text().splitlines()
    assert templates == list(TEMPLATES) and all("{c}" in t for t in templates)
    assert stats["zeroshot"]["chance_top1"] == pytest.approx(1 / len(SHAPES))
    # The class names are words the training captions use.
    captions = " ".join(s["txt"].decode() for s in _samples(out / "train" / "00000.tar"))
    for name in classnames:
        assert re.search(rf"\b{name}", captions), name


def test_zeroshot_images_show_their_class():
    for index, shape in enumerate(SHAPES):
        _, caption, scene = make_sample(0, "zeroshot", index, shape=shape)
        assert [o["shape"] for o in scene["objects"]] == [shape]


def test_captions_follow_the_scene(world):
    out, stats = world
    samples = [s for p in sorted((out / "train").glob("*.tar")) for s in _samples(p)]
    synonyms = {"circle": ("circle", "disc"), "cross": ("cross", "plus sign"),
                "diamond": ("diamond", "rhomb"), "ring": ("ring", "donut"),
                "crescent": ("crescent",)}
    colors_said = 0
    for sample in samples:
        caption = sample["txt"].decode()
        meta = json.loads(sample["json"])
        for obj in meta["objects"]:
            words = synonyms.get(obj["shape"], (obj["shape"],))
            assert any(w in caption for w in words), (caption, obj)
        color_words = {"purple": ("purple", "violet")}.get(meta["objects"][0]["color"],
                                                            (meta["objects"][0]["color"],))
        colors_said += any(w in caption for w in color_words)
    # Most captions say the colour; a set share leaves it out so that the shape alone must match
    # (COLORLESS_PHRASE_WEIGHT; zero-shot prompts name no colour).
    assert 0.65 < colors_said / len(samples) < 0.9
    # Real variety: nearly every caption distinct, and one scene has many paraphrases.
    assert stats["train"]["distinct_captions"] > 0.9 * TRAIN
    scene = sample_scene(random.Random(5), num_objects=2)
    paraphrases = {write_caption(scene, random.Random(i)) for i in range(40)}
    assert len(paraphrases) >= 15
    orders = {p.index(scene.objects[0].shape) < p.index(scene.objects[1].shape)
              for p in paraphrases if scene.objects[0].shape in p and scene.objects[1].shape in p
              and scene.objects[0].shape != scene.objects[1].shape}
    assert orders == {True, False} or scene.objects[0].shape == scene.objects[1].shape


def test_colors_and_shapes_cover_the_world():
    assert len(SHAPES) >= 8 and len(COLORS) >= 8
    rng = random.Random(0)
    seen_shapes, seen_colors, counts = set(), set(), set()
    for _ in range(500):
        scene = sample_scene(rng)
        counts.add(len(scene.objects))
        for obj in scene.objects:
            seen_shapes.add(obj.shape)
            seen_colors.add(obj.color)
    assert seen_shapes == set(SHAPES) and seen_colors == set(COLORS) and counts == {1, 2, 3}


def test_rewrite_removes_stale_shards_and_rejects_bad_arguments(tmp_path):
    write_synthetic(tmp_path, train=30, val=0, zeroshot_per_class=0, shard_size=10, workers=1,
                    progress=False)
    write_synthetic(tmp_path, train=15, val=0, zeroshot_per_class=0, shard_size=10, workers=1,
                    progress=False)
    assert sorted(p.name for p in (tmp_path / "train").glob("*.tar")) == ["00000.tar", "00001.tar"]
    assert read_manifest(tmp_path / "train")["num_samples"] == 15
    with pytest.raises(ValueError, match="--shard-size=20000"):
        write_synthetic(tmp_path, train=10, shard_size=20_000, progress=False)


def test_a_set_share_of_object_phrases_leaves_the_colour_out():
    scene = sample_scene(random.Random(2), num_objects=1)
    obj = scene.objects[0]
    color_words = {"purple": ("purple", "violet")}.get(obj.color, (obj.color,))
    phrases = [_object_phrase(obj, random.Random(i)) for i in range(4000)]
    colorless = sum(not any(w in p for w in color_words) for p in phrases) / len(phrases)
    assert abs(colorless - COLORLESS_PHRASE_WEIGHT) < 0.03, colorless
    # Three-object captions always name colours (they would be too ambiguous otherwise).
    assert all(any(w in _object_phrase(obj, random.Random(i), allow_no_color=False)
                   for w in color_words) for i in range(300))


def test_the_world_version_is_recorded(world):
    out, stats = world
    assert stats["world_version"] == WORLD_VERSION
    assert json.loads((out / "synthetic.json").read_text())["world_version"] == WORLD_VERSION


def test_the_default_train_mix_is_the_world_itself():
    for index in range(40):
        assert make_sample(0, "train", index, 32) == make_sample(0, "train", index, 32, mix=TrainMix())


def test_a_train_mix_changes_only_the_training_split(tmp_path):
    mix = TrainMix(single_object=1.0, colorless=0.72)
    plain = write_synthetic(tmp_path / "plain", train=40, val=30, zeroshot_per_class=2,
                            shard_size=20, workers=1, progress=False)
    mixed = write_synthetic(tmp_path / "mixed", train=40, val=30, zeroshot_per_class=2,
                            shard_size=20, workers=1, progress=False, train_mix=mix)
    assert "train_mix" not in plain
    assert mixed["train_mix"] == {"single_object": 1.0, "colorless": 0.72, "bare": 0.1}
    assert json.loads((tmp_path / "mixed" / "synthetic.json").read_text())["train_mix"] == mixed["train_mix"]
    # Held-out splits: the same bytes whatever the training mix.
    for rel in ["val/00000.tar", "val/00001.tar", "zeroshot/star/star_00001.jpg"]:
        assert (tmp_path / "plain" / rel).read_bytes() == (tmp_path / "mixed" / rel).read_bytes(), rel
    train = [s for p in sorted((tmp_path / "mixed" / "train").glob("*.tar")) for s in _samples(p)]
    objects = [json.loads(s["json"])["objects"] for s in train]
    assert all(len(o) == 1 for o in objects)
    plain_train = [s for p in sorted((tmp_path / "plain" / "train").glob("*.tar")) for s in _samples(p)]
    assert any(len(json.loads(s["json"])["objects"]) > 1 for s in plain_train)
    # colorless = 0.72: every phrase of a one-object scene leaves the colour out or uses the
    # three rarer forms (28%), so most captions name no colour.
    said = sum(any(c in s["txt"].decode() for c in COLORS) for s in train)
    assert said / len(train) < 0.5


def test_a_train_mix_draws_its_shares():
    mix = TrainMix(single_object=0.9, colorless=0.5)
    assert sum(mix.object_weights()) == pytest.approx(1.0)
    rng = random.Random(0)
    counts = [len(sample_scene(rng, object_weights=mix.object_weights()).objects) for _ in range(3000)]
    assert abs(counts.count(1) / len(counts) - 0.9) < 0.025
    obj = sample_scene(random.Random(2), num_objects=1).objects[0]
    color_words = {"purple": ("purple", "violet")}.get(obj.color, (obj.color,))
    phrases = [_object_phrase(obj, random.Random(i), colorless=0.5) for i in range(4000)]
    assert abs(sum(not any(w in p for w in color_words) for p in phrases) / 4000 - 0.5) < 0.03


@pytest.mark.parametrize("kwargs, match", [({"single_object": 1.2}, "--single-object=1.2"),
                                           ({"colorless": 0.8}, "--colorless=0.8"),
                                           ({"colorless": -0.1}, "--colorless=-0.1")])
def test_a_bad_train_mix_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainMix(**kwargs)


def test_is_current_knows_the_world_on_disk(tmp_path, capsys):
    from vlcontrast.cli import main
    from vlcontrast.data.prep.synthetic import is_current

    mix = TrainMix(single_object=0.8)
    assert not is_current(tmp_path, train=20, val=10, zeroshot_per_class=1)
    write_synthetic(tmp_path, train=20, val=10, zeroshot_per_class=1, shard_size=10, workers=1,
                    progress=False, train_mix=mix)
    assert is_current(tmp_path, train=20, val=10, zeroshot_per_class=1, train_mix=mix)
    assert not is_current(tmp_path, train=20, val=10, zeroshot_per_class=1)  # another mix
    assert not is_current(tmp_path, train=30, val=10, zeroshot_per_class=1, train_mix=mix)
    assert not is_current(tmp_path, train=20, val=10, zeroshot_per_class=1, image_size=32, train_mix=mix)
    args = ["prep", "synthetic", "--out", str(tmp_path), "--train", "20", "--val", "10",
            "--zeroshot-per-class", "1", "--single-object", "0.8", "--shard-size", "10",
            "--workers", "1", "--no-progress", "--skip-if-current"]
    stamp = (tmp_path / "synthetic.json").stat().st_mtime_ns
    assert main(args) == 0
    assert "not rewritten" in capsys.readouterr().out
    assert (tmp_path / "synthetic.json").stat().st_mtime_ns == stamp
    args[args.index("0.8")] = "0.9"
    assert main(args) == 0
    assert json.loads((tmp_path / "synthetic.json").read_text())["train_mix"]["single_object"] == 0.9
    capsys.readouterr()
    assert main(args[:args.index("0.9")] + ["1.5"] + args[args.index("0.9") + 1:]) == 2
    assert "--single-object=1.5: must be in [0, 1]" in capsys.readouterr().err


def test_bare_captions_are_the_object_phrase_alone():
    mix = TrainMix(bare=1.0)
    weights = mix.single_frame_weights()
    assert weights[3] == 1.0 and sum(weights) == pytest.approx(1.0)
    assert sum(TrainMix(bare=0.4).single_frame_weights()) == pytest.approx(1.0)
    extra = ("left", "right", "top", "bottom", "center", "centre", "middle", "background",
             "backdrop", "there", "photo", "image", "picture", "drawing", "rendering")
    for index in range(200):
        _, caption, scene = make_sample(0, "train", index, 32, mix=TrainMix(single_object=1.0, bare=1.0))
        assert len(scene["objects"]) == 1
        assert caption.startswith(("a ", "an ")) and not any(w in caption for w in extra), caption


@pytest.mark.parametrize("args, line", [
    (["--train", "-5"], "prep synthetic: --train=-5: must be >= 1 (training samples)"),
    (["--image-size", "8"], "prep synthetic: --image-size=8: must be >= 16"),
    (["--bare", "2"], "prep synthetic: --bare=2.0: must be in [0, 1]"),
])
def test_bad_arguments_are_one_line_from_the_cli(args, line, tmp_path, capsys):
    from vlcontrast.cli import main

    assert main(["prep", "synthetic", "--out", str(tmp_path / "out"), "--no-progress",
                 *args]) == 2
    assert capsys.readouterr().err.strip() == f"vlcontrast: error: {line}"
    assert not (tmp_path / "out").exists()  # refused before anything was written
