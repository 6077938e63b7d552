"""Checkpoint layout, the one resolver and the safe loader: the ground floor every reader shares.

Layout of one checkpoint directory (written by :class:`vlcontrast.train.checkpoint.Checkpointer`)::

    RUN/checkpoints/step_00000100/
        engine/              DeepSpeed save_checkpoint (model, optimizer, scheduler, loss scaler)
        model.pt             consolidated true-fp32 weights, open_clip's names and shapes
        model_config.json    open_clip model config and model name
        trainer_state.pt     the run-wide stateful objects (train state, loss state, EMA towers)
        rank_00000.pt ...    per-rank stateful objects: data-loader position and RNG states
        config.yaml          resolved run config
        universal/           engine/ as DeepSpeed's universal checkpoint, made at the first ZeRO
                             1-3 resume with another world size (:func:`universal_resume`)
    RUN/checkpoints/latest   name of the newest complete checkpoint

Training (resume), evaluation, export, the study, diagnostics and model loading all find
checkpoints with :func:`resolve_checkpoint` and read vlcontrast's files with :func:`load_file`,
which never unpickles code. It imports nothing of vlcontrast above :mod:`vlcontrast.errors`.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any, Iterator

import torch

from vlcontrast.errors import CheckpointError, ConfigError

WEIGHTS_FILE = "model.pt"
MODEL_CONFIG_FILE = "model_config.json"
EXPORT_WEIGHTS_FILE = "open_clip_model.safetensors"
EXPORT_CONFIG_FILE = "open_clip_config.json"
"""What ``vlcontrast export open_clip`` writes (beside ``<model_name>.json``); open_clip's own
``local-dir:`` and ``hf-hub:`` names (the safetensors file is the one they look for first)."""
EXPORT_PICKLED_WEIGHTS_FILE = "open_clip_pytorch_model.bin"
"""The weights of exports written before they were safetensors (a pickled state dict, read as
tensors only)."""


# --------------------------------------------------------------------------------------------
# finding checkpoints: the one resolver


LATEST = "latest"
COMPLETE_MARKER = "trainer_state.pt"
MODEL_FILES = (WEIGHTS_FILE, MODEL_CONFIG_FILE)
"""What evaluation, export and every other reader of a trained model need of a checkpoint."""


def resolve_checkpoint(path: str | Path, *, require: str = COMPLETE_MARKER,
                       usable: tuple[str, ...] = (), what: str = "", warn: bool = True,
                       action: str = "using") -> Path | None:
    """The checkpoint directory ``path`` names, or None when it names none.

    ``path`` may be a checkpoint directory itself (it counts when it holds ``require``:
    ``trainer_state.pt`` for a resumable checkpoint, ``model.pt`` for weights to evaluate), a
    ``checkpoints/`` directory or a run directory. Of a run, the checkpoint ``checkpoints/latest``
    names when it holds ``require``; when ``latest`` is missing, empty, names a folder that is not
    there or one without ``require`` (a damaged disk, a file removed by hand), the newest
    ``step_*`` that holds ``require`` and every file of ``usable``, with a one-line warning (rank
    0, once per process) naming what ``latest`` says and what is used: the policy of
    ``train.resume=latest`` (:func:`find_resume`) for evaluation and export too. ``what`` names the
    option in the warning (``--checkpoint 'runs/x'``), ``action`` what is done with it.
    """
    path = Path(path)
    if (path / require).is_file():
        return path
    folder = checkpoints_folder(path)
    if folder is None:
        return None
    return _latest_or_newest(folder, require, usable, what=what or str(path), warn=warn,
                             action=action, shown=str)


def _latest_or_newest(folder: Path, require: str, usable: tuple[str, ...], *, what: str,
                      warn: bool, action: str, shown) -> Path | None:
    """The one fallback of :func:`resolve_checkpoint` and :func:`find_resume`: the checkpoint
    ``folder/latest`` names when it holds ``require`` and ``usable``; else the newest ``step_*``
    that holds them all, with one warning (``what``: the option, ``shown``: how the checkpoint
    used is named). ``step_*`` folders are only looked into when ``latest`` is no good, newest
    first, up to the first usable one: a run that keeps many checkpoints on a network file
    system pays for one or two, not for all."""
    found, problem = latest_state(folder, require)
    if found is not None:
        lacking = [name for name in usable if not (found / name).is_file()]
        if not lacking:
            return found
        fallback = newest_with(folder, (require, *usable))
        if fallback is None:  # none better: its reader names what it lacks
            return found
        problem = (f"{folder.name}/{LATEST} names {found.name!r}, which is incomplete (no "
                   f"{' and no '.join(lacking)})")
    else:
        fallback = newest_with(folder, (require, *usable))
    if fallback is not None and warn:
        _warn_once(f"{what}: {problem}; {action} the newest "
                   f"{'complete checkpoint' if not usable else _holding((require, *usable))}, "
                   f"{shown(fallback)}", key=str(fallback))
    return fallback


def checkpoints_folder(path: str | Path) -> Path | None:
    """The ``checkpoints/`` folder of a run directory ``path`` (or ``path`` itself when it is one:
    it holds ``latest`` or ``step_*`` folders); None for any other folder."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    if path.is_dir() and ((path / LATEST).exists() or next(_newest_first(path), None)):
        return path
    return None


