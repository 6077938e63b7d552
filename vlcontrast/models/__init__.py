"""Image and text towers, tokenizer and transforms, all from open_clip.

:func:`build_model` turns ``model.*`` of the run config into a :class:`ModelBundle`: any open_clip
model name (``RN50``, ``ViT-B-32`` ...), a model config shipped in ``vlcontrast/models/configs/``
(``vlc-micro``, ``vlc-tiny`` ...), a path to an open_clip model-config JSON, or a name found in
``configs/models/`` under the current directory; a Hugging Face text tower loads from a local
directory (``model.hf_model_dir``). ``model.pretrained`` loads open_clip weights, a vlcontrast
checkpoint, an open_clip export directory or a transformers ``CLIPModel`` directory (:mod:`.transformers_clip` maps its tensors),
and ``model.lock_image``/``model.lock_text`` lock towers as open_clip does (LiT).
:func:`load_model_from_checkpoint` rebuilds the model of a vlcontrast checkpoint, of an export or of
a ``CLIPModel`` directory for evaluation, export and :func:`vlcontrast.load`;
:func:`load_pretrained_model` takes every form ``model.pretrained`` takes (a teacher's loader).
open_clip's "initialized randomly" warning is silenced while a model whose weights come right after
is built, and for a model built from scratch on purpose (``model.pretrained`` empty).
:func:`check_pretrained` checks ``model.pretrained`` before any model is built (a path that does not
exist, a tag the model lacks, a transformers export's weights file instead of its folder). Weights
that do not fit the model are one line naming the option, a few of the keys with their count and,
when their config is beside them, the right ``model.name``. Nothing here re-implements open_clip:
it only resolves configs and registers them.
"""

from __future__ import annotations

import atexit
import copy
import json
import logging
import math
import shlex
import shutil
import tempfile
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from vlcontrast.checkpoints import (EXPORT_CONFIG_FILE, MODEL_CONFIG_FILE, WEIGHTS_FILE,
                                    export_weights, is_export, is_transformers_clip,
                                    read_weights, resolve_model_files, resolve_weights)
from vlcontrast.errors import ConfigError

__all__ = [
    "PACKAGE_CONFIG_DIR",
    "USER_CONFIG_DIR",
    "ModelBundle",
    "build_model",
    "check_pretrained",
    "load_model_from_checkpoint",
    "load_pretrained_model",
    "lock_towers",
    "resolve_model_config",
]

PACKAGE_CONFIG_DIR = Path(__file__).resolve().parent / "configs"
"""Model configs shipped with the package (``pyproject.toml`` package-data)."""
USER_CONFIG_DIR = Path("configs") / "models"
"""Relative to the current directory: a place for your own model configs, found by bare name."""


@dataclass
class ModelBundle:
    model: torch.nn.Module
    preprocess_train: Callable
    preprocess_val: Callable
    tokenizer: Callable
    model_name: str
    model_config: dict[str, Any]


_registry_folder: Path | None = None


def _registry() -> Path:
    """The one folder per process through which configs reach open_clip (removed at exit).

    open_clip reads model configs only from files it has been pointed at; writing every config
    into a single folder, file name = model name, keeps the number of folders at one per process
    whatever the number of :func:`build_model` calls.
    """
    global _registry_folder
    if _registry_folder is None or not _registry_folder.is_dir():
        _registry_folder = Path(tempfile.mkdtemp(prefix="vlcontrast-model-"))
        atexit.register(shutil.rmtree, _registry_folder, True)
    return _registry_folder


def remove_registry() -> None:
    """Delete the registry folder now (it is also removed when the process exits)."""
    global _registry_folder
    if _registry_folder is not None:
        shutil.rmtree(_registry_folder, ignore_errors=True)
        _registry_folder = None


def _register_config(name: str, model_cfg: dict[str, Any]) -> str:
    """Make ``model_cfg`` known to open_clip under ``name`` (open_clip reads configs from files)."""
    import open_clip

    if open_clip.get_model_config(name) == model_cfg:
        return name
    path = _registry() / f"{name}.json"
    path.write_text(json.dumps(model_cfg))
    open_clip.add_model_config(path)  # rescans every known file: the newest content wins
    return name


def find_model_config_file(name: str) -> Path | None:
    """The model-config JSON that ``model.name=name`` refers to, or None for open_clip's own names.

    Order: ``name`` as a path; ``configs/models/<name>.json`` under the current directory (your
    own configs); the configs shipped with the package.
    """
    candidates = [Path(name), USER_CONFIG_DIR / f"{name}.json", PACKAGE_CONFIG_DIR / f"{name}.json"]
    for candidate in candidates:
        if candidate.suffix == ".json" and candidate.is_file():
            return candidate
    return None


