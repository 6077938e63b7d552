"""Checks before any heavy work: the run directory is writable, a checkpoint to resume was written
with this run's model and loss, and each component's own check.

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
    """``data.train`` is set and ``data.train``/``data.val`` parse as shard specs (reads no shard)."""
    from vlcontrast.data.spec import check_spec

    if not data.train:
        raise ConfigError("data.train='': set the training shards "
                          "(e.g. data/synthetic/train/{00000..00019}.tar)")
    for key, spec in (("data.train", data.train), ("data.val", data.val)):
        if spec:
            check_spec(key, spec)


def check_distill_paths(distill) -> None:
    """The teacher, its weights and its stored features, named by paths that exist (reads none of
    them): a typo stops the run before the student model is built."""
    from vlcontrast.distill.offline import check_features_path
    from vlcontrast.distill.teacher import check_teacher_paths

    if distill.teacher or distill.teacher_pretrained:
        check_teacher_paths(distill.teacher, distill.teacher_pretrained)
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


def preflight(config: RunConfig, evaluator=None) -> Path | None:
    """Fail fast on missing data, bad evaluation paths, unwritable output and a checkpoint this
    run cannot resume (collective). Returns the checkpoint to resume from (``train.resume``
    resolved once, :func:`~vlcontrast.checkpoints.find_resume`), or None for a fresh start.

    ``train()``'s composition of the components' checks; ``evaluator`` is the run's
    :class:`~vlcontrast.train.evaluate.Evaluator` (one is made from ``config`` when omitted)."""
    from vlcontrast.train.evaluate import Evaluator

    check_training_data(config.data)
    check_distill_paths(config.distill)
    if evaluator is None:
        evaluator = Evaluator(config.eval, val_shards=config.data.val)
    evaluator.check()
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
