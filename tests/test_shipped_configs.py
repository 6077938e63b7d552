"""Every shipped config parses and validates, and every shipped model config builds."""

import json
from pathlib import Path

import pytest

from vlcontrast.config import load_config
from vlcontrast.models import PACKAGE_CONFIG_DIR, resolve_model_config

ROOT = Path(__file__).resolve().parents[1]
RUN_CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "study" not in p.parts)


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_run_config_validates(path):
    config = load_config(path)
    assert config.data.train
    name, model_cfg = resolve_model_config(config.model.name)
    assert model_cfg["embed_dim"] > 0


@pytest.mark.parametrize("path", sorted(PACKAGE_CONFIG_DIR.glob("*.json")), ids=lambda p: p.name)
def test_model_config_is_open_clip_shaped(path):
    cfg = json.loads(path.read_text())
    assert {"embed_dim", "vision_cfg", "text_cfg"} <= set(cfg)
    name, resolved = resolve_model_config(str(path))
    assert name == path.stem and resolved == cfg


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match="model.name='no-such-model'"):
        resolve_model_config("no-such-model")


def test_shipped_gpu_configs_use_amp_bf16():
    for path in sorted((ROOT / "configs" / "cc3m").glob("*.yaml")):
        assert load_config(path).train.precision == "amp_bf16", path.name


def _tower_family(model_cfg: dict) -> str:
    vision = model_cfg["vision_cfg"]
    if vision.get("timm_model_name"):
        return "timm"
    return "resnet" if isinstance(vision.get("layers"), (list, tuple)) else "vit"


def test_every_shipped_tower_family_trains_in_the_precision_test():
    """tests/train/test_precision.py trains a small ResNet and a small ViT under every precision;
    a shipped config with another tower family needs a case there first."""
    families = {_tower_family(resolve_model_config(load_config(path).model.name)[1])
                for path in RUN_CONFIGS}
    assert "resnet" in families and families <= {"resnet", "vit"}, families
