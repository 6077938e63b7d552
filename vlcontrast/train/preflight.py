"""Checks before any heavy work: the run directory is writable and holds no earlier run unless
the run resumes it, a checkpoint to resume was written with this run's model and loss, and each
component's own check.

``train()`` calls :func:`preflight` before the model is built. It composes the components' checks
(the training data's shard spec through the data package's own grammar, the one the loader reads
it with; the :class:`~vlcontrast.train.evaluate.Evaluator`'s paths) and adds the one check that
belongs to the run itself: its directory can be written.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from vlcontrast import distributed as dist_utils
from vlcontrast.checkpoints import check_resume_config, find_resume
from vlcontrast.config import DataConfig, RunConfig, to_dict
from vlcontrast.errors import ConfigError
from vlcontrast.outputs import cannot_write

logger = logging.getLogger(__name__)


def check_training_data(data: DataConfig, reads_val: bool = True) -> None:
    """``data.train`` is set; ``data.train``/``data.val`` parse as shard specs and name no folder
    an unfinished ``vlcontrast prep`` run is still writing (``data.val`` only when ``reads_val``:
    retrieval evaluates it, neither ``eval.retrieval=none`` nor other shards); the first few samples of the training
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
    for key, spec in (("data.train", data.train), ("data.val", data.val if reads_val else "")):
        if not spec:
            continue
        check_not_a_run_folder(key, spec)
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


def check_not_a_run_folder(key: str, spec: str) -> None:
    """``data.train``/``data.val`` naming a vlcontrast run folder (``config.yaml`` and
    ``checkpoints/``, no shards): said as such, with the shards that run trained on, rather than
    as a folder of images (its ``loss_curve.png``)."""
    folder = Path(spec)
    if not (folder.is_dir() and (folder / "config.yaml").is_file()
            and (folder / "checkpoints").is_dir()) or any(folder.glob("*.tar")):
        return
    trained_on = ""
    try:
        import yaml

        saved = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
        shards = (saved.get("data") or {}).get("train") if isinstance(saved, dict) else None
        if shards:
            trained_on = f" (that run trained on data.train={shards!r})"
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        pass
    raise ConfigError(f"{key}={spec!r}: a vlcontrast run folder (config.yaml, checkpoints/), not "
                      f"shards; name a folder or pattern of .tar shards{trained_on}")


WEIGHTS_SUFFIXES = ".pt, .pth, .bin, .safetensors, .npz"


def check_weights_header(path: Path, option: str) -> None:
    """A weights file named by ``option`` starts as one that open_clip's loader reads: a PyTorch
    checkpoint (a zip with ``data.pkl``, or a pickle), a safetensors file (``.safetensors``: a
    JSON header) or numpy's (``.npz``/``.npy``); reads its first bytes (and a zip's directory),
    no tensor. A YAML or text file there was a 37-line unpickling traceback from inside the model
    build."""
    import zipfile

    try:
        with open(path, "rb") as f:
            head = f.read(16)
        suffix = path.suffix.lower()
        if suffix == ".safetensors":
            size = int.from_bytes(head[:8], "little") if len(head) >= 9 else 0
            ok = 0 < size < path.stat().st_size and head[8:9] == b"{"
            kind = "a safetensors file (an 8-byte length, then a JSON header)"
        elif suffix == ".npy":
            ok, kind = head.startswith(b"\x93NUMPY"), "a numpy array file"
        elif head.startswith(b"PK\x03\x04"):
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
            wanted = ".npy" if suffix == ".npz" else "data.pkl"
            ok = any(name.endswith(wanted) for name in names)
            kind = ("a numpy .npz archive" if suffix == ".npz"
                    else "a PyTorch checkpoint (a zip holding data.pkl)")
        else:  # torch.save's legacy format: a pickle (protocol 2 or later)
            ok = head[:1] == b"\x80" and 2 <= head[1:2][0] <= 5 if len(head) >= 2 else False
            kind = "a PyTorch checkpoint (a zip or a pickle)"
    except (OSError, zipfile.BadZipFile) as err:
        raise ConfigError(f"{option}={str(path)!r}: cannot be read as weights ({err}); name "
                          f"an open_clip weights file ({WEIGHTS_SUFFIXES}), a vlcontrast run or "
                          "checkpoint folder, or a pretrained tag") from None
    if not ok:
        raise ConfigError(f"{option}={str(path)!r}: not a weights file (it starts with "
                          f"{head[:12]!r}, not as {kind} does); name an open_clip weights file "
                          f"({WEIGHTS_SUFFIXES}), a vlcontrast run or checkpoint folder, or a "
                          "pretrained tag")


