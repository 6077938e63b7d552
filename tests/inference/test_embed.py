"""``vlcontrast embed``: L2-normalised float32 embeddings of images (files, folders, shards) or
texts, written atomically as .npy + ids or as parquet."""

import importlib.util

import numpy as np
import pytest
import torch

from tests.evaluation.helpers import image_bytes, write_retrieval_shards
from tests.inference.helpers import (BROKEN, reference_image_features, reference_text_features,
                                     run_cli)
from vlcontrast.errors import ConfigError
from vlcontrast.inference import Embeddings, check_output, write_embeddings

HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None


def embed(capsys, run_dir, *args):
    code, out, err = run_cli(capsys, "embed", "--checkpoint", str(run_dir), "--workers", "0",
                             "--no-progress", "--batch-size", "2", *args)
    assert code == 0, err
    return out, err


def read_ids(path):
    return path.with_name(path.name + ".ids.txt").read_text(encoding="utf-8").splitlines()


def test_image_folder_to_npy_and_ids(trained, user_images, tmp_path, capsys):
    (model, preprocess, _), run_dir = trained
    folder, readable = user_images
    out, err = embed(capsys, run_dir, "--images", str(folder), "--out", str(tmp_path / "e.npy"))
    vectors = np.load(tmp_path / "e.npy")
    assert vectors.dtype == np.float32 and vectors.shape == (5, 32)
    assert read_ids(tmp_path / "e.npy") == [str(p) for p in readable]
    expected = reference_image_features(model, preprocess, readable).numpy()
    np.testing.assert_allclose(vectors, expected, atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-6)
    assert (f"vlcontrast embed: skipped 1 of 6 images (undecodable_image: 1): {folder / BROKEN}\n"
            == err) and "5 embeddings" in out
    assert BROKEN not in "".join(read_ids(tmp_path / "e.npy"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.npy", "e.npy.ids.txt"]


def test_texts_to_npy(trained, tmp_path, capsys):
    (model, _, tokenizer), run_dir = trained
    (tmp_path / "texts.txt").write_text("a red car\n\n  two dogs  \na house\n", encoding="utf-8")
    embed(capsys, run_dir, "--texts", str(tmp_path / "texts.txt"), "--out",
          str(tmp_path / "sub" / "t.npy"))
    texts = ["a red car", "two dogs", "a house"]
    assert read_ids(tmp_path / "sub" / "t.npy") == texts
    np.testing.assert_allclose(np.load(tmp_path / "sub" / "t.npy"),
                               reference_text_features(model, tokenizer, texts).numpy(),
                               atol=1e-6, rtol=0)


def test_shards_ids_are_sample_keys(trained, tmp_path, capsys):
    (model, preprocess, _), run_dir = trained
    write_retrieval_shards(tmp_path / "shards", 5, per_shard=3, broken={1})
    embed(capsys, run_dir, "--images", str(tmp_path / "shards"), "--out", str(tmp_path / "s.npy"))
    assert read_ids(tmp_path / "s.npy") == ["000000000", "000000002", "000010000", "000010001"]
    for index in (0, 2, 3, 4):
        (tmp_path / f"{index}.jpg").write_bytes(image_bytes(index))
    expected = reference_image_features(model, preprocess,
                                        [tmp_path / f"{i}.jpg" for i in (0, 2, 3, 4)])
    np.testing.assert_allclose(np.load(tmp_path / "s.npy"), expected.numpy(), atol=1e-6, rtol=0)
    # A brace pattern names the same shards.
    embed(capsys, run_dir, "--images", str(tmp_path / "shards" / "{00000..00001}.tar"), "--out",
          str(tmp_path / "b.npy"))
    np.testing.assert_array_equal(np.load(tmp_path / "b.npy"), np.load(tmp_path / "s.npy"))


@pytest.mark.skipif(not HAS_PYARROW, reason="pyarrow is not installed")
def test_parquet_holds_the_same_embeddings(trained, user_images, tmp_path, capsys):
    import pyarrow.parquet as pq

    run_dir = trained[1]
    embed(capsys, run_dir, "--images", str(user_images[0]), "--out", str(tmp_path / "e.npy"))
    embed(capsys, run_dir, "--images", str(user_images[0]), "--out", str(tmp_path / "e.parquet"))
    table = pq.read_table(tmp_path / "e.parquet")
    assert table.column_names == ["id", "embedding"]
    assert table.column("id").to_pylist() == read_ids(tmp_path / "e.npy")
    vectors = np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    np.testing.assert_array_equal(vectors, np.load(tmp_path / "e.npy"))
    assert not (tmp_path / "e.parquet.ids.txt").exists()


def test_parquet_without_pyarrow_names_the_install(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pyarrow" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install pyarrow") as err:
        check_output(tmp_path / "x.parquet")
    assert "\n" not in str(err.value)


def test_bad_output_and_sources_are_one_line_errors_before_the_model(tmp_path, capsys):
    no_run = str(tmp_path / "no_run")
    (tmp_path / "empty.txt").write_text("\n\n")
    cases = [
        (["--texts", "t.txt", "--out", str(tmp_path / "x.csv")], "unknown format '.csv'"),
        (["--texts", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x.npy")],
         "no such file"),
        (["--texts", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "x.npy")], "no texts"),
        (["--images", str(tmp_path / "shards-{0..3}.tar"), "--out", str(tmp_path / "x.npy")],
         "shards-"),
        (["--images", str(tmp_path / "nothere"), "--out", str(tmp_path / "x.npy")],
         f"--images: {str(tmp_path / 'nothere')!r} does not exist; name image files, folders "
         "holding them or webdataset shards"),
        (["--texts", str(tmp_path), "--out", str(tmp_path / "x.npy")],
         f"--texts {str(tmp_path)!r}: a folder, not a file; name a file with one text per line, "
         f"e.g. --texts {str(tmp_path / 'empty.txt')!r}"),
        (["--texts", "t.txt", "--out", str(tmp_path / "x.npy"), "--batch-size", "0"],
         "--batch-size 0: must be >= 1 (e.g. --batch-size 64)"),
        (["--images", str(tmp_path), "--out", str(tmp_path / "x.npy"), "--workers", "-1"],
         "--workers -1: must be >= 0 (0 reads the data in the main process)"),
    ]
    for args, message in cases:
        code, _, err = run_cli(capsys, "embed", "--checkpoint", no_run, *args)
        assert code == 2 and err.count("\n") == 1 and message in err, (args, err)
    assert list(tmp_path.glob("x.*")) == []


def test_writes_are_atomic(tmp_path, monkeypatch):
    out = tmp_path / "e.npy"
    first = Embeddings(np.eye(2, dtype=np.float32), ["a", "b"])
    write_embeddings(first, out)

    def broken_save(handle, array):
        handle.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(np, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        write_embeddings(Embeddings(np.ones((3, 2), np.float32), ["x", "y", "z"]), out,
                         overwrite=True)
    np.testing.assert_array_equal(np.load(out), np.eye(2))  # the earlier file, whole
    assert read_ids(out) == ["a", "b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.npy", "e.npy.ids.txt"]


def test_embeddings_are_unit_float32_whatever_the_model_dtype(trained, user_images):
    import copy

    from vlcontrast.inference import embed_images

    (model, preprocess, _), _ = trained
    result = embed_images(copy.deepcopy(model).to(torch.float64), preprocess,
                          paths=user_images[1][:2], batch_size=1, progress=False)
    assert result.vectors.dtype == np.float32 and result.ids == [str(p) for p in user_images[1][:2]]
    np.testing.assert_allclose(np.linalg.norm(result.vectors, axis=1), 1, atol=1e-6)


def test_shard_progress_has_a_total_from_sizes_json(trained, tmp_path, capsys):
    write_retrieval_shards(tmp_path / "shards", 5, per_shard=3)
    code, out, err = run_cli(capsys, "embed", "--checkpoint", str(trained[1]), "--workers", "0",
                             "--batch-size", "2", "--images", str(tmp_path / "shards"), "--out",
                             str(tmp_path / "s.npy"))
    assert code == 0, err
    # 3 + 2 samples in batches of 2: 2 + 1 batches, as sizes.json tells before any is read.
    assert "embed images 3/3 (100%)" in err and "ETA" in err


def test_images_and_shards_in_one_call_is_refused_naming_each(user_images, tmp_path, capsys):
    write_retrieval_shards(tmp_path / "shards", 3, per_shard=2)
    folder = str(user_images[0])
    code, out, err = run_cli(capsys, "embed", "--checkpoint", str(tmp_path / "no_run"), "--images",
                             folder, str(tmp_path / "shards"), "--out", str(tmp_path / "e.npy"))
    assert code == 2 and out == "" and err == (
        "vlcontrast: error: --images: one call embeds image files and folders or webdataset "
        f"shards, not both: images {folder!r}, shards {str(tmp_path / 'shards')!r}; embed each "
        "in a call of its own\n")
    assert not list(tmp_path.glob("e.*"))


def test_shard_rows_are_in_shard_order_whatever_the_workers(trained, tmp_path, capsys):
    # 3 shards of 3, 3, 1 samples: 2 workers read whole shards; one shard: every other sample.
    write_retrieval_shards(tmp_path / "shards", 7, per_shard=3)
    write_retrieval_shards(tmp_path / "one", 5, per_shard=5)
    for name, expected in (("shards", ["000000000", "000000001", "000000002", "000010000",
                                       "000010001", "000010002", "000020000"]),
                           ("one", [f"{row:09d}" for row in range(5)])):
        outs = {}
        for workers in ("0", "2"):
            outs[workers] = tmp_path / f"{name}{workers}.npy"
            code, _, err = run_cli(capsys, "embed", "--checkpoint", str(trained[1]),
                                   "--no-progress", "--batch-size", "2", "--workers", workers,
                                   "--images", str(tmp_path / name), "--out", str(outs[workers]))
            assert code == 0, err
        assert read_ids(outs["0"]) == expected and read_ids(outs["2"]) == expected
        np.testing.assert_allclose(np.load(outs["2"]), np.load(outs["0"]), atol=1e-6, rtol=0)
