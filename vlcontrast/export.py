"""Export a vlcontrast checkpoint for other tools: open_clip's layout or a transformers CLIPModel.

``export_open_clip(CKPT, DIR)`` writes::

    DIR/<model_name>.json               the open_clip model config (for open_clip.add_model_config)
    DIR/open_clip_config.json           {"model_cfg", "preprocess_cfg", "vlcontrast"} ("local-dir:DIR")
    DIR/open_clip_model.safetensors     the model's state dict
    DIR/README.md                       what it is, how to load it, the transparency rule

so either of these loads it with the same embeddings as the checkpoint, without unpickling::

    open_clip.add_model_config("DIR/<model_name>.json")
    model, _, preprocess = open_clip.create_model_and_transforms(
        "<model_name>", pretrained="DIR/open_clip_model.safetensors")
    model, _, preprocess = open_clip.create_model_and_transforms("local-dir:DIR")

(uploaded to the Hugging Face Hub as it is, ``hf-hub:ORG/NAME`` finds the same two files), and
CLIP_benchmark evaluates it with ``--model local-dir:DIR``. A Hugging Face text tower keeps
pointing at the local directory recorded in the config.

``export_transformers(CKPT, DIR)`` writes a transformers ``CLIPModel`` directory (``config.json``,
``model.safetensors``, the processor's ``preprocessor_config.json``, the tokenizer's files and a
README) for a ViT image tower with open_clip's text transformer; the mapping and what it refuses:
:mod:`vlcontrast.models.transformers_clip`.

Both say which transparency rule the model was trained with (``white``: composited on white,
:data:`~vlcontrast.data.samples.TRAINING_ALPHA`), in their config and README: other tools drop the
alpha channel instead (``convert("RGB")``), which changes what a transparent image looks like.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from vlcontrast.checkpoints import EXPORT_CONFIG_FILE, EXPORT_WEIGHTS_FILE
from vlcontrast.data.samples import TRAINING_ALPHA
from vlcontrast.errors import ConfigError
from vlcontrast.outputs import replace_dir

WEIGHTS_NAME = EXPORT_WEIGHTS_FILE
FORMATS = ("open_clip", "transformers")


def _provenance(folder: Path, model_name: str) -> dict:
    return {"exported_by": "vlcontrast", "checkpoint": str(folder), "model_name": model_name,
            "trained_alpha": TRAINING_ALPHA,
            "trained_alpha_means": "transparent images were composited on white in training; "
                                   "read them the same way for the trained behaviour"}


def _save_safetensors(state: dict, path: Path, metadata: dict) -> None:
    """Write ``state`` as safetensors at ``path``, readable as the export's other files are:
    safetensors creates its file with mode 0600 whatever the umask, which would leave the
    weights unreadable to the colleagues who can read the config and the README beside them."""
    from safetensors.torch import save_file

    tensors = {key: value.detach().to("cpu").contiguous() for key, value in state.items()}
    save_file(tensors, str(path), metadata={"format": "pt", **{k: str(v) for k, v in
                                                              metadata.items()}})
    os.chmod(path, 0o666 & ~current_umask())


def current_umask() -> int:
    """The process's umask (read by setting it and setting it back: there is no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _load(checkpoint, what: str = "checkpoint"):
    from vlcontrast.checkpoints import resolve_weights
    from vlcontrast.models import load_model_from_checkpoint

    folder = resolve_weights(checkpoint, what)
    return folder, load_model_from_checkpoint(folder, device="cpu")


def export_open_clip(checkpoint, out_dir, overwrite: bool = False) -> dict:
    """Write CKPT (run dir -> latest, or a checkpoint dir) as an open_clip model in ``out_dir``,
    which must be new or empty; ``overwrite=True`` replaces an earlier vlcontrast export there.
    The export is written beside ``out_dir`` and moved in when complete (:func:`export_model`).

    Returns ``{"checkpoint", "model_name", "model_config", "open_clip_config", "weights",
    "readme"}`` (paths as strings).
    """
    return _export(_write_open_clip, checkpoint, out_dir, overwrite, PYTHON_NAMES)


def export_transformers(checkpoint, out_dir, overwrite: bool = False) -> dict:
    """Write CKPT as a transformers ``CLIPModel`` directory in ``out_dir`` (new or empty, or with
    ``overwrite=True`` an earlier vlcontrast export, replaced whole as by
    :func:`export_open_clip`); a one-line :class:`ConfigError` naming the part that has no
    ``CLIPModel`` counterpart, before anything is written. Returns ``{"checkpoint",
    "model_name", "config", "weights", "readme"}``."""
    return _export(_write_transformers, checkpoint, out_dir, overwrite, PYTHON_NAMES)


