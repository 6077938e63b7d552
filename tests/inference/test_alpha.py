"""``classify`` and ``embed`` with ``--alpha white|drop``: the count of transparent images is
printed and recorded, ``drop`` gives what open_clip's own calls on ``convert("RGB")`` give, and
only the transparent images change."""

import io
import json

import numpy as np
import torch
from PIL import Image

from tests.evaluation.helpers import image_bytes
from tests.inference.helpers import reference_image_features, run_cli


def _transparent_png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    colour = rng.integers(0, 256, (36, 36, 3), dtype=np.uint8)
    alpha = np.where(rng.random((36, 36)) < 0.6, 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(np.dstack([colour, alpha]), "RGBA").save(buffer, format="PNG")
    return buffer.getvalue()


def _folder(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a_opaque.jpg").write_bytes(image_bytes(1))
    (folder / "b_clear.png").write_bytes(_transparent_png(1))
    (folder / "c_opaque.png").write_bytes(image_bytes(2, "PNG"))
    (folder / "d_clear.png").write_bytes(_transparent_png(2))
    return folder, sorted(folder.iterdir())


def test_classify_reports_transparency_and_the_rule(trained, tmp_path, capsys):
    _, run = trained
    folder, _ = _folder(tmp_path)
    for alpha in ("white", "drop"):
        code, out, err = run_cli(capsys, "classify", str(folder), "--checkpoint", str(run),
                                 "--labels", "cat,dog,car", "--json", "--workers", "0",
                                 "--device", "cpu", "--no-progress", "--alpha", alpha)
        assert code == 0
        result = json.loads(out)
        assert result["alpha"] == alpha and result["num_transparent"] == 2
        assert f"2 of 4 images had transparency; --alpha {alpha}" in err


def test_embed_drop_is_open_clips_reading_and_changes_only_transparent_images(trained, tmp_path,
                                                                              capsys):
    (model, preprocess, _), run = trained
    folder, paths = _folder(tmp_path)
    vectors = {}
    for alpha in ("white", "drop"):
        out = tmp_path / f"{alpha}.npy"
        code, _, err = run_cli(capsys, "embed", "--checkpoint", str(run), "--images", str(folder),
                               "--out", str(out), "--workers", "0", "--device", "cpu",
                               "--no-progress", "--alpha", alpha)
        assert code == 0 and "2 of 4 images had transparency" in err
        vectors[alpha] = torch.from_numpy(np.load(out))
    # drop: the image decoded and convert("RGB"), then open_clip's evaluation transform
    expected = reference_image_features(model, preprocess, paths)
    torch.testing.assert_close(vectors["drop"], expected, atol=1e-6, rtol=0)
    changed = [not torch.allclose(vectors["white"][i], vectors["drop"][i], atol=1e-6)
               for i in range(len(paths))]
    assert changed == [False, True, False, True]