def _folder_model(folder: str) -> tuple[Path | None, dict[str, Any] | None, str]:
    """(model-config JSON, or the config itself, and the model's name) of ``model.name=FOLDER``:
    an open_clip export's ``<model>.json``, a vlcontrast run's or checkpoint's
    ``model_config.json``; a one-line ConfigError for any other folder."""
    if is_export(folder):
        inside = sorted(p for p in Path(folder).glob("*.json") if p.name != EXPORT_CONFIG_FILE)
        if len(inside) == 1:
            return inside[0], None, folder
    try:
        checkpoint = resolve_weights(folder, "model.name")
    except OSError:
        raise ConfigError(f"model.name={folder!r}: a folder, but not a vlcontrast run, checkpoint "
                          "or export, nor a transformers CLIPModel directory; give an open_clip "
                          "model name, a model-config JSON, or one of those folders") from None
    stored = read_model_config(checkpoint)  # a damaged one: named, with the checkpoint before it
    return None, dict(stored["model_cfg"]), str(stored["model_name"])


def resolve_model_config(name: str, hf_model_dir: str = "") -> tuple[str, dict[str, Any]]:
    """(registered name, open_clip model config) for a model name, JSON path or config name."""
    import open_clip

    model_cfg = None
    candidate = find_model_config_file(name)
    if candidate is None and is_transformers_clip(name):
        from vlcontrast.models.transformers_clip import open_clip_config

        model_cfg = open_clip_config(json.loads((Path(name) / "config.json").read_text()),
                                     f"model.name={name!r}")
        name = transformers_model_name(name)
    elif candidate is None and Path(name).is_dir() and open_clip.get_model_config(name) is None:
        candidate, model_cfg, name = _folder_model(name)  # an export's, a run's, a checkpoint's
    if candidate is not None:
        try:
            model_cfg = json.loads(candidate.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"model.name={name!r}: {candidate} is not valid JSON: {err}") from err
        name = candidate.stem
    if model_cfg is None:
        model_cfg = open_clip.get_model_config(name)
    if model_cfg is None:
        import difflib

        shipped = sorted(p.stem for p in PACKAGE_CONFIG_DIR.glob("*.json"))
        known = [*shipped, *(p.stem for p in Path(USER_CONFIG_DIR).glob("*.json")),
                 *open_clip.list_models()]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"model.name={name!r}{hint}: not an open_clip model, not a model-config "
                          f"JSON, not shipped with vlcontrast ({', '.join(shipped)}) and not in "
                          f"{USER_CONFIG_DIR}/ (open_clip has e.g. {open_clip.list_models()[:6]} ...)")
    for key in ("embed_dim", "vision_cfg", "text_cfg"):
        if key not in model_cfg:
            raise ConfigError(f"model.name={name!r}: model config lacks {key!r}")
    model_cfg = copy.deepcopy(model_cfg)
    if hf_model_dir:
        folder = Path(hf_model_dir)
        if not (folder / "config.json").is_file():
            raise ConfigError(f"model.hf_model_dir={hf_model_dir!r}: no config.json there (a local "
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


def build_model(model_cfg, *, siglip: bool = False, device: str | torch.device = "cpu",
                weights_follow: bool = False) -> ModelBundle:
    """Create the CLIP model, its train/val transforms and tokenizer from ``model.*`` options.

    ``weights_follow``: the caller loads weights right after (a resumed run). Then, and whenever
    ``model.pretrained`` is empty (a from-scratch model is random on purpose), open_clip's
    "initialized randomly" warning would mislead or only repeat the config, and is not shown;
    every other warning is."""
    import open_clip

    name, cfg = resolve_model_config(model_cfg.name, model_cfg.hf_model_dir)
    check_pretrained(model_cfg)  # before open_clip: its errors are tracebacks and log lines
    registered = _register_config(name, cfg)
    kwargs: dict[str, Any] = {}
    init_scale = model_cfg.init_logit_scale or (math.log(10.0) if siglip else math.log(1 / 0.07))
    kwargs["init_logit_scale"] = init_scale
    bias = model_cfg.init_logit_bias
    if bias is None and siglip:
        bias = -10.0
    if bias is not None:
        kwargs["init_logit_bias"] = bias
    transformers_state, preprocess = None, {}
    if model_cfg.pretrained and is_transformers_clip(model_cfg.pretrained):
        transformers_state, preprocess = _transformers_start(model_cfg.pretrained, cfg,
                                                             model_cfg.name)
        kwargs.update(_preprocess_kwargs(preprocess))
    weights = (pretrained_weights(model_cfg.pretrained) if transformers_state is None
               else None)
    weights_after = weights is not None or transformers_state is not None
    open_clip_weights = None if weights_after else (model_cfg.pretrained or None)
    # Without open_clip weights the model is random on purpose (from scratch) or gets its
    # weights right after (ours, or a resumed run's): open_clip's warning says neither.
    quiet = (weights_loaded_afterwards() if weights_after or weights_follow or not open_clip_weights
             else nullcontext())
    what = f"model.pretrained={model_cfg.pretrained!r}"
    with augment_applied(), quiet:
        try:
            model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
                registered, pretrained=open_clip_weights, device=device, output_dict=True,
                pretrained_text=bool(model_cfg.hf_model_dir),
                aug_cfg=dict(model_cfg.augment) or None, **kwargs)
        except (AssertionError, RuntimeError, KeyError) as err:
            # open_clip's loader of a weights file asserts on, or fails to load, other shapes
            if not (open_clip_weights and Path(open_clip_weights).is_file()):
                raise
            raise does_not_fit(what, Path(open_clip_weights), model_cfg.name, err) from err
    if weights is not None:
        load_weights(model, weights, what, device, model_name=model_cfg.name)
    if transformers_state is not None:
        load_state(model, transformers_state, what, Path(model_cfg.pretrained), device,
                   model_name=model_cfg.name)
    lock_towers(model, model_cfg)
    if model_cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    use_channels_last(model)  # ResNet towers only; faster on cuDNN and on the CPU's oneDNN alike
    tokenizer = open_clip.get_tokenizer(registered)
    stored = {"model_name": name, "model_cfg": cfg, "init_logit_scale": init_scale,
              "init_logit_bias": bias}
    overrides = _preprocess_kwargs(preprocess)
    if overrides:  # only then: checkpoints of every other start keep their model_config.json
        stored["preprocess"] = overrides
    return ModelBundle(model, preprocess_train, preprocess_val, tokenizer, name, stored)