def _write_open_clip(checkpoint, out_dir, what: str) -> dict:
    """The files of an open_clip export, written into ``out_dir`` (the staging folder)."""
    folder, bundle = _load(checkpoint, what)
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
    provenance = _provenance(folder, bundle.model_name)
    config_path = out / f"{bundle.model_name}.json"
    config_path.write_text(json.dumps(model_cfg, indent=2) + "\n")
    open_clip_config = out / EXPORT_CONFIG_FILE
    open_clip_config.write_text(json.dumps({"model_cfg": model_cfg,
                                            "preprocess_cfg": preprocess_cfg,
                                            "vlcontrast": provenance}, indent=2) + "\n")
    weights = out / WEIGHTS_NAME
    _save_safetensors(bundle.model.state_dict(), weights, {"trained_alpha": TRAINING_ALPHA})
    readme = out / "README.md"
    readme.write_text(_readme_open_clip(bundle.model_name, folder))
    return {"checkpoint": str(folder), "model_name": bundle.model_name,
            "model_config": str(config_path), "open_clip_config": str(open_clip_config),
            "weights": str(weights), "readme": str(readme)}


def _write_transformers(checkpoint, out_dir, what: str) -> dict:
    """The files of a transformers export, written into ``out_dir`` (the staging folder)."""
    from vlcontrast.models import transformers_clip as mapping

    folder, bundle = _load(checkpoint, what)
    model_cfg = bundle.model_config["model_cfg"]
    state = bundle.model.state_dict()
    preprocess_cfg = dict(getattr(bundle.model.visual, "preprocess_cfg", {}) or {})
    mapping.check_mappable(model_cfg, state, preprocess_cfg)
    tensors = mapping.to_transformers_state_dict(state)
    provenance = _provenance(folder, bundle.model_name)
    config = mapping.transformers_config(model_cfg, state, {"vlcontrast": provenance})
    processor = mapping.image_processor_config(preprocess_cfg,
                                               config["vision_config"]["image_size"])

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / mapping.CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    weights = out / mapping.WEIGHTS_FILE
    _save_safetensors(tensors, weights, {"trained_alpha": TRAINING_ALPHA})
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    mapping.write_tokenizer_files(out, config["text_config"]["max_position_embeddings"])
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "CLIPProcessor"},
                                                          indent=2) + "\n")
    readme = out / "README.md"
    readme.write_text(_readme_transformers(bundle.model_name, folder,
                                           config["text_config"]["max_position_embeddings"]))
    return {"checkpoint": str(folder), "model_name": bundle.model_name,
            "config": str(out / mapping.CONFIG_FILE), "weights": str(weights),
            "readme": str(readme)}


@dataclass(frozen=True)
class Names:
    """How export's errors name its inputs: the checkpoint, the output folder and the switch
    that replaces an earlier export (command-line flags, or the Python parameters)."""
    checkpoint: str
    out: str
    overwrite: str

    def out_named(self, out: Path) -> str:
        """``export OUT 'x'`` on the command line, ``out_dir='x'`` in Python."""
        return (f"{self.out}={str(out)!r}" if self.out.isidentifier()
                else f"{self.out} {str(out)!r}")


PYTHON_NAMES = Names("checkpoint", "out_dir", "overwrite=True")
CLI_NAMES = Names("--checkpoint", "export OUT", "--overwrite")


def export_model(checkpoint, out_dir, format: str = "open_clip", overwrite: bool = False,
                 what: str = "--checkpoint") -> dict:
    """``vlcontrast export``: :func:`export_open_clip` or :func:`export_transformers` into
    ``out_dir``, which must be new or empty; ``overwrite`` replaces an earlier vlcontrast export
    there. The export is written beside ``out_dir`` and moved in when complete, so a failed
    export leaves nothing half-written and an earlier export intact. Errors name the command
    line's flags; ``what`` names the checkpoint's."""
    if format not in FORMATS:
        raise ConfigError(f"--format {format!r}: use one of {', '.join(FORMATS)}")
    write = _write_open_clip if format == "open_clip" else _write_transformers
    names = Names(what, CLI_NAMES.out, CLI_NAMES.overwrite)
    return _export(write, checkpoint, out_dir, overwrite, names)


def _export(write, checkpoint, out_dir, overwrite: bool, names: Names) -> dict:
    """The one way an export reaches ``out_dir``: :func:`check_export_target` before the
    checkpoint is read, ``write`` into a staging folder beside it, moved in whole when complete
    (:func:`vlcontrast.outputs.replace_dir`); a failure leaves no staging folder and an earlier
    export intact. The result's paths name the files in ``out_dir``."""
    out = Path(out_dir)
    check_export_target(out, overwrite, names)
    staging = out.parent / f".{out.name}.exporting"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        result = write(checkpoint, staging, names.checkpoint)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_dir(staging, out)
    return {key: str(out / Path(value).relative_to(staging))
            if isinstance(value, str) and Path(value).is_relative_to(staging) else value
            for key, value in result.items()}


