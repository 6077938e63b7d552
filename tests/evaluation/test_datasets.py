import json

import pytest

from tests.evaluation.helpers import write_clip_benchmark_wds, write_image_folder, write_retrieval_shards
from vlcontrast.errors import ConfigError
from vlcontrast.evaluation.datasets import (ROW_BITS, TarEvalDataset, build_retrieval_loader,
                                            plan_reading, read_templates, resolve_shards,
                                            resolve_zeroshot_data, sample_captions, shard_sizes)


def captions_of(key, files):
    return sample_captions(files)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("world,workers", [(1, 1), (1, 3), (2, 1), (2, 2), (3, 2), (4, 1)])
def test_plan_covers_every_sample_exactly_once(num_shards, world, workers):
    rows_per_shard = [7, 3, 5, 1, 4, 6, 2, 9][:num_shards]
    seen = []
    for rank in range(world):
        for worker in range(workers):
            plan = plan_reading(num_shards, rank, world, worker, workers)
            counter = 0
            for shard in plan.shard_ids:
                for row in range(rows_per_shard[shard]):
                    if counter % plan.stride == plan.offset:
                        seen.append((shard, row))
                    counter += 1
    assert sorted(seen) == [(s, r) for s in range(num_shards) for r in range(rows_per_shard[s])]


def test_fewer_shards_than_ranks_splits_by_sample_index():
    plan = plan_reading(1, rank=1, world=2, worker=0, workers=1)
    assert plan.shard_ids == (0,) and plan.stride == 2 and plan.offset == 1


def test_captions_from_json_list_txt_lines_and_json_caption():
    assert sample_captions({"json": json.dumps({"captions": ["a", "b"]}).encode(),
                            "txt": b"ignored"}) == ["a", "b"]
    assert sample_captions({"txt": b"first\nsecond\n\n", "json": b'{"caption": "x"}'}) == \
        ["first", "second"]
    assert sample_captions({"json": b'{"caption": "only"}'}) == ["only"]
    assert sample_captions({"jpg": b""}) == []


@pytest.mark.parametrize("style", ["txt", "json"])
def test_reader_yields_all_samples_with_their_captions(tmp_path, style):
    captions = write_retrieval_shards(tmp_path, 11, per_shard=4, captions_per_image=lambda i: 1 + i % 3,
                                      style=style)
    seen = {}
    for rank in range(2):
        dataset = TarEvalDataset(resolve_shards(str(tmp_path)), captions_of, rank=rank,
                                 world_size=2)
        for key, texts in dataset:
            assert key not in seen
            seen[key] = texts
    ordered = [seen[k] for k in sorted(seen)]
    assert ordered == captions
    assert sorted(seen)[4] == (1 << ROW_BITS)  # shard 1, row 0


def test_shard_sizes_from_sizes_json_or_counted(tmp_path):
    write_retrieval_shards(tmp_path / "a", 10, per_shard=4)
    write_retrieval_shards(tmp_path / "b", 10, per_shard=4, sizes_json=False)
    (tmp_path / "a" / "sizes.json").write_text(json.dumps({"00000.tar": 4, "00001.tar": 4,
                                                            "00002.tar": 99}))
    assert shard_sizes(resolve_shards(str(tmp_path / "a"))) == [4, 4, 99]
    assert shard_sizes(resolve_shards(str(tmp_path / "b"))) == [4, 4, 2]


def test_max_samples_keeps_dataset_prefix_and_counts_batches(tmp_path, tiny):
    _, preprocess, _ = tiny
    write_retrieval_shards(tmp_path, 13, per_shard=5)
    keys = []
    for rank in range(2):
        loader = build_retrieval_loader(str(tmp_path), preprocess, batch_size=2, rank=rank,
                                        world_size=2, max_samples=7)
        batches = list(loader.loader)
        assert len(batches) == loader.num_batches
        keys += [k for batch in batches for k in batch[2].tolist()]
    assert sorted(keys) == [0, 1, 2, 3, 4, (1 << ROW_BITS), (1 << ROW_BITS) + 1]


