"""``vlcontrast embed --out``: files of an earlier embed are refused in one line before the model
is loaded (what they hold, and the fix); ``--overwrite`` replaces them, and only them, atomically."""

import errno
import importlib.util

import numpy as np
import pytest

from tests.inference.helpers import run_cli
from vlcontrast.inference import Embeddings, write_embeddings

HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None


@pytest.fixture
def no_model(monkeypatch):
    """Loading the model fails the test: a refusal must come before it."""
    import vlcontrast.inference.model as model

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(model, "load_bundle", refuse)


def earlier(out):
    """An earlier embed's files at ``out``: 2 embeddings of dimension 4, and their bytes."""
    write_embeddings(Embeddings(np.eye(2, 4, dtype=np.float32), ["a", "b"]), out)
    return snapshot(out.parent)


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def embed(capsys, run_dir, *args):
    return run_cli(capsys, "embed", "--checkpoint", str(run_dir), "--workers", "0",
                   "--no-progress", *args)


def test_an_existing_npy_is_refused_before_the_inputs_and_the_model(tmp_path, capsys, no_model):
    out = tmp_path / "out" / "e.npy"
    out.parent.mkdir()
    before = earlier(out)
    # --texts names no file: the output is checked before any input is read
    code, _, err = embed(capsys, tmp_path / "no_run", "--texts", str(tmp_path / "missing.txt"),
                         "--out", str(out))
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"vlcontrast: error: --out {str(out)!r} exists (2 embeddings of "
                          f"dimension 4, ids in {str(out) + '.ids.txt'!r}, made 20")
    assert err.rstrip().endswith("); add --overwrite to replace them, or name a new file")
    assert snapshot(out.parent) == before


def test_an_ids_file_without_its_npy_is_refused_too(tmp_path, capsys, no_model):
    out = tmp_path / "e.npy"
    (tmp_path / "e.npy.ids.txt").write_text("a\nb\n")
    code, _, err = embed(capsys, tmp_path / "no_run", "--texts", "t.txt", "--out", str(out))
    assert code == 2 and err.count("\n") == 1, err
    assert (f"--out {str(out)!r}: its ids file {str(out) + '.ids.txt'!r} exists (ids, made "
            in err) and "add --overwrite to replace it, or name a new file" in err
    assert (tmp_path / "e.npy.ids.txt").read_text() == "a\nb\n" and not out.exists()


