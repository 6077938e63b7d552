"""Export a vlcontrast checkpoint as an open_clip model (weights + model config).

``export_open_clip(CKPT, DIR)`` writes::

    DIR/<model_name>.json             the open_clip model config (for open_clip.add_model_config)
    DIR/open_clip_config.json         {"model_cfg", "preprocess_cfg"} (for "local-dir:DIR")
    DIR/open_clip_pytorch_model.bin   the model's state dict

so either of these loads it with the same embeddings as the checkpoint::

    open_clip.add_model_config("DIR/<model_name>.json")
    model, _, preprocess = open_clip.create_model_and_transforms(
        "<model_name>", pretrained="DIR/open_clip_pytorch_model.bin")
    model, _, preprocess = open_clip.create_model_and_transforms("local-dir:DIR")

and CLIP_benchmark evaluates it with ``--model <model_name> --pretrained DIR/open_clip_pytorch_model.bin``
once the config is registered (or ``--model local-dir:DIR``). A Hugging Face text tower keeps pointing
at the local directory recorded in the config.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vlcontrast.checkpoints import EXPORT_CONFIG_FILE, EXPORT_WEIGHTS_FILE

WEIGHTS_NAME = EXPORT_WEIGHTS_FILE


def export_open_clip(checkpoint, out_dir) -> dict:
    """Write CKPT (run dir -> latest, or a checkpoint dir) as an open_clip model in ``out_dir``.

    Returns ``{"checkpoint", "model_name", "model_config", "open_clip_config", "weights"}`` (paths as
    strings).
    """
    from vlcontrast.checkpoints import resolve_weights
    from vlcontrast.models import load_model_from_checkpoint

    folder = resolve_weights(checkpoint)
    bundle = load_model_from_checkpoint(folder, device="cpu")
    meta = bundle.model_config
    model_cfg = dict(meta["model_cfg"])
    # open_clip builds the SigLIP bias parameter only when the config asks for it; the scale is a
    # parameter either way and its trained value comes with the state dict.
    if meta.get("init_logit_bias") is not None:
        model_cfg["init_logit_bias"] = meta["init_logit_bias"]
    if meta.get("init_logit_scale") is not None:
        model_cfg.setdefault("init_logit_scale", meta["init_logit_scale"])
    preprocess_cfg = dict(getattr(bundle.model.visual, "preprocess_cfg", {}) or {})

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / f"{bundle.model_name}.json"
    config_path.write_text(json.dumps(model_cfg, indent=2) + "\n")
    open_clip_config = out / EXPORT_CONFIG_FILE
    open_clip_config.write_text(json.dumps({"model_cfg": model_cfg,
                                            "preprocess_cfg": preprocess_cfg}, indent=2) + "\n")
    weights = out / WEIGHTS_NAME
    state = {key: value.detach().cpu().contiguous() for key, value in bundle.model.state_dict().items()}
    torch.save(state, weights)
    return {"checkpoint": str(folder), "model_name": bundle.model_name,
            "model_config": str(config_path), "open_clip_config": str(open_clip_config),
            "weights": str(weights)}