@pytest.mark.parametrize("world,workers", [(1, 0), (1, 2), (2, 1)])
def test_batches_are_counted_from_sizes_json_without_max_samples(tmp_path, tiny, world, workers):
    """The progress total (and its ETA) of `eval retrieval` and `embed --images SHARDS`."""
    from vlcontrast.evaluation.datasets import build_image_shards_loader

    _, preprocess, _ = tiny
    write_retrieval_shards(tmp_path / "listed", 13, per_shard=5)
    for rank in range(world):
        loader = build_retrieval_loader(str(tmp_path / "listed"), preprocess, batch_size=2,
                                        rank=rank, world_size=world, workers=workers)
        assert loader.num_batches is not None
        assert len(list(loader.loader)) == loader.num_batches
    images = build_image_shards_loader(str(tmp_path / "listed"), preprocess, batch_size=2,
                                       workers=workers)
    assert images.num_batches is not None and len(list(images.loader)) == images.num_batches
    # Without sizes.json nothing is read to count: the total stays unknown.
    write_retrieval_shards(tmp_path / "unlisted", 6, per_shard=5, sizes_json=False)
    assert build_retrieval_loader(str(tmp_path / "unlisted"), preprocess,
                                  batch_size=2).num_batches is None


def test_broken_images_are_skipped_and_counted(tmp_path, tiny):
    _, preprocess, _ = tiny
    write_retrieval_shards(tmp_path, 6, per_shard=6, broken={2})
    loader = build_retrieval_loader(str(tmp_path), preprocess, batch_size=4)
    batches = list(loader.loader)
    assert sum(b[3] for b in batches) == 1
    assert sum(len(b[2]) for b in batches) == 5
    assert [b[3].reasons for b in batches if b[3]] == [{"undecodable_image": 1}]


def test_resolve_shards_forms(tmp_path):
    write_retrieval_shards(tmp_path, 9, per_shard=3)
    expected = [str(tmp_path / f"{i:05d}.tar") for i in range(3)]
    assert resolve_shards(str(tmp_path)) == expected
    assert resolve_shards(str(tmp_path / "{00000..00002}.tar")) == expected
    assert resolve_shards(",".join(expected[:2])) == expected[:2]
    with pytest.raises(FileNotFoundError):
        resolve_shards(str(tmp_path / "{00000..00005}.tar"))


def test_clip_benchmark_retrieval_layout_is_read(tmp_path):
    captions = write_clip_benchmark_wds(tmp_path, 5, 2, task="retrieval", captions_per_image=3)
    shards = resolve_shards(str(tmp_path))
    assert shards == [str(tmp_path / "test" / f"{i}.tar") for i in range(3)]
    dataset = TarEvalDataset(shards, captions_of)
    assert [texts for _, texts in dataset] == captions


def test_imagenet_val_dir_uses_open_clip_metadata(tmp_path):
    from open_clip import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES

    from vlcontrast.evaluation.datasets import imagenet_wnids

    wnids = imagenet_wnids()
    for wnid in wnids:  # every class holds an image (an empty class folder is refused)
        (tmp_path / wnid).mkdir()
        (tmp_path / wnid / "a.png").write_bytes(b"")
    write_image_folder(tmp_path, [wnids[3]], per_class=2)
    data = resolve_zeroshot_data(str(tmp_path))
    assert data.kind == "imagenet"
    assert data.classnames == list(IMAGENET_CLASSNAMES) and len(data.templates) == 80
    assert data.templates == list(OPENAI_IMAGENET_TEMPLATES)
    # Labels follow sorted WNIDs, like torchvision's ImageFolder.
    assert [label for _, label in data.samples][:6] == [0, 1, 2, 3, 3, 3]
    assert data.classnames_from == {"source": "imagenet", "table": "open_clip IMAGENET_CLASSNAMES"}


def test_image_folder_with_classnames_and_templates_files(tmp_path):
    write_image_folder(tmp_path / "data", ["b_dir", "a_dir"], per_class=2)
    (tmp_path / "names.txt").write_text("apple\nbanana\n")
    (tmp_path / "templates.txt").write_text("a photo of a {c}.\n{c} in the wild\n")
    data = resolve_zeroshot_data(str(tmp_path / "data"), str(tmp_path / "names.txt"),
                                 str(tmp_path / "templates.txt"))
    assert data.kind == "imagefolder" and data.classnames == ["apple", "banana"]
    assert data.templates == ["a photo of a {c}.", "{c} in the wild"]
    assert [label for _, label in data.samples] == [0, 0, 1, 1]
    assert "a_dir" in data.samples[0][0]
    default = resolve_zeroshot_data(str(tmp_path / "data"))
    assert default.classnames == ["a dir", "b dir"]
    (tmp_path / "three.txt").write_text("x\ny\nz\n")
    with pytest.raises(ConfigError, match="three.txt': 3 class names, but the data has 2 classes") as err:
        resolve_zeroshot_data(str(tmp_path / "data"), str(tmp_path / "three.txt"))
    assert "\n" not in str(err.value)
    (tmp_path / "bad.txt").write_text("a photo\n")
    with pytest.raises(ValueError, match="placeholder"):
        read_templates(tmp_path / "bad.txt")