def check_model_name(model) -> None:
    """``model.name`` names a model (an open_clip name, a model-config JSON, a run or export
    folder: reads configs, builds nothing), so a typo stops the run before anything is written."""
    from vlcontrast.models import check_pretrained, resolve_model_config

    resolve_model_config(model.name, model.hf_model_dir)
    if model.pretrained and Path(model.pretrained).is_file():
        check_weights_header(Path(model.pretrained), "model.pretrained")
    check_pretrained(model)  # a mistyped path or a tag the model lacks: names and headers only


def warn_folder_model_random(model, resume: Path | None) -> None:
    """A fresh run with ``model.name`` a folder (an export, a run, a checkpoint, a transformers
    ``CLIPModel``) and no ``model.pretrained``: the folder gives the model's architecture only
    (docs/training.md, ``model.pretrained``: "Empty: random weights"), so training starts from
    random weights, which a user who named a trained model's folder may not expect; one warning
    (rank 0) naming the option that loads its weights."""
    if resume is not None or model.pretrained or not model.name or not Path(model.name).is_dir():
        return
    if dist_utils.get_rank() == 0:
        logger.warning("model.name=%s: a folder, which gives the model's architecture only; "
                       "model.pretrained is empty, so training starts from random weights (to "
                       "start from the folder's weights, add model.pretrained=%s)",
                       model.name, model.name)


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
    if distill.teacher_pretrained and Path(distill.teacher_pretrained).is_file():
        check_weights_header(Path(distill.teacher_pretrained), "distill.teacher_pretrained")
    if distill.teacher_features:
        check_features_path(distill.teacher_features)


def _process_limit() -> tuple[int, str] | None:
    """The most processes this machine lets this job start, and which limit says so (the user's
    ``ulimit -u``, the kernel's ``pid_max`` and ``threads-max``), or None when none is known."""
    limits: list[tuple[int, str]] = []
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        if soft != resource.RLIM_INFINITY and soft > 0:
            limits.append((soft, "ulimit -u"))
    except (ImportError, ValueError, OSError, AttributeError):
        pass
    for name in ("pid_max", "threads-max"):
        try:
            limits.append((int(Path(f"/proc/sys/kernel/{name}").read_text().strip()),
                           f"the kernel's {name}"))
        except (OSError, ValueError):
            continue
    return min(limits) if limits else None