def transformers_model_name(folder: str | Path) -> str:
    """The open_clip name a ``CLIPModel`` directory's config is registered under."""
    return f"transformers-{Path(folder).resolve().name}"


def _preprocess_kwargs(preprocess: dict) -> dict:
    from vlcontrast.models.transformers_clip import preprocess_overrides

    return preprocess_overrides(preprocess) if preprocess else {}


def _transformers_start(folder: str, cfg: dict, name: str) -> tuple[dict, dict]:
    """The open_clip state dict and preprocessing of a ``CLIPModel`` directory named by
    ``model.pretrained``, after checking that ``model.name``'s config is its config."""
    from vlcontrast.models.transformers_clip import load_transformers_clip

    what = f"model.pretrained={folder!r}"
    derived, state, preprocess = load_transformers_clip(folder, "model.pretrained")
    difference = config_difference(derived, cfg)
    if difference:
        raise ConfigError(f"{what} is a transformers CLIPModel whose {difference}; "
                          f"set model.name={shlex.quote(str(folder))} to build its own config")
    return state, preprocess


TRAINING_ONLY_OPTIONS = ("patch_dropout", "output_tokens")
"""Options that change training, not the weights: a start may differ there."""


def config_difference(expected: dict, actual: dict) -> str:
    """'' when two open_clip model configs build the same network (each tower's options filled
    with open_clip's defaults), else ``"<key> is <expected>, model.name's is <actual>"``."""
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg

    if int(expected["embed_dim"]) != int(actual["embed_dim"]):
        return f"embed_dim is {expected['embed_dim']}, model.name's is {actual['embed_dim']}"
    if bool(expected.get("quick_gelu")) != bool(actual.get("quick_gelu")):
        return (f"quick_gelu is {bool(expected.get('quick_gelu'))}, model.name's is "
                f"{bool(actual.get('quick_gelu'))}")
    for part, kind in (("vision_cfg", CLIPVisionCfg), ("text_cfg", CLIPTextCfg)):
        try:
            mine = vars(kind(**expected[part]))
            theirs = vars(kind(**actual[part]))
        except TypeError as err:
            return f"{part} cannot be compared ({err})"
        for key, value in mine.items():
            if key in TRAINING_ONLY_OPTIONS:
                continue
            other = theirs.get(key)
            if isinstance(value, (list, tuple)) or isinstance(other, (list, tuple)):
                same = list(value if isinstance(value, (list, tuple)) else [value]) == \
                    list(other if isinstance(other, (list, tuple)) else [other])
            elif isinstance(value, float) or isinstance(other, float):
                same = value is not None and other is not None and math.isclose(value, other)
            else:
                same = value == other
            if not same:
                return f"{part}.{key} is {value!r}, model.name's is {other!r}"
    return ""


PRETRAINED_FORMS = ("a weights file, a vlcontrast run, checkpoint or export directory, or a "
                    "transformers CLIPModel directory")