def latest_state(folder: Path, require: str = COMPLETE_MARKER) -> tuple[Path | None, str]:
    """(the checkpoint ``folder/latest`` names when it holds ``require``, else None; what is
    wrong with ``latest`` in words, ``checkpoints/latest is empty``, '' when nothing is)."""
    latest = Path(folder) / LATEST
    said = f"{Path(folder).name}/{LATEST}"
    if not latest.is_file():
        return None, f"{said} is missing"
    try:
        named = latest.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        return None, f"{said} cannot be read ({type(err).__name__}: {err})"
    if not named:
        return None, f"{said} is empty"
    target = Path(folder) / named
    if "/" in named or named in (".", "..") or not target.is_dir():
        return None, f"{said} names {named!r}, which does not exist"
    if not (target / require).is_file():
        return None, f"{said} names {named!r}, which is incomplete (no {require})"
    return target, ""


def _newest_first(folder: Path) -> Iterator[Path]:
    """The ``step_*`` checkpoint folders in ``folder``, newest first (a ``.tmp`` folder of an
    interrupted write is none), told apart by one listing of ``folder``: nothing inside a
    checkpoint is looked at, so a reader that stops at the first it can use touches no other."""
    try:
        with os.scandir(folder) as listing:
            entries = [entry for entry in listing
                       if entry.name.startswith("step_") and not entry.name.endswith(".tmp")]
    except OSError:  # no folder there (or not one): no checkpoints
        return
    for entry in sorted(entries, key=lambda entry: entry.name, reverse=True):
        try:
            is_dir = entry.is_dir()
        except OSError:
            continue
        if is_dir:
            yield Path(folder) / entry.name


def _step_folders(folder: Path) -> list[Path]:
    """The ``step_*`` checkpoint folders in ``folder``, oldest first (a ``.tmp`` folder of an
    interrupted write is none)."""
    return list(_newest_first(folder))[::-1]


def newest_with(folder: Path, files: tuple[str, ...], before: str = "") -> Path | None:
    """The newest ``step_*`` folder in ``folder`` that holds every file of ``files`` (and, with
    ``before``, sorts before that name), or None. Newest first, stopping at the first found."""
    for step in _newest_first(folder):
        if before and step.name >= before:
            continue
        if all((step / name).is_file() for name in files):
            return step
    return None


def _holding(files: tuple[str, ...]) -> str:
    return f"checkpoint that holds {' and '.join(files)}"


_warned: set[str] = set()


def _warn_once(message: str, key: str = "") -> None:
    """A warning on rank 0 (``RANK`` of a launcher, else this process), once per process: a
    command resolves its checkpoint more than once (checked first, then loaded). ``key`` tells
    apart messages that read alike (another run's checkpoint of the same name)."""
    import logging

    said = f"{key}\n{message}"
    if said in _warned or os.environ.get("RANK", "0") not in ("", "0"):
        return
    _warned.add(said)
    logging.getLogger(__name__).warning(message)


def no_model_words(path: str | Path) -> str:
    """Why a run directory (or ``checkpoints/`` folder) ``path`` gives no model, in words (what its
    ``latest`` says and what its checkpoint folders lack), or '' when ``path`` is no run."""
    folder = checkpoints_folder(path)
    if folder is None:
        return ""
    _, problem = latest_state(folder, WEIGHTS_FILE)
    every = _step_folders(folder)
    if not every:
        return f"{problem} and {folder.name}/ holds no checkpoint folder (step_*)"
    span = every[-1].name if len(every) == 1 else f"{every[0].name} ... {every[-1].name}"
    return (f"{problem}, and none of its {len(every)} checkpoint folder(s) ({span}) holds "
            f"{' and '.join(MODEL_FILES)}")


def incomplete_words(path: str | Path, files: tuple[str, ...] = MODEL_FILES) -> str:
    """``an incomplete checkpoint (no model.pt); use the checkpoint before it, ...`` for a
    ``step_*`` folder ``path`` without a file of ``files``; '' for any other folder."""
    path = Path(path)
    lacking = [name for name in files if not (path / name).is_file()]
    if not path.name.startswith("step_") or not path.is_dir() or not lacking:
        return ""
    return f"an incomplete checkpoint (no {' and no '.join(lacking)}); {use_earlier(path, files)}"