def test_clip_benchmark_classification_layout(tmp_path):
    write_clip_benchmark_wds(tmp_path, 6, 4, task="classification", labels=[0, 1, 2, 0, 1, 2],
                             classnames=["cat", "dog", "car"], templates=["a {c}", "the {c}"])
    data = resolve_zeroshot_data(str(tmp_path))
    assert data.kind == "wds" and data.classnames == ["cat", "dog", "car"]
    assert data.templates == ["a {c}", "the {c}"] and len(data.shards) == 2
    (tmp_path / "mine.txt").write_text("kitten\npuppy\n")
    with pytest.raises(ConfigError, match=r"^--classnames '.*mine.txt': 2 class names, but the data has 3 "
                       r"classes \(classnames.txt of --data '.*'\)"):
        resolve_zeroshot_data(str(tmp_path), str(tmp_path / "mine.txt"))


def test_image_folder_reads_its_own_classnames_and_templates(tmp_path):
    write_image_folder(tmp_path, ["b_dir", "a_dir"], per_class=1)
    (tmp_path / "classnames.txt").write_text("apple\nbanana\n")
    (tmp_path / "templates.txt").write_text("a drawing of a {c}.\n")
    data = resolve_zeroshot_data(str(tmp_path))
    assert data.classnames == ["apple", "banana"]
    assert data.templates == ["a drawing of a {c}."]
    # Explicit files still win over the folder's own.
    (tmp_path / "other.txt").write_text("{c}!\n")
    assert resolve_zeroshot_data(str(tmp_path), templates=str(tmp_path / "other.txt")).templates == ["{c}!"]


def shard_sets(root, splits=("train", "val"), classnames=True):
    """prep folder --caption-from class --val-fraction's output: a shard set per split."""
    for split in splits:
        write_retrieval_shards(root / split, 2, per_shard=2)
        if classnames:
            (root / split / "classnames.txt").write_text("cat\ndog\n")
    return root


def test_zeroshot_data_of_shard_sets_names_the_one_to_give(tmp_path, capsys):
    from tests.inference.helpers import run_cli
    from vlcontrast.evaluation.datasets import ZeroShotDataError

    root = shard_sets(tmp_path / "classes")
    with pytest.raises(ZeroShotDataError) as err:
        resolve_zeroshot_data(str(root))
    assert str(err.value) == (f"--data {str(root)!r} holds shard sets in train/, val/, not class "
                              f"folders: give --data {str(root / 'val')!r}")
    with pytest.raises(ZeroShotDataError, match=r"^eval.zeroshot='.*classes' holds shard sets in "
                       r"train/, val/, not class folders: give eval.zeroshot='.*classes/val'$"):
        resolve_zeroshot_data(str(root), keys=("eval.zeroshot", "eval.classnames",
                                               "eval.templates"))
    # Refused before the model is loaded (the checkpoint does not exist).
    code, out, err = run_cli(capsys, "eval", "zeroshot", "--checkpoint", str(tmp_path / "no_run"),
                             "--data", str(root), "--device", "cpu")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err == f"vlcontrast: error: --data {str(root)!r} holds shard sets in train/, val/, " \
                  f"not class folders: give --data {str(root / 'val')!r}\n"


def test_retrieval_data_of_shard_sets_names_the_sub_folders(tmp_path, tiny_checkpoint, capsys,
                                                            monkeypatch):
    from tests.inference.helpers import run_cli
    from vlcontrast.evaluation import runner

    root = shard_sets(tmp_path / "mine", classnames=False)
    message = (f"directory {str(root)!r} holds no .tar shards (numbered 00000.tar ..., any *.tar, "
               "or CLIP_benchmark's test/nshards.txt); its sub-folders train/, val/ hold shard "
               f"sets: give one of them, e.g. {str(root / 'val')!r}")
    with pytest.raises(ConfigError) as err:
        resolve_shards(str(root))
    assert message in str(err.value) and "\n" not in str(err.value)
    # eval retrieval checks --data before the model is loaded.
    monkeypatch.setattr(runner, "_load", lambda *a: pytest.fail("the model was loaded"))
    code, out, err = run_cli(capsys, "eval", "retrieval", "--checkpoint", str(tiny_checkpoint),
                             "--data", str(root), "--device", "cpu")
    assert code == 2 and out == "" and err == f"vlcontrast: error: --data: {message}\n"