"""What ``model.pretrained`` takes besides an open_clip tag of the model."""
PATH_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt", ".json")
"""A value ending in one of these names a file (weights, or a model-config JSON), not a tag."""
TRANSFORMERS_TENSOR_PREFIXES = ("text_model.", "vision_model.")
"""How a transformers ``CLIPModel``'s tensor names start (open_clip's never do)."""
SHOWN = 3
"""Names shown of a long list (keys, tags) in a one-line error, before the count of the rest."""


def looks_like_path(value: str) -> bool:
    """Whether an option's value reads as a path rather than an open_clip name or tag: it has a
    path separator (``hf-hub:org/name`` and URLs excepted) or ends in a weights or JSON suffix."""
    if not value or value.startswith("hf-hub:") or "://" in value:
        return False
    return "/" in value or "\\" in value or value.lower().endswith(PATH_SUFFIXES)


def near_path(value: str | Path) -> str:
    """The existing path one typo away from ``value`` (the first component that does not exist
    replaced by its closest sibling), or ''; for a did-you-mean."""
    import difflib

    path = Path(value)
    existing = Path(path.anchor) if path.is_absolute() else Path(".")
    parts = path.parts[1:] if path.is_absolute() else path.parts
    for index, part in enumerate(parts):
        if (existing / part).exists():
            existing = existing / part
            continue
        try:
            names = [p.name for p in existing.iterdir()]
        except OSError:
            return ""
        for close in difflib.get_close_matches(part, names, n=3, cutoff=0.6):
            candidate = existing.joinpath(close, *parts[index + 1:])
            if candidate.exists():
                return str(candidate)
        return ""
    return ""


def capped(names: list[str], shown: int = SHOWN) -> str:
    """``'a', 'b', 'c' and 139 more``: a few names of a long list and the count of the rest."""
    listed = ", ".join(repr(str(n)) for n in names[:shown])
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")


def key_list(label: str, keys: list[str]) -> str:
    """``unexpected 142 keys ('logit_scale', ... and 139 more)``: a list of state-dict keys in an
    error, capped to a few names and a count."""
    return f"{label} {len(keys)} key{'' if len(keys) == 1 else 's'} ({capped(keys)})"


def safetensors_names(path: str | Path) -> list[str] | None:
    """The tensor names in a safetensors file, read from its header alone (no tensor is read);
    None when ``path`` is no safetensors file."""
    try:
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if not 2 <= size <= 100_000_000:
                return None
            header = json.loads(handle.read(size))
    except (OSError, ValueError):
        return None
    if not isinstance(header, dict):
        return None
    return [key for key in header if key != "__metadata__"]


def check_pretrained(model_config, option: str = "model.pretrained",
                     name_option: str = "model.name") -> None:
    """``model.pretrained`` names weights this loader takes, checked from the files' names and
    headers before any model is built (reads no tensor): a one-line :class:`ConfigError` for a
    path that does not exist (with the one meant, when one is a typo away), a tag open_clip does
    not know for the model (with the tags it knows), a folder of no model, and the weights file
    of a transformers ``CLIPModel`` instead of its folder. ``model_config`` has ``name``,
    ``pretrained`` (and ``hf_model_dir``); ``option``/``name_option`` name the two in errors."""
    import difflib

    pretrained = str(model_config.pretrained or "")
    if not pretrained:
        return
    what = f"{option}={pretrained!r}"
    path = Path(pretrained)
    if path.is_dir():
        if not is_transformers_clip(path):
            try:
                pretrained_weights(pretrained)
            except ConfigError as err:
                raise ConfigError(str(err).replace("model.pretrained", option)) from None
        return
    if path.is_file():
        _check_weights_file(path, what, option)
        return
    import open_clip

    name = str(model_config.name)
    registered = resolve_model_config(name, getattr(model_config, "hf_model_dir", "") or "")[0]
    if open_clip.get_pretrained_cfg(registered.replace("/", "-"), pretrained):
        return  # a tag of the model: open_clip downloads (or finds cached) its weights
    tags = open_clip.list_pretrained_tags_by_model(registered.replace("/", "-"))
    near = near_path(pretrained)
    if looks_like_path(pretrained):
        hint = f" (did you mean {near!r}?)" if near else ""
        raise ConfigError(f"{what}: the path does not exist{hint}; name {PRETRAINED_FORMS}")
    close = difflib.get_close_matches(pretrained.lower().replace("-", "_"), tags, n=1, cutoff=0.6)
    hint = (f" (did you mean {close[0]!r}?)" if close else
            f" (did you mean {near!r}?)" if near else "")
    known = (f"its tags: {capped(tags, 8)}; name one of them or {PRETRAINED_FORMS}" if tags else
             f"open_clip has no pretrained tags for it; name {PRETRAINED_FORMS}")
    raise ConfigError(f"{what}{hint}: no such file or folder, and not a pretrained tag of "
                      f"{name_option}={name!r} ({known})")


