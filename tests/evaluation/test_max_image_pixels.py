"""``vlcontrast eval zeroshot|retrieval --max-image-pixels``: images over the limit are skipped as
``decompression_bomb`` with a hint naming the option and its value, and read once it is
raised."""

import re

from tests.evaluation.helpers import image_bytes
from tests.inference.helpers import run_cli
from tests.inference.test_max_image_pixels import HINT, write_sized_shard

COMMON = ["--workers", "0", "--device", "cpu", "--no-progress", "--batch-size", "2"]


def test_eval_zeroshot_skips_images_over_the_limit_with_a_hint(tmp_path, tiny_checkpoint, capsys):
    for label, name, size in (("cat", "a.png", 8), ("cat", "big.png", 16), ("dog", "b.png", 8)):
        (tmp_path / "classes" / label).mkdir(parents=True, exist_ok=True)
        (tmp_path / "classes" / label / name).write_bytes(image_bytes(len(name) + size, "PNG",
                                                                      size=size))
    args = ["eval", "zeroshot", "--checkpoint", str(tiny_checkpoint), "--data",
            str(tmp_path / "classes"), *COMMON]
    skipped_at_100_kept_at_256(capsys, args, (
        f"vlcontrast eval zeroshot: skipped 1 of 3 images (decompression_bomb: 1): "
        f"{tmp_path / 'classes' / 'cat' / 'big.png'}{HINT.format(limit=100)}\n"))


def test_eval_retrieval_counts_skipped_samples_with_a_hint(tmp_path, tiny_checkpoint, capsys):
    write_sized_shard(tmp_path / "shards" / "00000.tar", [8, 16, 8, 8])
    args = ["eval", "retrieval", "--checkpoint", str(tiny_checkpoint), "--data",
            str(tmp_path / "shards"), *COMMON]
    skipped_at_100_kept_at_256(capsys, args, (
        f"vlcontrast eval retrieval: skipped 1 of 4 samples (decompression_bomb: 1)"
        f"{HINT.format(limit=100)}\n"))


def skipped_at_100_kept_at_256(capsys, args, line: str) -> None:
    """The 16x16 image is skipped under a 100-pixel limit, with ``line`` on stderr, and kept under
    256."""
    code, out, err = run_cli(capsys, *args, "--max-image-pixels", "100")
    assert code == 0 and re.search(r"num_skipped +1\n", out), err
    assert line in err
    code, out, err = run_cli(capsys, *args, "--max-image-pixels", "256")
    assert code == 0 and re.search(r"num_skipped +0\n", out) and "skipped" not in err, err


def test_eval_a_limit_below_one_is_a_one_line_error(tmp_path, capsys):
    code, _, err = run_cli(capsys, "eval", "zeroshot", "--checkpoint", str(tmp_path / "c"),
                           "--data", str(tmp_path), "--max-image-pixels", "0")
    assert code != 0 and len(err.strip().splitlines()) == 1, err
    assert "--max-image-pixels 0: must be >= 1" in err
