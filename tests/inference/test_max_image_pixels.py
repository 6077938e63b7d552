"""``--max-image-pixels`` of classify and embed: images over the limit are skipped as
``decompression_bomb`` with a hint naming the option and its value, and read once it is raised."""

import io
import json
import tarfile

import numpy as np
import pytest

from tests.evaluation.helpers import image_bytes
from tests.inference.helpers import run_cli

HINT = "; raise --max-image-pixels (now {limit:,}) if you trust these files"


@pytest.fixture
def sized_images(tmp_path):
    """small.png (8 x 8 = 64 pixels) and big.png (16 x 16 = 256 pixels)."""
    folder = tmp_path / "drawings"
    folder.mkdir()
    (folder / "big.png").write_bytes(image_bytes(1, "PNG", size=16))
    (folder / "small.png").write_bytes(image_bytes(2, "PNG", size=8))
    return folder


def write_sized_shard(path, sizes):
    """One shard: a PNG of ``size x size`` pixels and a caption per sample, keys 000000000..."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as archive:
        for index, size in enumerate(sizes):
            for ext, data in (("png", image_bytes(index, "PNG", size=size)),
                              ("txt", f"caption {index}".encode())):
                info = tarfile.TarInfo(f"{index:09d}.{ext}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))


def test_classify_skips_images_over_the_limit_with_a_hint_and_keeps_them_raised(
        trained, sized_images, capsys):
    args = ["classify", "--checkpoint", str(trained[1]), "--labels", "cat,dog", "--json",
            "--workers", "0", "--no-progress", str(sized_images)]
    code, out, err = run_cli(capsys, *args, "--max-image-pixels", "100")
    assert code == 0, err
    result = json.loads(out)
    assert result["skipped"] == [str(sized_images / "big.png")]
    assert result["skipped_reasons"] == {"decompression_bomb": 1}
    assert (f"vlcontrast classify: skipped 1 of 2 images (decompression_bomb: 1): "
            f"{sized_images / 'big.png'}{HINT.format(limit=100)}\n") in err

    code, out, err = run_cli(capsys, *args, "--max-image-pixels", "256")
    assert code == 0, err
    assert json.loads(out)["num_images"] == 2 and "skipped" not in err


def test_classify_default_limit_reads_both_and_an_unreadable_file_gets_no_hint(
        trained, sized_images, capsys):
    (sized_images / "broken.png").write_bytes(b"not a png")
    code, _, err = run_cli(capsys, "classify", "--checkpoint", str(trained[1]), "--labels",
                           "cat,dog", "--workers", "0", "--no-progress", str(sized_images))
    assert code == 0, err
    assert "skipped 1 of 3 images (undecodable_image: 1)" in err
    assert "--max-image-pixels" not in err


def test_embed_image_files_skip_over_the_limit_with_a_hint(trained, sized_images, tmp_path,
                                                           capsys):
    out = tmp_path / "emb.npy"
    args = ["embed", "--checkpoint", str(trained[1]), "--images", str(sized_images), "--out",
            str(out), "--workers", "0", "--no-progress", "--overwrite"]
    code, _, err = run_cli(capsys, *args, "--max-image-pixels", "100")
    assert code == 0, err
    assert (f"vlcontrast embed: skipped 1 of 2 images (decompression_bomb: 1): "
            f"{sized_images / 'big.png'}{HINT.format(limit=100)}\n") in err
    assert np.load(out).shape[0] == 1

    code, _, err = run_cli(capsys, *args, "--max-image-pixels", "256")
    assert code == 0 and "skipped" not in err, err
    assert np.load(out).shape[0] == 2


def test_embed_shards_skip_over_the_limit_with_a_hint(trained, tmp_path, capsys):
    write_sized_shard(tmp_path / "shards" / "00000.tar", [8, 16, 8])
    out = tmp_path / "emb.npy"
    args = ["embed", "--checkpoint", str(trained[1]), "--images", str(tmp_path / "shards"),
            "--out", str(out), "--workers", "0", "--no-progress", "--overwrite"]
    code, _, err = run_cli(capsys, *args, "--max-image-pixels", "100")
    assert code == 0, err
    assert (f"vlcontrast embed: skipped 1 of 3 samples (decompression_bomb: 1)"
            f"{HINT.format(limit=100)}\n") in err
    assert (tmp_path / "emb.npy.ids.txt").read_text().split() == ["000000000", "000000002"]

    code, _, err = run_cli(capsys, *args, "--max-image-pixels", "256")
    assert code == 0 and "skipped" not in err, err
    assert np.load(out).shape[0] == 3


def test_every_image_over_the_limit_names_the_option_in_the_error(trained, sized_images,
                                                                  tmp_path, capsys):
    code, _, err = run_cli(capsys, "embed", "--checkpoint", str(trained[1]), "--images",
                           str(sized_images), "--out", str(tmp_path / "e.npy"), "--workers", "0",
                           "--no-progress", "--max-image-pixels", "10")
    assert code != 0 and len(err.strip().splitlines()) == 1, err
    assert "none of the 2 images could be read" in err and HINT.format(limit=10) in err


@pytest.mark.parametrize("command", ["classify", "embed"])
def test_a_limit_below_one_is_a_one_line_error_before_the_model(command, sized_images, tmp_path,
                                                                 capsys):
    args = (["classify", "--labels", "cat,dog", str(sized_images)] if command == "classify" else
            ["embed", "--images", str(sized_images), "--out", str(tmp_path / "e.npy")])
    code, _, err = run_cli(capsys, *args, "--checkpoint", str(tmp_path / "no_run"),
                           "--max-image-pixels", "0")
    assert code != 0 and len(err.strip().splitlines()) == 1, err
    assert "--max-image-pixels 0: must be >= 1" in err