def _check_weights_file(path: Path, what: str, option: str) -> None:
    """A weights file ``model.pretrained`` names: one that open_clip's loader reads (open_clip's
    tensor names), not a transformers ``CLIPModel``'s, which loads only with its folder."""
    folder = path.parent
    in_transformers = (is_transformers_clip(folder) and path.suffix in (".safetensors", ".bin"))
    names = safetensors_names(path) if path.suffix == ".safetensors" else None
    transformers_names = (bool(names) and any(n.startswith(TRANSFORMERS_TENSOR_PREFIXES)
                                              for n in names)
                          and not any(n.startswith("visual.") for n in names))  # open_clip's
    if in_transformers:
        raise ConfigError(f"{what}: a file, not a folder: the weights file of a transformers "
                          f"CLIPModel export (tensor names open_clip does not read; they load with "
                          f"the folder's config.json); give the folder holding it: "
                          f"{option}={str(folder)!r}")
    if transformers_names:
        raise ConfigError(f"{what}: holds a transformers CLIPModel's tensors (text_model.*, "
                          "vision_model.*), which load only from their CLIPModel folder with its "
                          f"config.json; give that folder as {option} (the one `vlcontrast export "
                          "--format transformers` wrote)")


def pretrained_weights(pretrained: str) -> Path | None:
    """The weights file when ``model.pretrained`` names a directory: a vlcontrast run or
    checkpoint directory (its ``model.pt``) or an open_clip export (``vlcontrast export --format
    open_clip``'s ``open_clip_model.safetensors``), found as every loader of a trained model finds
    it (:func:`~vlcontrast.checkpoints.resolve_model_files`); None for a tag or a file."""
    if not pretrained or not Path(pretrained).is_dir():
        return None
    try:
        folder = resolve_model_files(pretrained, "model.pretrained")
    except FileNotFoundError as err:
        inside = _model_folders(Path(pretrained))
        hint = (f"; it holds {', '.join(f'{p.name} ({kind})' for p, kind in inside[:4])}: name "
                f"one, e.g. model.pretrained={str(inside[0][0])}" if inside else "")
        raise ConfigError(f"model.pretrained={pretrained!r}: a directory, but not a vlcontrast run, "
                          "checkpoint or export, nor a transformers CLIPModel directory (no "
                          "model.pt, no checkpoints/latest, no open_clip_model.safetensors, no "
                          f"config.json of a CLIP model){hint}") from err
    return export_weights(folder) if is_export(folder) else folder / WEIGHTS_FILE


def _model_folders(parent: Path) -> list[tuple[Path, str]]:
    """The folders directly in ``parent`` that ``model.pretrained`` takes, with their kind (what
    to suggest when ``parent`` itself is none of them)."""
    found = []
    for folder in sorted(p for p in parent.iterdir() if p.is_dir()):
        kind = ("open_clip export" if is_export(folder) else
                "transformers CLIPModel" if is_transformers_clip(folder) else
                "vlcontrast run" if (folder / "checkpoints" / "latest").is_file() else
                "checkpoint" if (folder / WEIGHTS_FILE).is_file() else "")
        if kind:
            found.append((folder, kind))
    return found


def weights_model(path: Path) -> str:
    """The ``model.name`` that builds the model of the weights at ``path`` (a file or a directory)
    when the config they were saved with is beside them (a vlcontrast checkpoint's
    ``model_config.json``, an open_clip export's ``<model>.json``); '' when unknown."""
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    try:
        if is_export(folder):
            name = _export_meta(folder)["model_name"]
            config_file = folder / f"{name}.json"
        elif (folder / MODEL_CONFIG_FILE).is_file():
            name = json.loads((folder / MODEL_CONFIG_FILE).read_text())["model_name"]
            config_file = None
        else:
            return ""
        resolve_model_config(name)
        return str(name)
    except (OSError, ValueError, KeyError, TypeError):  # a name open_clip does not know
        return str(config_file) if config_file is not None and config_file.is_file() else ""


def does_not_fit(what: str, path: Path, model_name: str, err: BaseException | str) -> ConfigError:
    """The one-line error of weights at ``path`` that do not fit the model of ``model_name``,
    naming the right ``model.name`` when the weights' own config is known."""
    detail = err if isinstance(err, str) else fit_detail(err)
    source = weights_model(path)
    built = f" (model.name={model_name!r})" if model_name else ""
    fix = f", here model.name={source}" if source and source != model_name else ""
    return ConfigError(f"{what}: {path} does not fit this model{built}; model.name must be the "
                       f"checkpoint's model{fix} ({detail or type(err).__name__})")