def check_export_target(out: Path, overwrite: bool, names: Names = CLI_NAMES) -> None:
    """``out`` is a folder this process can write, new, empty, or (with ``overwrite``) an
    earlier vlcontrast export; a one-line ConfigError otherwise, naming ``names``' options,
    before the checkpoint is read."""
    from vlcontrast.outputs import writable_dir

    out = Path(out)
    named = names.out_named(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{named}: a file; name a folder")
    writable_dir(out, names.out)
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return
    shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
    if not overwrite:
        raise ConfigError(f"{named}: not empty ({shown}); name a new folder, or add "
                          f"{names.overwrite} to replace an earlier vlcontrast export there")
    if not is_vlcontrast_export(out):
        raise ConfigError(f"{named}: holds files that are not a vlcontrast export ({shown}), "
                          f"which {names.overwrite} would delete; name a new folder")


def is_vlcontrast_export(folder: Path) -> bool:
    """A folder an earlier ``vlcontrast export`` wrote (either format): its config records it."""
    from vlcontrast.checkpoints import TRANSFORMERS_CONFIG_FILE

    for name in (EXPORT_CONFIG_FILE, TRANSFORMERS_CONFIG_FILE):
        try:
            config = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and isinstance(config.get("vlcontrast"), dict):
            return True
    return False


ALPHA_NOTE = """## Transparency

Trained with transparency composited on white (`trained_alpha: white`). open_clip's transforms,
CLIP_benchmark and transformers' processors drop the alpha channel instead (`convert("RGB")`),
so a transparent image they read is not what this model saw in training: composite it on white
first for the trained behaviour (`vlcontrast eval ... --alpha white`, the default), or compare
with other tools under their rule (`--alpha drop`).
"""


def _readme_open_clip(model_name: str, folder: Path) -> str:
    return f"""# {model_name} (open_clip)

Exported by vlcontrast from `{folder}`.

```python
import open_clip
model, _, preprocess = open_clip.create_model_and_transforms("local-dir:THIS_DIRECTORY")
tokenizer = open_clip.get_tokenizer("local-dir:THIS_DIRECTORY")
```

Weights: `{WEIGHTS_NAME}` (safetensors). CLIP_benchmark: `--model local-dir:THIS_DIRECTORY`.

{ALPHA_NOTE}"""


def _readme_transformers(model_name: str, folder: Path, context: int) -> str:
    return f"""# {model_name} (transformers CLIPModel)

Exported by vlcontrast from `{folder}`.

```python
from transformers import pipeline
classify = pipeline("zero-shot-image-classification", model="THIS_DIRECTORY")
print(classify("photo.jpg", candidate_labels=["a cat", "a dog"]))
```

`CLIPModel.from_pretrained` and `CLIPProcessor.from_pretrained` load it as well. Weights:
`model.safetensors`.

## How close to vlcontrast

The network is the same: given the same pixels and token ids, it gives vlcontrast's embeddings
to float tolerance. The inputs can differ:

- **Pixels.** The processor resizes the shortest side (bicubic), centre-crops and normalises as
  open_clip's evaluation transform does, but rounds the crop offset down where vlcontrast rounds
  it to nearest: when the resized long side minus the crop size is 3 mod 4 the crop is one pixel
  off, which moves a small model's embedding noticeably. transformers' default (torchvision)
  backend also resizes slightly differently; `backend="pil"` resizes as vlcontrast does:
  `CLIPProcessor.from_pretrained("THIS_DIRECTORY", backend="pil")`, or
  `pipeline(..., image_processor=AutoImageProcessor.from_pretrained("THIS_DIRECTORY",
  backend="pil"))`. For the same pixels, feed vlcontrast's `preprocess` output as `pixel_values`.
- **Text.** open_clip fixes text with ftfy and unescapes HTML entities (`&amp;`) before its
  BPE; this tokenizer does neither, so such text gets other ids. Clean it first:
  `open_clip.tokenizer.basic_clean(text)`.
- **Long labels.** The tokenizer truncates at the model's context ({context} tokens) only when
  asked (`truncation=True`); the zero-shot pipeline does not ask, and a prompt longer than the
  context fails with `Sequence length must be less than max_position_embeddings`. Shorten the
  labels, or classify with the model directly:

```python
import torch
from PIL import Image
from transformers import CLIPModel, CLIPProcessor
model = CLIPModel.from_pretrained("THIS_DIRECTORY").eval()
processor = CLIPProcessor.from_pretrained("THIS_DIRECTORY", backend="pil")
labels = ["a cat", "a dog"]
inputs = processor(text=[f"a photo of {{label}}." for label in labels],
                   images=Image.open("photo.jpg"), padding=True, truncation=True,
                   return_tensors="pt")
with torch.no_grad():
    print(model(**inputs).logits_per_image.softmax(-1))
```

{ALPHA_NOTE}"""
