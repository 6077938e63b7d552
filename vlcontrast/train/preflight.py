"""Checks before any heavy work: the run directory is writable and holds no earlier run unless
the run resumes it, a checkpoint to resume was written with this run's model and loss, and each
component's own check.

``train()`` calls :func:`preflight` before the model is built. It composes the components' checks
(the training data's shard spec through the data package's own grammar, the one the loader reads
it with; the :class:`~vlcontrast.train.evaluate.Evaluator`'s paths) and adds the one check that
belongs to the run itself: its directory can be written.
"""

from __future__ import annotations

from pathlib import Path

from vlcontrast import distributed as dist_utils
from vlcontrast.checkpoints import check_resume_config, find_resume
from vlcontrast.config import DataConfig, RunConfig, to_dict
from vlcontrast.errors import ConfigError
from vlcontrast.outputs import cannot_write


def check_training_data(data: DataConfig) -> None:
    """``data.train`` is set; ``data.train``/``data.val`` parse as shard specs and name no folder
    an unfinished ``vlcontrast prep`` run is still writing; the first few samples of the training
    shards have members matching ``data.image_key`` and ``data.caption_key`` (a look at the
    first local shard, no more: ``vlcontrast prep check`` reads them all)."""
    import os

    from vlcontrast.data.check import sniff_member_keys
    from vlcontrast.data.samples import Members
    from vlcontrast.data.shards import unfinished_prep
    from vlcontrast.data.spec import PIPE_PREFIX, check_spec

    if not data.train:
        raise ConfigError("data.train='': set the training shards "
                          "(e.g. data/synthetic/train/{00000..00019}.tar)")
    train_urls: list[str] = []
    for key, spec in (("data.train", data.train), ("data.val", data.val)):
        if not spec:
            continue
        urls = check_spec(key, spec)
        if key == "data.train":
            train_urls = urls
        folders = dict.fromkeys(os.path.dirname(os.path.abspath(url)) for url in urls
                                if not url.startswith(PIPE_PREFIX))
        for folder in folders:
            line = unfinished_prep(folder)
            if line:
                raise ConfigError(f"{key}={spec!r}: {line}, then train")
    keys = Members.parse(getattr(data, "image_key", ""), getattr(data, "caption_key", ""))
    error = sniff_member_keys(train_urls, keys, "data.train")
    if error:
        raise ConfigError(error)


def check_model_name(model) -> None:
    """``model.name`` names a model (an open_clip name, a model-config JSON, a run or export
    folder: reads configs, builds nothing), so a typo stops the run before anything is written."""
    from vlcontrast.models import check_pretrained, resolve_model_config

    resolve_model_config(model.name, model.hf_model_dir)
    check_pretrained(model)  # a mistyped path or a tag the model lacks: names and headers only


def check_distill_paths(distill) -> None:
    """The teacher, its weights and its stored features, named by paths that exist (reads none of
    them): a typo stops the run before the student model is built."""
    from vlcontrast.distill.offline import check_features_path
    from vlcontrast.distill.teacher import check_teacher_paths

    if distill.teacher or distill.teacher_pretrained:
        check_teacher_paths(distill.teacher, distill.teacher_pretrained)
    if distill.teacher and distill.teacher_pretrained and not Path(distill.teacher).is_dir():
        from types import SimpleNamespace

        from vlcontrast.models import check_pretrained

        # A model name with a tag it lacks: said before the student is built.
        check_pretrained(SimpleNamespace(name=distill.teacher, pretrained=distill.teacher_pretrained,
                                         hf_model_dir=""), "distill.teacher_pretrained",
                         "distill.teacher")
    if distill.teacher_features:
        check_features_path(distill.teacher_features)


def check_run_directory(output_dir: str) -> None:
    """Rank 0 creates the run directory; every rank learns of a failure (no one waits alone).
    Collective."""
    error = None
    if dist_utils.get_rank() == 0:
        out = Path(output_dir)
        try:
            for folder in (out, out / "checkpoints"):
                folder.mkdir(parents=True, exist_ok=True)
                probe = folder / ".write_probe"
                probe.write_text("ok")
                probe.unlink()
        except OSError as err:
            error = cannot_write(f"output_dir={output_dir!r}", err)
    dist_utils.raise_on_any_rank(error, ConfigError)


def check_fresh_start(output_dir: str, resume: str) -> None:
    """A run that does not ask to resume (``train.resume`` empty) starts in a folder without an
    earlier run's checkpoints or results: its checkpoints would sit beside theirs (retention
    keeps the highest steps, so it could delete the new run's own), its metrics would be appended
    to theirs and its results would replace theirs. A one-line ConfigError says what is there and
    the fixes; an earlier start that failed before its first checkpoint is no run."""
    if resume:
        return
    out = Path(output_dir)
    steps = sorted(p.name for p in (out / "checkpoints").glob("step_*")
                   if p.is_dir() and not p.name.endswith(".tmp"))
    held = ([f"checkpoints up to {steps[-1]}" if len(steps) > 1 else f"checkpoint {steps[0]}"]
            if steps else []) + (["results.json"] if (out / "results.json").is_file() else [])
    if held:
        raise ConfigError(f"output_dir={output_dir!r} holds an earlier run ({', '.join(held)}); "
                          "continue it with train.resume=latest, or give a new output_dir (or "
                          "move that one away)")


def preflight(config: RunConfig, evaluator=None) -> Path | None:
    """Fail fast on missing data, bad evaluation paths, unwritable output and a checkpoint this
    run cannot resume (collective). Returns the checkpoint to resume from (``train.resume``
    resolved once, :func:`~vlcontrast.checkpoints.find_resume`), or None for a fresh start.

    ``train()``'s composition of the components' checks; ``evaluator`` is the run's
    :class:`~vlcontrast.train.evaluate.Evaluator` (one is made from ``config`` when omitted)."""
    from vlcontrast.train.evaluate import Evaluator

    check_training_data(config.data)
    check_model_name(config.model)
    check_distill_paths(config.distill)
    if evaluator is None:
        evaluator = Evaluator(config.eval, val_shards=config.data.val)
    evaluator.check()
    check_fresh_start(config.output_dir, config.train.resume)
    check_run_directory(config.output_dir)
    resume = find_resume(config.train.resume, Path(config.output_dir),
                         warn=dist_utils.get_rank() == 0)
    check_resume_config(resume, config.train.resume, to_dict(config))
    check_stop_after_resume(resume, config.train.stop_at_step)
    return resume


def check_stop_after_resume(resume: Path | None, stop_at_step: int) -> None:
    """``train.stop_at_step`` lies after the step of the checkpoint resumed from (its
    ``step_XXXXXXXX`` name); at or before it the run would train one more step and stop there,
    under a step the user did not ask for."""
    if resume is None or stop_at_step <= 0 or not resume.name.startswith("step_"):
        return
    try:
        step = int(resume.name.removeprefix("step_"))
    except ValueError:
        return
    if stop_at_step <= step:
        raise ConfigError(f"train.stop_at_step={stop_at_step}: the run resumes from {resume}, at "
                          f"step {step} already; give a later step (train.stop_at_step="
                          f"{step + 1} or more), or train.stop_at_step=0 to train to the end")