def fit_detail(err: BaseException) -> str:
    """The reason in a loader's error, in one short line: torch's ``load_state_dict`` lists every
    missing and unexpected key and every size mismatch (9 KB for a transformers CLIPModel's
    tensors), kept to a few names and a count of each; any other error's last line."""
    import re

    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    parts, mismatches = [], []
    for line in lines:
        for label in ("Missing", "Unexpected"):
            if line.startswith(f"{label} key(s) in state_dict:"):
                parts.append(key_list(label.lower(), re.findall(r'"([^"]+)"', line)))
        if line.startswith("size mismatch for "):
            mismatches.append(line.rstrip("."))
    if mismatches:
        more = len(mismatches) - 1
        parts.append(mismatches[0] + (f" (and {more} more size mismatch"
                                      f"{'' if more == 1 else 'es'})" if more else ""))
    if parts:
        return "; ".join(parts)
    last = lines[-1] if lines else type(err).__name__
    return last if len(last) <= 300 else last[:300] + " ..."


def load_weights(model: torch.nn.Module, path: Path, what: str,
                 device: str | torch.device = "cpu", model_name: str = "") -> None:
    """Load a vlcontrast ``model.pt`` or an export's weights (safetensors, or tensors-only
    pickles: no code runs) into ``model`` (:func:`load_state`)."""
    load_state(model, read_weights(path, device), what, path, device, model_name=model_name)


def load_state(model: torch.nn.Module, state: dict[str, torch.Tensor], what: str, path: Path,
               device: str | torch.device = "cpu", model_name: str = "") -> None:
    """Load a state dict with open_clip's names into ``model``; ``path`` names its source and
    ``model_name`` the model's ``model.name`` (when it has one) in errors.

    Frozen batch norms (``lock_image_freeze_bn_stats``) have no ``num_batches_tracked``; a
    checkpoint and a model that differ only there still load.
    """
    state = {key: value.to(device) for key, value in state.items()}
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shape mismatches raise even when not strict
        raise does_not_fit(what, path, model_name, err) from err
    missing = [k for k in result.missing_keys if not k.endswith("num_batches_tracked")]
    # A distilled student's projection to the teacher's width (vlcontrast.distill) is a training
    # aid, not part of the model.
    unexpected = [k for k in result.unexpected_keys if not k.endswith("num_batches_tracked")
                  and not k.startswith("distill_projection.")]
    if missing or unexpected:
        raise does_not_fit(what, path, model_name, "; ".join(
            key_list(label, keys) for label, keys in (("missing", missing),
                                                      ("unexpected", unexpected)) if keys))


def lock_towers(model: torch.nn.Module, model_cfg) -> None:
    """``model.lock_image``/``model.lock_text``: open_clip's LiT locking, with clear errors.

    Locked parameters get ``requires_grad=False``: the optimizer never sees them (no moments),
    and autograd stops at a wholly locked tower, so its backward is never run.
    """
    from open_clip.hf_model import HFTextEncoder
    from open_clip.modified_resnet import ModifiedResNet

    if model_cfg.lock_image:
        groups = model_cfg.lock_image_unlocked_groups
        if groups and isinstance(model.visual, ModifiedResNet):
            raise ConfigError(f"model.lock_image_unlocked_groups={groups}: open_clip locks its ResNet "
                             "image towers whole; use 0 (or a ViT or timm tower)")
        model.lock_image_tower(unlocked_groups=groups,
                               freeze_bn_stats=model_cfg.lock_image_freeze_bn_stats)
    if model_cfg.lock_text:
        text = getattr(model, "text", None)
        if not model_cfg.lock_text_freeze_layer_norm and not isinstance(text, HFTextEncoder):
            raise ConfigError("model.lock_text_freeze_layer_norm=false: open_clip's own text tower "
                             "always freezes its layer norms with the locked blocks; only Hugging "
                             "Face text towers (model.hf_model_dir) can leave them trainable")
        model.lock_text_tower(unlocked_layers=model_cfg.lock_text_unlocked_layers,
                              freeze_layer_norm=model_cfg.lock_text_freeze_layer_norm)


def is_convolutional(tower: torch.nn.Module) -> bool:
    """True for ResNet-like image towers (batch norms), False for ViTs."""
    from torchvision.ops.misc import FrozenBatchNorm2d

    return any(isinstance(m, (torch.nn.BatchNorm2d, FrozenBatchNorm2d)) for m in tower.modules())


