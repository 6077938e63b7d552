"""Image and text towers, tokenizer and transforms, all from open_clip.

:func:`build_model` turns ``model.*`` of the run config into a :class:`ModelBundle`: any open_clip
model name (``RN50``, ``ViT-B-32`` ...), a path to an open_clip model-config JSON, or a name found in
``configs/models/``; a Hugging Face text tower loads from a local directory (``model.hf_model_dir``).
:func:`load_model_from_checkpoint` rebuilds the model of a vlcontrast checkpoint for evaluation and
export. Nothing here re-implements open_clip: it only resolves configs and registers them.
"""

from __future__ import annotations

import copy
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

REPO_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"


@dataclass
class ModelBundle:
    model: torch.nn.Module
    preprocess_train: Callable
    preprocess_val: Callable
    tokenizer: Callable
    model_name: str
    model_config: dict[str, Any]


def _register_config(name: str, model_cfg: dict[str, Any]) -> str:
    """Make ``model_cfg`` known to open_clip under ``name`` (open_clip reads configs from files)."""
    import open_clip

    folder = Path(tempfile.mkdtemp(prefix="vlcontrast-model-"))
    path = folder / f"{name}.json"
    path.write_text(json.dumps(model_cfg))
    open_clip.add_model_config(path)
    return name


def resolve_model_config(name: str, hf_model_dir: str = "") -> tuple[str, dict[str, Any]]:
    """(registered name, open_clip model config) for a model name, JSON path or configs/models name."""
    import open_clip

    candidates = [Path(name), Path("configs/models") / f"{name}.json", REPO_CONFIG_DIR / f"{name}.json"]
    model_cfg = None
    for candidate in candidates:
        if candidate.suffix == ".json" and candidate.is_file():
            try:
                model_cfg = json.loads(candidate.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"model.name={name!r}: {candidate} is not valid JSON: {err}") from err
            name = candidate.stem
            break
    if model_cfg is None:
        model_cfg = open_clip.get_model_config(name)
    if model_cfg is None:
        raise ValueError(f"model.name={name!r}: not an open_clip model, not a model-config JSON, and "
                         f"not in configs/models/ (open_clip has e.g. {open_clip.list_models()[:6]} ...)")
    for key in ("embed_dim", "vision_cfg", "text_cfg"):
        if key not in model_cfg:
            raise ValueError(f"model.name={name!r}: model config lacks {key!r}")
    model_cfg = copy.deepcopy(model_cfg)
    if hf_model_dir:
        folder = Path(hf_model_dir)
        if not (folder / "config.json").is_file():
            raise ValueError(f"model.hf_model_dir={hf_model_dir!r}: no config.json there (a local "
                             "Hugging Face model directory is expected)")
        text_cfg = model_cfg["text_cfg"]
        text_cfg["hf_model_name"] = str(folder.resolve())
        text_cfg["hf_tokenizer_name"] = str(folder.resolve())
        text_cfg.setdefault("hf_model_pretrained", True)
        text_cfg.setdefault("hf_proj_type", "mlp")
        text_cfg.setdefault("hf_pooler_type", "mean_pooler")
        for key in ("width", "heads", "layers", "vocab_size"):
            text_cfg.pop(key, None)
        name = f"{name}-hf-{folder.name}"
    return name, model_cfg


def build_model(model_cfg, *, siglip: bool = False, device: str | torch.device = "cpu") -> ModelBundle:
    """Create the CLIP model, its train/val transforms and tokenizer from ``model.*`` options."""
    import open_clip

    name, cfg = resolve_model_config(model_cfg.name, model_cfg.hf_model_dir)
    registered = _register_config(name, cfg)
    kwargs: dict[str, Any] = {}
    init_scale = model_cfg.init_logit_scale or (math.log(10.0) if siglip else math.log(1 / 0.07))
    kwargs["init_logit_scale"] = init_scale
    bias = model_cfg.init_logit_bias
    if bias is None and siglip:
        bias = -10.0
    if bias is not None:
        kwargs["init_logit_bias"] = bias
    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
        registered, pretrained=model_cfg.pretrained or None, device=device, output_dict=True,
        pretrained_text=bool(model_cfg.hf_model_dir), **kwargs)
    if model_cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    tokenizer = open_clip.get_tokenizer(registered)
    stored = {"model_name": name, "model_cfg": cfg, "init_logit_scale": init_scale,
              "init_logit_bias": bias}
    return ModelBundle(model, preprocess_train, preprocess_val, tokenizer, name, stored)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a run directory (its latest), a checkpoints/ dir, or itself."""
    path = Path(path)
    if (path / "model.pt").is_file():
        return path
    for folder in (path / "checkpoints", path):
        latest = folder / "latest"
        if latest.is_file():
            target = folder / latest.read_text().strip()
            if (target / "model.pt").is_file():
                return target
    raise FileNotFoundError(f"--checkpoint {str(path)!r}: no model.pt there and no "
                            "checkpoints/latest (expected a run directory or a checkpoint directory)")


def load_model_from_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> ModelBundle:
    """Rebuild the model of a vlcontrast checkpoint (run dir -> latest) with its weights."""
    import open_clip

    folder = resolve_checkpoint(path)
    meta = json.loads((folder / "model_config.json").read_text())
    registered = _register_config(meta["model_name"], meta["model_cfg"])
    kwargs: dict[str, Any] = {"init_logit_scale": meta.get("init_logit_scale", math.log(1 / 0.07))}
    if meta.get("init_logit_bias") is not None:
        kwargs["init_logit_bias"] = meta["init_logit_bias"]
    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
        registered, device=device, output_dict=True, pretrained_text=False, **kwargs)
    state = torch.load(folder / "model.pt", map_location=device, weights_only=True)
    model.load_state_dict(state)
    model.eval()
    tokenizer = open_clip.get_tokenizer(registered)
    return ModelBundle(model, preprocess_train, preprocess_val, tokenizer, meta["model_name"], meta)