def check_workers(data: DataConfig) -> None:
    """``data.workers`` loader processes per rank, times the ranks on this machine: more than
    this machine can run at all is refused (a huge value was an allocation traceback); more than
    its CPU cores is a warning (it runs, the workers only share the cores)."""
    workers = int(data.workers)
    if workers <= 0:
        return
    ranks = max(1, dist_utils.local_world_size())
    total = workers * ranks
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    per_rank = max(1, cpus // ranks)
    limit = _process_limit()
    if limit is not None and total > limit[0]:
        raise ConfigError(f"data.workers={workers}: {total} loader processes ({workers} x {ranks} "
                          f"rank(s) on this machine) are more than it can run ({limit[1]}: "
                          f"{limit[0]}); set data.workers to at most {per_rank} (its {cpus} CPU "
                          "cores shared by the ranks)")
    if total > cpus and dist_utils.get_rank() == 0:
        logger.warning("data.workers=%d: %d loader processes (%d x %d rank(s) on this machine) "
                       "for %d CPU cores: they share the cores; data.workers=%d gives each one",
                       workers, total, workers, ranks, cpus, per_rank)


EVAL_BATCH_CHECKED = 4096
"""``eval.batch_size`` above this is compared with the evaluation sets' sizes (a batch is a list
of that many entries before the data are read: 1e14 was a MemoryError after training)."""


def _shard_samples(urls: list[str]) -> int | None:
    """Samples in local shards, from their size files or tar headers; None for ``pipe:``."""
    from vlcontrast.data.counting import count_shards
    from vlcontrast.data.sources import listed_sizes
    from vlcontrast.data.spec import PIPE_PREFIX

    if any(url.startswith(PIPE_PREFIX) for url in urls):
        return None
    listed: dict[str, int] = {}
    for folder in {os.path.dirname(os.path.abspath(url)) for url in urls}:
        for name, rows in listed_sizes(folder)[0].items():
            listed[os.path.join(folder, name)] = rows
    unknown = [url for url in urls if os.path.abspath(url) not in listed]
    counted = sum(found.rows for found in count_shards(unknown)) if unknown else 0
    return counted + sum(listed[os.path.abspath(u)] for u in urls if os.path.abspath(u) in listed)


def _evaluation_set_size(evaluator) -> int | None:
    """The larger of the retrieval and zero-shot sets' sizes (an upper bound of what a rank
    reads), or None when one of them cannot be counted beforehand (``pipe:`` shards)."""
    from vlcontrast.data.spec import check_spec
    from vlcontrast.evaluation.datasets import resolve_zeroshot_data

    sizes = []
    if evaluator.retrieval_shards:
        sizes.append(_shard_samples(check_spec(evaluator.retrieval_key,
                                               evaluator.retrieval_shards)))
    zeroshot = evaluator.config
    if zeroshot.zeroshot:
        found = resolve_zeroshot_data(zeroshot.zeroshot, classnames=zeroshot.classnames or None,
                                      templates=zeroshot.templates or None,
                                      keys=("eval.zeroshot", "eval.classnames", "eval.templates"))
        sizes.append(len(found.samples) if found.samples or not found.shards
                     else _shard_samples(list(found.shards)))
    if not sizes or any(size is None for size in sizes):
        return None
    return max(sizes)


def cap_eval_batch_size(evaluator) -> None:
    """An ``eval.batch_size`` larger than the evaluation sets becomes their size for this run's
    evaluator (the same batches, the same metrics and ``val_loss``: one batch holds the whole
    set either way); the config keeps the value given."""
    batch_size = evaluator.config.batch_size
    if batch_size <= EVAL_BATCH_CHECKED:
        return
    size = _evaluation_set_size(evaluator)
    if size is None or batch_size <= size:
        return
    evaluator.config = dataclasses.replace(evaluator.config, batch_size=max(1, size))
    logger.info("eval.batch_size=%d is larger than the evaluation set (%d samples): evaluating "
                "in batches of %d", batch_size, size, max(1, size))


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

    if evaluator is None:
        evaluator = Evaluator(config.eval, val_shards=config.data.val)
    # data.val is read by retrieval alone (eval.retrieval unset, not none): else unchecked
    check_training_data(config.data, reads_val=evaluator.retrieval_key == "data.val"
                        and bool(evaluator.retrieval_shards))
    check_model_name(config.model)
    check_distill_paths(config.distill)
    evaluator.check()
    cap_eval_batch_size(evaluator)
    check_workers(config.data)
    if config.deepspeed.overrides:  # DeepSpeed's own check of its config, without a model
        from vlcontrast.train.engine import check_deepspeed_overrides

        check_deepspeed_overrides(config.train, config.deepspeed,
                                  micro_batch_size=config.data.batch_size,
                                  grad_clip=config.optim.grad_clip,
                                  world_size=dist_utils.get_world_size())
    check_fresh_start(config.output_dir, config.train.resume)
    check_run_directory(config.output_dir)
    resume = find_resume(config.train.resume, Path(config.output_dir),
                         warn=dist_utils.get_rank() == 0)
    check_resume_config(resume, config.train.resume, to_dict(config))
    check_something_to_train(resume, config.train)  # train.epochs: once the data is counted
    warn_folder_model_random(config.model, resume)
    check_stop_after_resume(resume, config.train.stop_at_step)
    return resume


def resumed_step(resume: Path | None) -> int | None:
    """The step of the checkpoint ``resume`` (its ``step_XXXXXXXX`` name), or None."""
    if resume is None or not resume.name.startswith("step_"):
        return None
    try:
        return int(resume.name.removeprefix("step_"))
    except ValueError:
        return None


def check_something_to_train(resume: Path | None, train_config, total_steps: int = 0,
                             steps_per_epoch: int = 0) -> None:
    """A resume lies at or before the run's end: a checkpoint past ``train.steps`` (or the steps
    ``train.epochs`` make, ``total_steps``) has nothing left to train, and resuming it would
    still rewrite the run's ``config.yaml`` and append another evaluation at the same step.
    Refused in one line before anything is written (at the end itself a resume only finishes:
    a job stopped after its last checkpoint writes its results)."""
    step = resumed_step(resume)
    total = total_steps or train_config.steps
    if step is None or total <= 0 or step <= total:
        return
    if train_config.steps:
        asked = f"train.steps={train_config.steps}"
        fix = f"give train.steps above {step} to train on"
    else:
        asked = (f"train.epochs={train_config.epochs:g} ({total} steps at {steps_per_epoch} "
                 "an epoch)")
        fix = (f"give more train.epochs (above {step / max(steps_per_epoch, 1):.3g}) or train.steps "
               f"above {step} (with train.epochs=0) to train on")
    raise ConfigError(f"train.resume={train_config.resume!r}: {resume} is at step {step} already, "
                      f"past the {asked} this run asks for: nothing to train; {fix}, or evaluate "
                      f"it with vlcontrast eval --checkpoint {resume}")


def check_stop_after_resume(resume: Path | None, stop_at_step: int) -> None:
    """``train.stop_at_step`` lies after the step of the checkpoint resumed from (its
    ``step_XXXXXXXX`` name); at or before it the run would train one more step and stop there,
    under a step the user did not ask for."""
    step = resumed_step(resume)
    if step is None or stop_at_step <= 0:
        return
    if stop_at_step <= step:
        raise ConfigError(f"train.stop_at_step={stop_at_step}: the run resumes from {resume}, at "
                          f"step {step} already; give a later step (train.stop_at_step="
                          f"{step + 1} or more), or train.stop_at_step=0 to train to the end")