def use_channels_last(model: torch.nn.Module) -> bool:
    """Channels-last activations for a ResNet image tower: cuDNN's fast layout on tensor cores,
    and oneDNN's on the CPU (1.04-1.05x faster forward+backward for vlc-rn-tiny at batch 128 on the
    2-core CPU: ``python bench/bench_channels_last.py``).

    A pre-hook hands the tower its images in channels-last, and the convolutions follow the input's
    layout. The weights stay contiguous on purpose: DeepSpeed views every parameter as bytes for its
    initial broadcast (and as slices of flat buffers under ZeRO and bf16), which a channels-last
    weight refuses ("stride(-1) must be 1"). Returns whether the tower was converted.
    """
    visual = model.visual
    if not is_convolutional(visual):
        return False

    def to_channels_last(_module, args):
        images, *rest = args
        return (images.contiguous(memory_format=torch.channels_last), *rest)

    visual.register_forward_pre_hook(to_channels_last)
    return True


RANDOM_INIT_WARNING = "No pretrained weights loaded for model"
"""The start of open_clip's ``create_model`` warning when it was given no ``pretrained`` weights
("... Model initialized randomly."); misleading when vlcontrast loads weights right after."""


@contextmanager
def augment_applied():
    """Silence open_clip's "Unused augmentation cfg items" warning while it builds a training
    transform: it lists colour jitter and grayscale as unused although it applies them
    (:meth:`~vlcontrast.config.ModelConfig.check` refuses the options it would really drop)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Unused augmentation cfg items")
        yield


class _DropRandomInitWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(RANDOM_INIT_WARNING)


@contextmanager
def weights_loaded_afterwards():
    """Silence open_clip's "initialized randomly" warning (and only it) while a model is built
    whose weights are loaded right after. open_clip logs it on the root logger."""
    quiet = _DropRandomInitWarning()
    root = logging.getLogger()
    root.addFilter(quiet)
    try:
        yield
    finally:
        root.removeFilter(quiet)


def _export_meta(folder: Path) -> dict[str, Any]:
    """The ``model_config.json`` equivalent of an open_clip export: the model name is the stem of
    its ``<model_name>.json`` (``export_open_clip`` writes exactly one besides
    ``open_clip_config.json``), the config and logit initialisation from ``open_clip_config.json``."""
    model_cfg = dict(json.loads((folder / EXPORT_CONFIG_FILE).read_text())["model_cfg"])
    names = sorted(p.stem for p in folder.glob("*.json") if p.name != EXPORT_CONFIG_FILE)
    return {"model_name": names[0] if len(names) == 1 else folder.name,
            "model_cfg": model_cfg,
            "init_logit_scale": model_cfg.pop("init_logit_scale", math.log(1 / 0.07)),
            "init_logit_bias": model_cfg.pop("init_logit_bias", None)}


def read_model_config(folder: Path) -> dict[str, Any]:
    """A checkpoint's ``model_config.json`` (the model's name and open_clip config); a missing or
    damaged one is a one-line :class:`~vlcontrast.errors.CheckpointError` naming the checkpoint
    and the one before it."""
    from vlcontrast.checkpoints import incomplete_words, use_earlier
    from vlcontrast.errors import CheckpointError

    file = Path(folder) / MODEL_CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(f"{folder}: " + (incomplete_words(folder) or f"an incomplete "
                                               f"checkpoint (no {MODEL_CONFIG_FILE}); "
                                               f"{use_earlier(folder)}"))
    try:
        meta = json.loads(file.read_text())
        why = ("" if isinstance(meta, dict) and isinstance(meta.get("model_cfg"), dict)
               and isinstance(meta.get("model_name"), str)
               else "no model_name and model_cfg in it")
    except (OSError, UnicodeDecodeError, ValueError) as err:
        why = f"{type(err).__name__}: {err}"
    if why:
        raise CheckpointError(f"{file}: not a readable model config (truncated or corrupt: "
                              f"{why}); {use_earlier(folder)}")
    return meta


def load_model_from_checkpoint(path: str | Path, device: str | torch.device = "cpu",
                               what: str = "--checkpoint") -> ModelBundle:
    """Rebuild a model with its weights, in eval mode, from a vlcontrast run directory (its
    latest checkpoint), a checkpoint directory, a ``vlcontrast export`` directory (open_clip's
    layout) or a transformers ``CLIPModel`` directory.

    ``what`` names the argument in errors. Every form builds the model from an open_clip config
    and loads tensors only (safetensors, or ``torch.load(weights_only=True)``), so a checkpoint
    and its exports give the same model, transforms and tokenizer. A run directory whose
    checkpoint a training job deletes while it is read (``checkpoint.keep``) is resolved again,
    up to ``READ_RETRIES`` times, then refused in one line saying so."""
    from vlcontrast.checkpoints import READ_RETRIES, replaced_while_read, replaced_words
    from vlcontrast.errors import CheckpointError

    for tries in range(1, READ_RETRIES + 2):
        folder = resolve_model_files(path, what)
        try:
            return _load_model_folder(path, folder, device, what)
        except (OSError, CheckpointError):
            # A run directory's checkpoint deleted under the reader by the training job
            # writing that run (retention): resolved again, a bounded number of times.
            if not replaced_while_read(path, folder):
                raise
            if tries > READ_RETRIES:
                raise CheckpointError(replaced_words(path, folder, what, tries)) from None
    raise AssertionError("unreachable")


def _load_model_folder(path: str | Path, folder: Path, device: str | torch.device,
                       what: str) -> ModelBundle:
    """:func:`load_model_from_checkpoint` of the model folder ``path`` resolved to."""
    import open_clip

    state = None
    if is_transformers_clip(folder):
        from vlcontrast.models.transformers_clip import load_transformers_clip

        model_cfg, state, preprocess = load_transformers_clip(folder, what)
        meta = {"model_name": transformers_model_name(folder), "model_cfg": model_cfg,
                "init_logit_scale": float(state["logit_scale"]), "init_logit_bias": None,
                "preprocess": _preprocess_kwargs(preprocess)}
        weights = folder
    elif is_export(folder):
        meta, weights = _export_meta(folder), export_weights(folder)
    else:
        meta, weights = read_model_config(folder), folder / WEIGHTS_FILE
    registered = _register_config(meta["model_name"], meta["model_cfg"])
    kwargs: dict[str, Any] = {"init_logit_scale": meta.get("init_logit_scale", math.log(1 / 0.07))}
    if meta.get("init_logit_bias") is not None:
        kwargs["init_logit_bias"] = meta["init_logit_bias"]
    kwargs.update(meta.get("preprocess") or {})
    with weights_loaded_afterwards():
        model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
            registered, device=device, output_dict=True, pretrained_text=False, **kwargs)
    if state is not None:
        load_state(model, state, f"{what} {str(path)!r}", weights, device)
    else:
        load_weights(model, weights, f"{what} {str(path)!r}", device)
    model.eval()
    tokenizer = open_clip.get_tokenizer(registered)
    return ModelBundle(model, preprocess_train, preprocess_val, tokenizer, meta["model_name"], meta)


def load_pretrained_model(source: str | Path, pretrained: str = "", *,
                          device: str | torch.device = "cpu",
                          what: str = "model.pretrained") -> ModelBundle:
    """A model with its weights, in eval mode, from every form ``model.pretrained`` takes: the
    loader a teacher uses (``distill.teacher`` and ``distill.teacher_pretrained``).

    ``source`` a directory, ``pretrained`` empty: a vlcontrast run (its latest checkpoint), a
    checkpoint, a ``vlcontrast export`` directory or a transformers ``CLIPModel`` directory
    (:func:`load_model_from_checkpoint`). Otherwise ``source`` names the model as ``model.name``
    does (an open_clip name, a config shipped with vlcontrast, a model-config JSON) and
    ``pretrained`` is an open_clip tag or weights file, a vlcontrast run, checkpoint or open_clip
    export directory, or a ``CLIPModel`` directory whose config must be ``source``'s (empty: random weights).
    ``what`` names the option in errors.
    """
    import open_clip

    if not pretrained and Path(source).is_dir():
        return load_model_from_checkpoint(source, device, what)
    name, cfg = resolve_model_config(str(source))
    from types import SimpleNamespace

    check_pretrained(SimpleNamespace(name=str(source), pretrained=str(pretrained)), what)
    registered = _register_config(name, cfg)
    state, preprocess, weights = None, {}, None
    where = f"{what}={str(pretrained)!r}"
    if pretrained and is_transformers_clip(pretrained):
        state, preprocess = _transformers_start(str(pretrained), cfg, str(source))
    else:
        weights = pretrained_weights(str(pretrained))
    weights_after = state is not None or weights is not None
    with weights_loaded_afterwards() if weights_after or not pretrained else nullcontext():
        try:
            model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
                registered, pretrained=None if weights_after else (pretrained or None),
                device=device, output_dict=True, pretrained_text=False,
                **_preprocess_kwargs(preprocess))
        except (AssertionError, RuntimeError, KeyError) as err:
            if weights_after or not Path(pretrained).is_file():
                raise
            raise does_not_fit(where, Path(pretrained), str(source), err) from err
    if state is not None:
        load_state(model, state, where, Path(pretrained), device, model_name=str(source))
    elif weights is not None:
        load_weights(model, weights, where, device, model_name=str(source))
    model.eval()
    stored = {"model_name": name, "model_cfg": cfg}
    return ModelBundle(model, preprocess_train, preprocess_val, open_clip.get_tokenizer(registered),
                       name, stored)