def test_hidden_folders_are_no_classes_and_empty_class_folders_are_refused(tmp_path, capsys):
    """``mkdir my_folder/.ipynb_checkpoints`` or an empty ``zebra/`` used to become an extra
    zero-shot class (6 instead of 5, every number changed), in eval and in training alike."""
    write_image_folder(tmp_path / "data", ["cat", "dog"], per_class=2)
    (tmp_path / "data" / ".ipynb_checkpoints").mkdir()
    (tmp_path / "data" / "cat" / ".ipynb_checkpoints").mkdir()
    (tmp_path / "data" / "cat" / ".ipynb_checkpoints" / "copy.png").write_bytes(b"")
    data = resolve_zeroshot_data(str(tmp_path / "data"))
    assert data.classnames == ["cat", "dog"] and len(data.samples) == 4
    (tmp_path / "data" / "zebra").mkdir()
    with pytest.raises(ConfigError) as err:
        resolve_zeroshot_data(str(tmp_path / "data"))
    assert str(err.value) == (
        f"--data {str(tmp_path / 'data')!r}: class folder 'zebra' holds no image (.bmp .jpeg "
        ".jpg .pgm .png .ppm .tif .tiff .webp); every sub-folder is a class: add images to it, "
        "or remove or rename it (hidden folders, named with a leading '.', are skipped)")
    (tmp_path / "data" / "yak").mkdir()
    with pytest.raises(ConfigError, match=r"^eval.zeroshot='.*': class folders 'yak', 'zebra' "
                                          r"hold no image"):
        resolve_zeroshot_data(str(tmp_path / "data"), keys=("eval.zeroshot", "eval.classnames",
                                                            "eval.templates"))
    # Refused before the model is loaded (the checkpoint does not exist).
    from tests.inference.helpers import run_cli

    code, out, err = run_cli(capsys, "eval", "zeroshot", "--checkpoint", str(tmp_path / "none"),
                             "--data", str(tmp_path / "data"), "--device", "cpu")
    assert code == 2 and out == "" and "class folders 'yak', 'zebra' hold no image" in err


def test_a_class_name_count_that_does_not_fit_names_the_folders(tmp_path):
    write_image_folder(tmp_path / "data", ["circle", "hollow_ring", "square"], per_class=1)
    (tmp_path / "names.txt").write_text("circle\nring\nsquare\nzebra\n")
    with pytest.raises(ConfigError) as err:
        resolve_zeroshot_data(str(tmp_path / "data"), str(tmp_path / "names.txt"))
    assert str(err.value) == (
        f"--classnames {str(tmp_path / 'names.txt')!r}: 4 class names, but the data has 3 classes "
        f"(the class folders of --data {str(tmp_path / 'data')!r}: circle, hollow_ring, square); "
        "give one name per class, in the classes' order")


