"""Model building: open_clip names, JSON configs, a local Hugging Face text tower, SigLIP init."""

import json
import math

import pytest
import torch

from vlcontrast.config import ModelConfig
from vlcontrast.models import build_model, resolve_checkpoint


def test_json_config_builds_with_open_clip_tokenizer_and_transforms():
    bundle = build_model(ModelConfig(name="vlc-micro"))
    tokens = bundle.tokenizer(["a small red circle", "two blue squares"])
    assert tokens.shape == (2, 16) and tokens.dtype == torch.long
    image = torch.rand(2, 3, 32, 32)
    out = bundle.model(image, tokens)
    assert out["image_features"].shape == (2, 32)
    assert torch.allclose(out["image_features"].norm(dim=-1), torch.ones(2), atol=1e-5)
    assert out["logit_scale"].item() == pytest.approx(1 / 0.07, rel=1e-4)
    assert bundle.model_config["model_name"] == "vlc-micro"


def test_siglip_initialisation():
    bundle = build_model(ModelConfig(name="vlc-micro"), siglip=True)
    assert bundle.model.logit_scale.exp().item() == pytest.approx(10.0, rel=1e-4)
    assert bundle.model.logit_bias.item() == pytest.approx(-10.0)


def test_hf_text_tower_from_local_directory(hf_text_dir):
    bundle = build_model(ModelConfig(name="vlc-micro", hf_model_dir=str(hf_text_dir)))
    assert "hf" in bundle.model_name
    assert bundle.model_config["model_cfg"]["text_cfg"]["hf_model_name"] == str(hf_text_dir.resolve())
    tokens = bundle.tokenizer(["a red circle", "two blue squares"])
    assert tokens.shape[0] == 2
    # The local vocabulary is used: "a red circle" -> ids 5, 6, 8 (this WordLevel tokenizer adds no [CLS]).
    assert tokens[0, :3].tolist() == [5, 6, 8]
    out = bundle.model(torch.rand(2, 3, 32, 32), tokens)
    assert out["text_features"].shape == (2, 32)
    assert torch.isfinite(out["text_features"]).all()


def test_bad_hf_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match="model.hf_model_dir"):
        build_model(ModelConfig(name="vlc-micro", hf_model_dir=str(tmp_path)))


def test_resolve_checkpoint_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        resolve_checkpoint(tmp_path)
    step = tmp_path / "checkpoints" / "step_00000003"
    step.mkdir(parents=True)
    (step / "model.pt").write_bytes(b"")
    (tmp_path / "checkpoints" / "latest").write_text("step_00000003\n")
    assert resolve_checkpoint(tmp_path) == step