def test_overwrite_replaces_an_earlier_embed(trained, tmp_path, capsys):
    out = tmp_path / "e.npy"
    earlier(out)
    (tmp_path / "texts.txt").write_text("a red car\ntwo dogs\na house\n")
    code, stdout, err = embed(capsys, trained[1], "--texts", str(tmp_path / "texts.txt"),
                              "--out", str(out), "--overwrite")
    assert code == 0, err
    assert np.load(out).shape == (3, 32) and "3 embeddings" in stdout
    assert (tmp_path / "e.npy.ids.txt").read_text().splitlines() == ["a red car", "two dogs",
                                                                      "a house"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.npy", "e.npy.ids.txt", "texts.txt"]


@pytest.mark.parametrize("what, write, said", [
    ("a text file", lambda p: p.write_text("my notes\n"), "not a NumPy .npy file"),
    ("another array", lambda p: np.save(p, np.arange(6).reshape(1, 2, 3)), "a 1 x 2 x 3 int64 array"),
])
def test_a_file_embed_did_not_write_is_refused_even_with_overwrite(tmp_path, capsys, no_model,
                                                                   what, write, said):
    out = tmp_path / "e.npy"
    write(out)
    before = snapshot(tmp_path)
    code, _, err = embed(capsys, tmp_path / "no_run", "--texts", "t.txt", "--out", str(out),
                         "--overwrite")
    assert code == 2 and err.count("\n") == 1, (what, err)
    assert f"--out {str(out)!r} exists and is not a file vlcontrast embed writes ({said}" in err
    assert "so --overwrite will not replace it; name a new file" in err
    assert "add --overwrite" not in err
    assert snapshot(tmp_path) == before


def test_a_binary_ids_file_is_refused_even_with_overwrite(tmp_path, capsys, no_model):
    out = tmp_path / "e.npy"
    earlier(out)
    (tmp_path / "e.npy.ids.txt").write_bytes(b"\x00\xff\x00 model weights?")
    before = snapshot(tmp_path)
    code, _, err = embed(capsys, tmp_path / "no_run", "--texts", "t.txt", "--out", str(out),
                         "--overwrite")
    assert code == 2 and "is not a file vlcontrast embed writes" in err
    assert f"binary data in {str(out) + '.ids.txt'!r}" in err
    assert snapshot(tmp_path) == before


def test_an_interrupted_overwrite_leaves_the_earlier_files_whole(trained, tmp_path, capsys,
                                                                 monkeypatch):
    out = tmp_path / "e.npy"
    before = earlier(out)
    (tmp_path / "texts.txt").write_text("a red car\ntwo dogs\n")
    before["texts.txt"] = (tmp_path / "texts.txt").read_bytes()

    def disk_fills(handle, array):
        handle.write(b"\x93NUMPY half")
        raise OSError(errno.ENOSPC, "No space left on device", handle.name)

    monkeypatch.setattr(np, "save", disk_fills)
    code, _, err = embed(capsys, trained[1], "--texts", str(tmp_path / "texts.txt"), "--out",
                         str(out), "--overwrite")
    assert code == 1 and "No space left on device" in err
    assert snapshot(tmp_path) == before  # the earlier files, whole; no temporary left


def test_write_embeddings_refuses_unless_overwrite(tmp_path):
    from vlcontrast.errors import ConfigError

    out = tmp_path / "e.npy"
    before = earlier(out)
    with pytest.raises(ConfigError, match=r"^out='.*' exists .*add overwrite=True to replace"):
        write_embeddings(Embeddings(np.ones((1, 4), np.float32), ["x"]), out)
    assert snapshot(tmp_path) == before
    write_embeddings(Embeddings(np.ones((1, 4), np.float32), ["x"]), out, overwrite=True)
    assert np.load(out).shape == (1, 4)


@pytest.mark.skipif(not HAS_PYARROW, reason="pyarrow is not installed")
def test_parquet_is_described_and_another_table_is_refused(tmp_path, capsys, no_model):
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path / "e.parquet"
    write_embeddings(Embeddings(np.eye(3, 8, dtype=np.float32), ["a", "b", "c"]), out)
    code, _, err = embed(capsys, tmp_path / "no_run", "--texts", "t.txt", "--out", str(out))
    assert code == 2 and f"--out {str(out)!r} exists (3 embeddings of dimension 8, made " in err
    assert "add --overwrite to replace it" in err
    pq.write_table(pa.table({"name": ["x"], "price": [1.0]}), out)
    code, _, err = embed(capsys, tmp_path / "no_run", "--texts", "t.txt", "--out", str(out),
                         "--overwrite")
    assert code == 2 and "is not a file vlcontrast embed writes (a parquet table of columns " \
        "name, price" in err


def test_an_out_written_by_something_else_while_embedding_keeps_both(trained, tmp_path, capsys,
                                                                    monkeypatch):
    """``--out`` was free at the start and taken while the texts were embedded: the other
    writer's files stay as they are and this embed's results go to ``e.1.npy`` (they used to be
    refused at the end, losing the work)."""
    import vlcontrast.inference as inference

    out = tmp_path / "e.npy"
    (tmp_path / "texts.txt").write_text("a red car\ntwo dogs\n")
    real = inference.embed_texts

    def meanwhile(*args, **kwargs):
        result = real(*args, **kwargs)
        earlier(out)  # another job writes --out while this one works
        return result

    monkeypatch.setattr(inference, "embed_texts", meanwhile)
    code, stdout, err = embed(capsys, trained[1], "--texts", str(tmp_path / "texts.txt"),
                              "--out", str(out))
    assert code == 0, err
    assert f"its files are kept and these results go to {str(tmp_path / 'e.1.npy')!r}" in err
    assert np.load(out).shape == (2, 4) and np.load(tmp_path / "e.1.npy").shape == (2, 32)
    assert (tmp_path / "e.1.npy.ids.txt").read_text().splitlines() == ["a red car", "two dogs"]
    assert "e.1.npy" in stdout


def test_free_name_skips_names_whose_ids_file_exists(tmp_path):
    from vlcontrast.inference.embed import free_name

    (tmp_path / "e.npy.ids.txt").write_text("x\n")
    (tmp_path / "e.1.npy").write_bytes(b"")
    assert free_name(tmp_path / "e.npy") == tmp_path / "e.2.npy"
    assert free_name(tmp_path / "f.parquet") == tmp_path / "f.parquet"