def test_class_names_that_are_the_folders_in_another_order_are_refused(tmp_path):
    """The i-th name labels the i-th folder in sorted order: the folders' own names in another
    order can only mislabel them (the walkthrough's top-1 moved from 0.2692 to 0.2564)."""
    write_image_folder(tmp_path / "data", ["circle", "hollow_ring", "star", "triangle"],
                       per_class=1)
    names = tmp_path / "names.txt"
    names.write_text("circle\n\nhollow_ring\ntriangle\nstar\n")
    with pytest.raises(ConfigError) as err:
        resolve_zeroshot_data(str(tmp_path / "data"), str(names))
    assert str(err.value) == (
        f"--classnames {str(names)!r}: line 4 says 'triangle', but class folder 3 in sorted "
        "order is 'star': the names are the folders' own in another order, and the i-th name "
        "labels the i-th folder in sorted order; list them in that order, or leave --classnames "
        "out to use the folder names")
    names.write_text("hollow ring\ncircle\nstar\ntriangle\n")  # the names shown, _ as a space
    with pytest.raises(ConfigError, match="line 1 says 'hollow ring', but class folder 1 in "
                                          "sorted order is 'circle'"):
        resolve_zeroshot_data(str(tmp_path / "data"), str(names))
    (tmp_path / "data" / "classnames.txt").write_text("star\ncircle\nhollow_ring\ntriangle\n")
    with pytest.raises(ConfigError, match=r"^--data '.*': classnames.txt: line 1 says 'star'.*"
                                          r"sorted order; list them in that order$"):
        resolve_zeroshot_data(str(tmp_path / "data"))
    (tmp_path / "data" / "classnames.txt").unlink()
    # In sorted order, or names of the user's own, they label the folders as given.
    names.write_text("circle\nhollow_ring\nstar\ntriangle\n")
    assert resolve_zeroshot_data(str(tmp_path / "data"), str(names)).classnames == [
        "circle", "hollow_ring", "star", "triangle"]
    names.write_text("ring\ncircle\nstar\ntriangle\n")
    assert resolve_zeroshot_data(str(tmp_path / "data"), str(names)).classnames[0] == "ring"


def test_some_imagenet_wnid_folders_get_imagenet_names(tmp_path, caplog):
    """A subset of ImageNet's class folders used to get the WNIDs themselves as class names
    ("a photo of a n01440764.")."""
    from vlcontrast.evaluation.datasets import imagenet_wnids

    write_image_folder(tmp_path / "inet", ["n01440764", "n01443537", "n01484850"], per_class=1)
    data = resolve_zeroshot_data(str(tmp_path / "inet"))
    assert data.kind == "imagefolder"
    assert data.classnames == ["tench", "goldfish", "great white shark"]
    assert data.classnames_from == {"source": "imagenet",
                                    "table": "open_clip IMAGENET_CLASSNAMES"}
    assert data.templates_from == {"source": "default",
                                   "table": "open_clip OPENAI_IMAGENET_TEMPLATES"}
    # WordNet IDs that are no ImageNet-1k class stay the names, and a warning says so.
    write_image_folder(tmp_path / "other", ["n00000001", "n01440764"], per_class=1)
    with caplog.at_level("WARNING"):
        data = resolve_zeroshot_data(str(tmp_path / "other"))
    assert data.classnames == ["n00000001", "n01440764"]
    assert ("class folders n00000001, n01440764 are WordNet IDs, and the prompts use them as the "
            "class names ('a photo of a n00000001.'): ImageNet's names are used only when every "
            "folder is an ImageNet-1k class") in caplog.text
    assert "give --classnames FILE with one name per line" in caplog.text
    # The table is ImageNet-1k's: the sorted WNIDs of CLIP_benchmark's list.
    from clip_benchmark.datasets.builder import all_imagenet_wordnet_ids

    assert imagenet_wnids() == all_imagenet_wordnet_ids


def test_where_the_class_names_and_templates_came_from(tmp_path):
    write_image_folder(tmp_path / "data", ["a_dir", "b_dir"], per_class=1)
    root = tmp_path / "data"
    data = resolve_zeroshot_data(str(root))
    assert data.classnames_from == {"source": "folder names"}
    (root / "classnames.txt").write_text("apple\nbanana\n")
    (root / "templates.txt").write_text("a {c}\n")
    data = resolve_zeroshot_data(str(root))
    assert data.classnames_from == {"source": "data", "file": str(root / "classnames.txt")}
    assert data.templates_from == {"source": "data", "file": str(root / "templates.txt")}
    (tmp_path / "t.txt").write_text("the {c}\n")
    data = resolve_zeroshot_data(str(root), templates=str(tmp_path / "t.txt"),
                                 keys=("eval.zeroshot", "eval.classnames", "eval.templates"))
    assert data.templates_from == {"source": "eval.templates", "file": str(tmp_path / "t.txt")}
    write_clip_benchmark_wds(tmp_path / "wds", 2, 2, task="classification", labels=[0, 1],
                             classnames=["cat", "dog"], templates=["a {c}"])
    data = resolve_zeroshot_data(str(tmp_path / "wds"))
    assert data.classnames_from == {"source": "data",
                                    "file": str(tmp_path / "wds" / "classnames.txt")}
    assert data.templates_from == {
        "source": "data", "file": str(tmp_path / "wds" / "zeroshot_classification_templates.txt")}
