"""``vlcontrast.load``: a run directory, a checkpoint directory and an export give the same model,
used with open_clip's calling conventions."""

import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import vlcontrast
from tests.inference.helpers import reference_image_features, reference_text_features
from vlcontrast.errors import DeviceError
from vlcontrast.inference import resolve_device
from vlcontrast.models import RANDOM_INIT_WARNING

TEXTS = ["a red car", "two dogs on a boat", "a house"]
ROOT = Path(__file__).resolve().parents[2]


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()


def test_run_checkpoint_and_export_give_identical_embeddings(trained, exported, user_images):
    (original, preprocess, tokenizer), run_dir = trained
    paths = user_images[1]
    expected_images = reference_image_features(original, preprocess, paths)
    expected_texts = reference_text_features(original, tokenizer, TEXTS)
    for source in (run_dir, checkpoint_dir(run_dir), exported):
        model, loaded_preprocess, loaded_tokenizer = vlcontrast.load(source, device="cpu")
        images = reference_image_features(model, loaded_preprocess, paths)
        texts = reference_text_features(model, loaded_tokenizer, TEXTS)
        torch.testing.assert_close(images, expected_images, atol=1e-6, rtol=0)
        torch.testing.assert_close(texts, expected_texts, atol=1e-6, rtol=0)
        torch.testing.assert_close(model.logit_scale, original.logit_scale)


def test_open_clip_conventions(trained, user_images):
    model, preprocess, tokenizer = vlcontrast.load(trained[1], device="cpu")
    assert not model.training
    assert model.logit_scale.shape == () and float(model.logit_scale.detach()) == pytest.approx(
        math.log(1 / 0.07), rel=1e-6)
    from PIL import Image

    images = torch.stack([preprocess(Image.open(p).convert("RGB")) for p in user_images[1][:2]])
    tokens = tokenizer(TEXTS)
    assert tokens.shape == (3, 16)
    with torch.no_grad():
        image_features = model.encode_image(images)
        text_features = model.encode_text(tokens)
        assert image_features.shape == (2, 32) and text_features.shape == (3, 32)
        # Normalising is the caller's, as in open_clip: the raw features are not unit vectors.
        assert not torch.allclose(image_features.norm(dim=-1), torch.ones(2), atol=1e-3)
        normalized = model.encode_image(images, normalize=True)
        torch.testing.assert_close(normalized, F.normalize(image_features, dim=-1))
        # model(images, texts) is open_clip's default tuple.
        out_images, out_texts, scale = model(images, tokens)
    torch.testing.assert_close(out_images, normalized)
    torch.testing.assert_close(out_texts, F.normalize(text_features, dim=-1))
    assert float(scale) == pytest.approx(1 / 0.07, rel=1e-5)


def test_preprocess_puts_transparency_on_white_as_training_does(trained):
    """A transparent PNG through ``load``'s preprocess equals its white-background version: the
    model sees what the converters wrote in training, not open_clip's black."""
    from PIL import Image

    _, preprocess, _ = vlcontrast.load(trained[1], device="cpu")
    art = Image.new("RGBA", (40, 40), (0, 0, 0, 0))
    art.paste((0, 90, 200, 255), (10, 10, 30, 30))
    white = Image.new("RGB", (40, 40), (255, 255, 255))
    white.paste((0, 90, 200), (10, 10, 30, 30))
    torch.testing.assert_close(preprocess(art), preprocess(white))
    import pickle

    pickle.dumps(preprocess)  # data loader workers can take it


def test_import_vlcontrast_stays_cheap():
    code = ("import sys, vlcontrast; from vlcontrast import load; "
            "assert 'torch' not in sys.modules and 'open_clip' not in sys.modules; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_device_choice():
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceError, match="not a device"):
        resolve_device("gpu0")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(DeviceError, match=f"sees {count} usable CUDA device") as err:
        resolve_device(f"cuda:{count}")
    assert "\n" not in str(err.value)


def test_a_path_without_a_model_is_a_one_line_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="run directory, a checkpoint directory, a "
                       "`vlcontrast export` directory or a transformers CLIPModel directory"
                       ) as err:
        vlcontrast.load(tmp_path, device="cpu")
    assert "\n" not in str(err.value)


def test_no_random_init_warning_when_weights_follow(trained, caplog):
    import open_clip

    with caplog.at_level(logging.WARNING):
        vlcontrast.load(trained[1], device="cpu")
    assert not [r for r in caplog.records if r.getMessage().startswith(RANDOM_INIT_WARNING)]
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # only silenced while our weights follow
        open_clip.create_model("vlc-eval-tiny")
    assert [r for r in caplog.records if r.getMessage().startswith(RANDOM_INIT_WARNING)]


def test_a_resumed_run_builds_its_model_without_the_random_init_warning(caplog):
    """train() passes weights_follow when a checkpoint will be resumed: the warning would say the
    model starts random when its weights come from the checkpoint a moment later."""
    from vlcontrast.config import ModelConfig
    from vlcontrast.models import build_model

    with caplog.at_level(logging.WARNING):
        build_model(ModelConfig(name="vlc-micro"), weights_follow=True)
    assert not [r for r in caplog.records if r.getMessage().startswith(RANDOM_INIT_WARNING)]
    with caplog.at_level(logging.WARNING):  # a fresh run: random on purpose, no notice either
        build_model(ModelConfig(name="vlc-micro"))
    assert not [r for r in caplog.records if r.getMessage().startswith(RANDOM_INIT_WARNING)]