def use_earlier(path: str | Path, files: tuple[str, ...] = MODEL_FILES) -> str:
    """The fix for a checkpoint ``path`` that is incomplete or damaged, for a reader of its
    model: the checkpoint before it (holding ``files``), named, or what else to do."""
    if not Path(path).name.startswith("step_"):
        return "restore the file from a copy"
    earlier = newest_with(Path(path).parent, files, before=Path(path).name)
    if earlier is not None:
        return f"use the checkpoint before it, {earlier}"
    return "no checkpoint before it holds one: restore the file from a copy, or train again"


def resolve_weights(path: str | Path, what: str = "--checkpoint") -> Path:
    """A checkpoint directory with weights (``model.pt``) from a run directory (its latest, or
    the newest usable checkpoint with a warning: :func:`resolve_checkpoint`), a ``checkpoints/``
    directory, or itself; raises ``FileNotFoundError`` naming ``what``."""
    found = resolve_checkpoint(path, require=WEIGHTS_FILE, usable=(MODEL_CONFIG_FILE,),
                               what=f"{what} {str(path)!r}")
    if found is None:
        forms = "a run directory or a checkpoint directory (RUN/checkpoints/step_*)"
        if Path(path).is_file():
            raise FileNotFoundError(f"{what} {str(path)!r}: a file, not a folder; give the "
                                    f"folder holding it: {what} {str(Path(path).parent)!r} "
                                    f"({forms})")
        if not Path(path).exists():
            raise FileNotFoundError(f"{what} {str(path)!r}: no such folder; give {forms}")
        if is_export(path) or is_transformers_clip(path):
            source = _exported_from(path)
            raise FileNotFoundError(f"{what} {str(path)!r}: a `vlcontrast export` or transformers "
                                    f"CLIPModel directory, not a run; give {forms}"
                                    + (f", e.g. the one it was exported from: {what} "
                                       f"{source!r}" if source else ""))
        _no_model(path, what, f"give another run or {forms.partition(' or ')[2]}")
        raise FileNotFoundError(f"{what} {str(path)!r}: no {WEIGHTS_FILE} there and no "
                                "checkpoints/latest (expected a run directory or a checkpoint "
                                "directory)")
    return found


def _no_model(path: str | Path, what: str, give: str) -> None:
    """Raise the one-line error of a run (what its ``latest`` says, what its checkpoints lack) or
    of an incomplete checkpoint (the one before it) that gives no model; nothing for other
    folders."""
    words = no_model_words(path)
    if words:
        raise FileNotFoundError(f"{what} {str(path)!r}: {words}; {give}")
    words = incomplete_words(path)
    if words:
        raise FileNotFoundError(f"{what} {str(path)!r}: {words}")


def _exported_from(path: str | Path) -> str:
    """The checkpoint a ``vlcontrast export`` directory was written from (its config's
    provenance), or ``""``."""
    import json

    for name in (EXPORT_CONFIG_FILE, "config.json"):
        try:
            source = json.loads((Path(path) / name).read_text())["vlcontrast"]["checkpoint"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(source, str) and source:
            return source
    return ""


TRANSFORMERS_CONFIG_FILE = "config.json"
TRANSFORMERS_MODEL_TYPE = "clip"


def is_transformers_clip(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a transformers ``CLIPModel`` (its ``config.json``
    says ``model_type: clip``), e.g. ``vlcontrast export --format transformers``'s."""
    import json

    config = Path(path) / TRANSFORMERS_CONFIG_FILE
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("model_type") == TRANSFORMERS_MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def export_weights(path: str | Path) -> Path | None:
    """The weights file of an open_clip export directory (safetensors, else an older export's
    pickle), or None."""
    for name in (EXPORT_WEIGHTS_FILE, EXPORT_PICKLED_WEIGHTS_FILE):
        if (Path(path) / name).is_file():
            return Path(path) / name
    return None


def is_export(path: str | Path) -> bool:
    """Whether ``path`` is an open_clip export (``vlcontrast export open_clip``'s directory)."""
    return export_weights(path) is not None and (Path(path) / EXPORT_CONFIG_FILE).is_file()


def read_weights(path: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A state dict from a ``.safetensors`` file, or from a pickled one (``model.pt``, an older
    export's ``.bin``) read by :func:`load_file`: tensors only, never code (a file holding code
    is a one-line :class:`CheckpointError`)."""
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file as load_safetensors

        return load_safetensors(str(path), device=str(device))
    return load_file(Path(path), map_location=device)


def resolve_model_files(path: str | Path, what: str = "--checkpoint") -> Path:
    """The directory holding a model's weights: an export or a transformers ``CLIPModel``
    directory as it is, else as :func:`resolve_weights` finds it
    (run directory -> its latest checkpoint, or the newest usable one with a warning; a
    ``checkpoints/`` directory; a checkpoint); raises ``FileNotFoundError`` naming ``what`` and
    the accepted forms."""
    if is_export(path) or is_transformers_clip(path):
        return Path(path)
    found = resolve_checkpoint(path, require=WEIGHTS_FILE, usable=(MODEL_CONFIG_FILE,),
                               what=f"{what} {str(path)!r}")
    forms = ("a run directory, a checkpoint directory, a `vlcontrast export` directory or a "
             "transformers CLIPModel directory")
    if found is None and Path(path).is_file():
        raise FileNotFoundError(f"{what} {str(path)!r}: a file, not a folder; give the folder "
                                f"holding it: {what} {str(Path(path).parent)!r} ({forms})")
    if found is None and not Path(path).exists():
        raise FileNotFoundError(f"{what} {str(path)!r}: no such folder; give {forms}")
    if found is None:
        _no_model(path, what, f"give another run, {forms.partition(', ')[2]}")
        raise FileNotFoundError(f"{what} {str(path)!r}: no {WEIGHTS_FILE}, no checkpoints/latest "
                                f"and no {EXPORT_WEIGHTS_FILE} there (expected {forms})")
    return found


READ_RETRIES = 3
"""How many times a reader given a run directory resolves its checkpoint again when the one it
resolved vanished while it read it (a training job's retention, ``checkpoint.keep``, removed it:
:func:`replaced_while_read`)."""


def replaced_while_read(path: str | Path, found: Path) -> bool:
    """Whether the checkpoint ``found``, which ``path`` resolved to, is gone (or lost its
    ``model.pt``) and ``path`` named it only through a run's ``latest`` or its newest checkpoint
    (a run directory or a ``checkpoints/`` folder, not the checkpoint folder itself): a training
    job writing that run replaced it since, and resolving ``path`` again finds its successor."""
    if Path(found).resolve() == Path(path).resolve():
        return False
    return not (Path(found) / WEIGHTS_FILE).is_file()


def replaced_words(path: str | Path, found: Path, what: str, tries: int) -> str:
    """The one-line error of a reader whose checkpoint of a run directory vanished under it
    ``tries`` times in a row."""
    return (f"{what} {str(path)!r}: the checkpoint it named, {Path(found).name}, was deleted while "
            f"being read ({tries} time(s) in a row): the training job writing that run replaced it "
            "with a newer one (checkpoint.keep); read it again, or name a checkpoint that training "
            "keeps (a copy, or one kept by a larger checkpoint.keep)")


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint ``root/latest`` names (``root`` is a ``checkpoints/`` directory),
    or None: no fallback (:func:`resolve_checkpoint` has that)."""
    return latest_state(Path(root), COMPLETE_MARKER)[0]


def complete_checkpoints(root: Path) -> tuple[list[Path], list[Path]]:
    """``(complete, every)`` ``step_*`` checkpoint directories under ``root``, oldest first (a
    ``.tmp`` folder of an interrupted write is neither)."""
    every = _step_folders(root)
    return [p for p in every if (p / COMPLETE_MARKER).is_file()], every


def find_resume(resume: str, output_dir: Path, *, warn: bool = True) -> Path | None:
    """The checkpoint directory named by ``train.resume``. ``latest`` (or a run directory): the
    one ``checkpoints/latest`` names; when that is missing, empty, dangling or incomplete (a
    damaged disk, a file removed by hand), the newest complete ``step_*``, with a warning saying
    which (unless ``warn`` is false; once per process): the fallback of
    :func:`resolve_checkpoint`, which a run directory given as ``resume`` goes through too;
    none when the run has no checkpoint (a fresh start). Checkpoint folders of which none is
    complete are an error, never a fresh start over them (its checkpoints would overwrite, and
    retention delete, theirs). A run resolves it once (``train()``'s preflight) and passes the
    path on."""
    if not resume:
        return None
    if resume == "latest":
        root = Path(output_dir) / "checkpoints"
        found = _latest_or_newest(root, COMPLETE_MARKER, (), what="train.resume=latest",
                                  warn=warn, action="resuming from", shown=lambda p: p.name)
        if found is not None:
            return found
        every = _step_folders(root)
        if every:
            raise ConfigError(f"train.resume=latest: {root} holds {len(every)} checkpoint "
                              f"folder(s) ({every[-1].name} ...) and none is complete (no "
                              f"{COMPLETE_MARKER}); nothing to resume from: move them aside, or "
                              "give another output_dir")
        return None
    found = resolve_checkpoint(resume, what=f"train.resume={resume!r}", warn=warn,
                               action="resuming from")
    if found is None:
        path = Path(resume)
        forms = ("give train.resume=latest (this output_dir's newest checkpoint), a run directory "
                 "or a checkpoint directory (RUN/checkpoints/step_*)")
        if path.is_file():
            raise FileNotFoundError(f"train.resume={resume!r}: a file, not a folder; give the "
                                    f"folder holding it, train.resume={str(path.parent)!r}, or "
                                    f"{forms.removeprefix('give ')}")
        if not path.exists():
            case = "; did you mean train.resume=latest?" if resume.lower() == "latest" else ""
            raise FileNotFoundError(f"train.resume={resume!r}: no such folder; {forms}{case}")
        siblings = complete_checkpoints(path.parent if path.name.startswith("step_") else
                                        path / "checkpoints")[0]
        hint = (f"; the newest complete one there is {str(siblings[-1])!r}" if siblings
                else f"; {forms}")
        raise FileNotFoundError(f"train.resume={resume!r}: {resume} is not a complete checkpoint "
                                f"(no {COMPLETE_MARKER}) nor a run directory with one{hint}")
    return found


def earlier_checkpoint(path: Path, files: tuple[str, ...] = (COMPLETE_MARKER,)) -> Path | None:
    """The newest checkpoint written before ``path`` beside it that holds ``files`` (complete, by
    default: what to resume from when ``path`` turns out damaged)."""
    return newest_with(Path(path).parent, files, before=Path(path).name)


def damaged_fix(path: Path) -> str:
    """What to do about a complete checkpoint with a file missing: resume from the one before it
    (named when there is one), or start a new run from its weights."""
    earlier = earlier_checkpoint(path)
    before = f"resume from the one before it (train.resume={earlier})" if earlier else \
        "restore the file"
    return f"{before}, or start a new run from its weights (model.pretrained={path})"


RESUME_MUST_MATCH = ("model.name", "loss.name")
"""Config keys whose value a resumed run must share with the checkpoint (its weights' shapes, its
loss's state)."""

PARAMETER_SET_KEYS = ("model.name", "model.lock_image", "model.lock_image_unlocked_groups",
                      "model.lock_image_freeze_bn_stats", "model.lock_image_features",
                      "model.lock_text", "model.lock_text_unlocked_layers",
                      "model.lock_text_freeze_layer_norm", "distill.teacher",
                      "distill.teacher_features", "distill.kind", "distill.projection",
                      "optim.weight_decay", "optim.temperature_lr", "deepspeed.zero_stage",
                      "train.precision")
"""Config keys that can change the parameters the optimizer trains, or their groups and order
(what is locked, a distillation projection, the decay and temperature groups, their alignment):
named when a checkpoint's optimizer state does not fit this run's parameters
(:func:`parameter_set_changes`)."""


def parameter_set_changes(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """``key: saved value -> this run's`` for each :data:`PARAMETER_SET_KEYS` key whose value in
    the checkpoint's ``config.yaml`` (``saved``) differs from this run's (``current``)."""
    if not saved:
        return []
    changed = []
    for key in PARAMETER_SET_KEYS:
        was, now = _value(saved, key), _value(current, key)
        if was is not None and was != now:
            changed.append(f"{key}={_yaml_word(was)} there, {_yaml_word(now)} now")
    return changed


def _yaml_word(value: Any) -> str:
    """A config value as it is written on the command line (``true``, ``0.1``, ``''``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) and not value else str(value)


_ZERO_FORMATS = {0: "ZeRO 0", 1: "ZeRO 1-2", 2: "ZeRO 1-2", 3: "ZeRO 3"}
_PARAMETERS = {"bf16": "bf16", "fp16": "fp16"}  # fp32 and amp_bf16 keep fp32 parameters


def engine_format(zero_stage: Any, precision: Any) -> str:
    """The layout of the optimizer state DeepSpeed writes for a ZeRO stage and a precision:
    stages 1 and 2 share one, as do fp32 and amp_bf16 (fp32 parameters); any two runs of one
    format can resume each other's checkpoints, no two of different formats can."""
    return (f"{_ZERO_FORMATS.get(zero_stage, f'ZeRO {zero_stage}')}, "
            f"{_PARAMETERS.get(precision, 'fp32')} parameters")


def check_resume_config(path: Path | None, resume: str, current: dict[str, Any]) -> None:
    """Before any heavy work: the checkpoint ``path`` (what ``train.resume=resume`` names, from
    :func:`find_resume`) was written with this run's :data:`RESUME_MUST_MATCH` values, in an
    optimizer-state format this run reads (:func:`engine_format`), as its ``config.yaml`` says
    (``current`` is the run's config as a nested dict). Another world size is resumed (ZeRO 0
    as it is, ZeRO 1-3 through a universal checkpoint, :func:`universal_resume`). A one-line
    ConfigError names the keys, both values and the fix. A checkpoint without ``config.yaml``
    (removed, or copied without it: vlcontrast writes one into every checkpoint) is refused the
    same way, rather than resumed unchecked."""
    if path is None:
        return
    saved = saved_config(path)
    if saved is None:
        raise ConfigError(f"{path / 'config.yaml'}: missing, so this run cannot check that it "
                          "resumes the checkpoint with its model, loss, optimizer-state format "
                          "and world size (every checkpoint vlcontrast writes holds one); "
                          f"{_missing_config_fix(path)}")

    weights_fix = f"start a new run from its weights with model.pretrained={path}"
    for key in RESUME_MUST_MATCH:
        was, now = _value(saved, key), _value(current, key)
        if was is not None and was != now:
            fix = (f"resume with {key}={was} (its {path / 'config.yaml'})" if key == "model.name"
                   else f"resume with {key}={was} (its {path / 'config.yaml'}), or {weights_fix}")
            raise ConfigError(f"train.resume={resume!r}: {path} was written with {key}={was!r}, "
                              f"this run has {key}={now!r}; {fix}")
    keys = ("deepspeed.zero_stage", "train.precision")
    was, now = [_value(saved, k) for k in keys], [_value(current, k) for k in keys]
    if None not in was and engine_format(*was) != engine_format(*now):
        differ = [i for i in range(len(keys)) if was[i] != now[i]]

        def setting(values: list[Any], sep: str = ", ") -> str:
            return sep.join(f"{keys[i]}={values[i]}" for i in differ)

        raise ConfigError(
            f"train.resume={resume!r}: {path} was written with {setting(was)} "
            f"({engine_format(*was)}), this run has {setting(now)} ({engine_format(*now)}), and "
            f"DeepSpeed lays out their optimizer states differently; resume with "
            f"{setting(was, ' ')} (stages 1 and 2 read each other's checkpoints, as do fp32 and "
            f"amp_bf16), or {weights_fix}")


def _missing_config_fix(path: Path) -> str:
    """What to do about the checkpoint ``path`` without its ``config.yaml``: the run folder's
    own copy when there is one (the settings of the run's last start, which resumed with the same
    model, loss and optimizer-state format), the checkpoint before it, or a new run."""
    run_config = path.parent.parent / "config.yaml"
    options = [f"copy {run_config} there if that run wrote this checkpoint"
               if path.parent.name == "checkpoints" and run_config.is_file()
               else "restore it from a copy"]
    earlier = earlier_checkpoint(path)
    if earlier is not None:
        options.append(f"resume from the one before it (train.resume={earlier})")
    options.append(f"start a new run from its weights (model.pretrained={path})")
    return ", ".join(options[:-1]) + f", or {options[-1]}"


def _value(config: dict[str, Any], key: str) -> Any:
    section, name = key.split(".")
    return (config.get(section) or {}).get(name)


def saved_config(path: Path | None) -> dict[str, Any] | None:
    """The checkpoint's ``config.yaml`` as a dict, or None when there is none (removed by hand:
    :func:`check_resume_config` refuses to resume such a checkpoint). One that cannot be read is
    a one-line ConfigError naming it: the resume's checks (model and loss, the optimizer-state
    format, another world size) are made from it, and a resume without them could continue
    another loss's state or load DeepSpeed's ZeRO partitions for the wrong number of ranks
    without a word."""
    import yaml

    if path is None or not (path / "config.yaml").is_file():
        return None
    file = path / "config.yaml"
    try:
        saved = yaml.safe_load(file.read_text())
        why = "" if isinstance(saved, dict) else f"it holds a {type(saved).__name__}, not settings"
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
        why = f"{type(err).__name__}: {first[:200]}"
    if why:
        raise ConfigError(f"{file}: unreadable ({why}), so this run cannot check that it resumes "
                          "the checkpoint with its model, loss, optimizer-state format and world "
                          f"size; {damaged_fix(path)}")
    return saved


UNIVERSAL_STAGES = (1, 2, 3)
"""ZeRO stages whose optimizer state DeepSpeed splits over the ranks that wrote it. Their
checkpoints resume with another world size through DeepSpeed's universal checkpoint
(``deepspeed.checkpoint.ds_to_universal``, ``checkpoint.load_universal``): all three, fp32 and
bf16, with DeepSpeed 0.19 (tests/train/test_universal_resume.py)."""


def written_by_ranks(path: Path) -> int:
    """How many ranks wrote the checkpoint ``path`` (its ``rank_*.pt`` files; 0: none there)."""
    return len(list(Path(path).glob("rank_*.pt")))


def universal_resume(path: Path | None, world_size: int) -> bool:
    """Whether resuming the checkpoint ``path`` with ``world_size`` ranks goes through a universal
    checkpoint: its ``config.yaml`` says ZeRO 1-3 (optimizer state partitioned by rank) and
    another number of ranks wrote it."""
    saved = saved_config(path)
    if path is None or saved is None:
        return False
    written_by = written_by_ranks(path)
    return (_value(saved, "deepspeed.zero_stage") in UNIVERSAL_STAGES
            and written_by not in (0, world_size))


# --------------------------------------------------------------------------------------------
# safe files


def save_file(obj: Any, path: Path) -> None:
    """``torch.save`` (one place, so a test can simulate a full disk)."""
    torch.save(obj, path)


def load_file(path: Path, map_location: Any = "cpu", *, fix: str = "",
              kind: str = "checkpoint file") -> Any:
    """``torch.load(weights_only=True)``: tensors and plain containers, never code.

    A file that cannot be read is a one-line :class:`CheckpointError` naming it and ``fix`` (by
    default the checkpoint before it, :func:`use_earlier`): a damaged file (empty, truncated,
    overwritten) says so, and only a sound pickle that names classes (a pickled object) is
    refused as one. torch's own advice (``weights_only=False``) is never passed on. ``kind``
    names the file in that line (``not a readable checkpoint file``)."""
    path = Path(path)
    return _load_safely(path, map_location, fix or (lambda: use_earlier(path.parent, (path.name,))),
                        kind=kind, what="it holds a pickled Python object",
                        why="which could run code when loaded. vlcontrast writes only tensors and "
                            "plain containers here; a file written by another program (or an "
                            "older vlcontrast) is not trusted")


def _load_safely(path: Path, map_location: Any, fix, *, what: str, why: str,
                 allowed: frozenset[str] = frozenset(), mmap: bool = False,
                 kind: str = "checkpoint file") -> Any:
    """``torch.load(weights_only=True)`` of ``path`` with the classes named in ``allowed`` let
    through, every failure but a missing or forbidden file a one-line CheckpointError: ``what``
    and ``why`` say what a refused pickle holds (its names in between), ``fix`` (a string, or a
    function making one only when needed) ends the line."""
    classes = [_named_class(name) for name in sorted(allowed)]
    try:
        with torch.serialization.safe_globals(classes):
            return torch.load(path, map_location=map_location, weights_only=True,
                              **({"mmap": True} if mmap and zipfile.is_zipfile(path) else {}))
    except OSError as err:
        # A missing file or a permission: the caller's FileNotFoundError and fixes. A zip
        # archive cut short (from about 1 to 64 KB) makes torch's reader seek before its start.
        if err.errno != errno.EINVAL or not path.is_file():
            raise
        error: BaseException = err
    except Exception as err:  # noqa: BLE001 - sorted below; anything else is raised as it was
        error = err
    fix = fix if isinstance(fix, str) else fix()
    named = [name for name in _pickled_objects(path, error) if name not in allowed]
    if named:
        raise CheckpointError(
            f"{path}: refused to load: {what} ({', '.join(named[:3])}"
            f"{' ...' if len(named) > 3 else ''}), {why}; {fix}") from None
    damage = _damage(path, error)
    if damage is None:
        raise error
    raise CheckpointError(f"{path}: not a readable {kind} ({damage}); {fix}") from None


def _named_class(name: str) -> Any:
    import importlib

    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([A-Za-z_][\w.]*) was not an allowed global")
_NAME = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+")


def _pickled_objects(path: Path, err: BaseException) -> list[str]:
    """The classes and functions a sound pickle in ``path`` names beyond what
    ``weights_only=True`` allows, or [] when ``err`` is no such refusal (a damaged file).

    A torch zip file's pickle is scanned whole without building anything
    (``get_unsafe_globals_in_checkpoint``: a truncated or overwritten one fails that scan); an
    older torch file (no zip) is named by torch's refusal itself. Random bytes read as a pickle
    stop at an opcode the unpickler does not know ("Unsupported operand"), or at a "global" whose
    name is not one."""
    if not isinstance(err, pickle.UnpicklingError):
        return []
    if zipfile.is_zipfile(path):
        try:
            named = list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except Exception:  # noqa: BLE001 - a pickle that cannot be scanned is damaged
            return []
    else:
        named = _GLOBAL.findall(str(err))
    return sorted(name for name in set(named) if _NAME.fullmatch(name))


_ZIP_START = b"PK\x03\x04"


def _damage(path: Path, err: BaseException) -> str | None:
    """What is wrong with a file torch could not load, in words (``empty``, ``truncated or
    corrupt: ...``), or None when the file is sound and ``err`` has another cause (a
    ``map_location`` this process cannot use)."""
    try:
        size = path.stat().st_size
    except OSError:
        size = -1
    if size == 0:
        return "an empty file"
    if isinstance(err, OSError) and not zipfile.is_zipfile(path):
        try:
            with open(path, "rb") as file:
                cut = file.read(len(_ZIP_START)) == _ZIP_START
        except OSError:
            cut = False
        if cut:
            return "truncated: a torch archive without its end"
    if isinstance(err, (EOFError, pickle.UnpicklingError)):
        reason = re.search(r"Unsupported operand \d+", str(err))
        return ("truncated or corrupt" + (f": {reason.group(0)}" if reason else
                                          f": {type(err).__name__}" if isinstance(err, EOFError)
                                          else ""))
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except Exception:  # noqa: BLE001 - an archive that cannot be read through is damaged
            bad = "?"
        if bad is None:
            return None
    first = str(err).split(". ")[0].strip().splitlines()
    detail = first[0][:200] if first else type(err).__name__
    return f"truncated or corrupt: {detail}"


DEEPSPEED_GLOBALS = frozenset({
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
})
"""The classes DeepSpeed's own checkpoint files name besides tensors and plain containers (ZeRO
0-3, fp32/bf16/fp16; measured with ``torch.serialization.get_unsafe_globals_in_checkpoint``)."""


def check_engine_files(folder: Path, fix: str = "") -> None:
    """Refuse DeepSpeed's files in ``folder`` and below (a universal checkpoint keeps one folder
    per parameter) when their pickles name anything else.

    DeepSpeed loads its files itself with ``torch.load(weights_only=False)``, which would call
    whatever a pickle names. Scanning the pickles first (no object is built) and accepting only
    ``torch.load(weights_only=True)``'s own types plus :data:`DEEPSPEED_GLOBALS` means that what
    DeepSpeed then unpickles can construct those classes and nothing else. ``fix`` ends the error
    of a file that cannot be read (the checkpoint before it).
    """
    for path in sorted(Path(folder).rglob("*.pt")):
        try:
            named = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except Exception as err:  # noqa: BLE001 - any unreadable file is refused the same way
            first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
            raise CheckpointError(f"{path}: refused to load: not a readable torch checkpoint "
                                  f"({type(err).__name__}: {first.split('. ')[0][:200]})"
                                  + (f"; {fix}" if fix else "")) from None
        unexpected = sorted(named - DEEPSPEED_GLOBALS)
        if unexpected:
            raise CheckpointError(
                f"{path}: refused to load: DeepSpeed would unpickle it with weights_only=False "
                f"and it names {unexpected}, which DeepSpeed's checkpoints do not contain; "
                "loading it could run code. Was this directory written by vlcontrast?")


def load_engine_file(path: Path, map_location: Any = "cpu", *, fix: str = "",
                     mmap: bool = True) -> Any:
    """A DeepSpeed file read as :func:`load_file` reads vlcontrast's: ``weights_only=True``, with
    :data:`DEEPSPEED_GLOBALS`' classes allowed besides tensors and plain containers. A file that
    names anything else, or that cannot be read, is one line naming it, what it names and ``fix``
    (by default: for ``universal/``, convert it again; else the checkpoint before it)."""
    path = Path(path)
    return _load_safely(path, map_location, fix or (lambda: engine_fix(path)),
                        what="it holds a pickled Python object",
                        why="which DeepSpeed's checkpoints do not contain and which could run code "
                            "when loaded; a file written by another program is not trusted",
                        allowed=DEEPSPEED_GLOBALS, mmap=mmap)


def engine_fix(path: Path) -> str:
    """What to do about a damaged or refused file of a checkpoint's ``engine/`` or
    ``universal/`` (``path``, a file or a folder there): a universal checkpoint is made again from
    ``engine/`` once deleted; else the checkpoint before it, or a new run from its weights."""
    path = Path(path)
    step = next((p for p in (path, *path.parents) if p.name.startswith("step_")), None)
    if step is None:
        return "restore the file from a copy"
    parts = path.relative_to(step).parts
    again = (f"delete {step / parts[0]} (the next resume converts {step.name}/engine again), or "
             if parts and parts[0] == "universal" else "")
    return again + damaged_fix(step)


def missing_engine_file(folder: Path, rank: int) -> Path | None:
    """The file of ``folder`` (a checkpoint's ``engine/``) that rank ``rank`` will read and that
    is not there, or None. DeepSpeed writes one model-states file (``mp_rank_00_model_states.pt``;
    ZeRO 3: one per rank) and, under ZeRO 1-3, one optimizer partition per rank (``bf16_`` in
    front under bf16). A rank whose file is missing would fail alone inside DeepSpeed's load while
    the others wait in its collectives: the caller agrees on this first."""
    folder = Path(folder)
    own = f"zero_pp_rank_{rank}_mp_rank_00"
    if any(folder.glob("*zero_pp_rank_*_optim_states.pt")) and not any(
            folder.glob(f"*{own}_optim_states.pt")):
        prefix = "bf16_" if any(folder.glob("bf16_zero_pp_rank_*")) else ""
        return folder / f"{prefix}{own}_optim_states.pt"
    if any(folder.glob("zero_pp_rank_*_model_states.pt")):
        expected = folder / f"{own}_model_states.pt"
    else:
        expected = folder / "mp_rank_00_model_states.pt"
    return None if expected.is_file() else expected


# --------------------------------------------------------------------------------------------
# sizes


BYTES_PER_PARAMETER = 20
"""Rough checkpoint size per model parameter: weights (4, or 2 + 4 fp32 master copy), AdamW's two
moments (8), the consolidated model.pt (4)."""


def checkpoint_bytes(num_parameters: int) -> int:
    """Estimated size of one checkpoint (all ranks' files together)."""
    return num_parameters * BYTES_PER_PARAMETER


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding ``path`` (its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_free_space(path: Path, needed: int, what: str) -> None:
    free = free_bytes(path)
    if free < needed:
        raise OSError(errno.ENOSPC, f"{what}: {path} has {free / 1e9:.2f} GB free, one checkpoint "
                      f"needs about {needed / 1e9:.2f} GB")
