"""Evaluation jobs: model + data in, a flat JSON-able dict of metrics out.

:func:`evaluate_retrieval` and :func:`evaluate_zeroshot` are what the trainer calls (every rank of the
process group calls them; every rank gets the same dict back, computed once on rank 0). Keys carry no
prefix (``image_to_text_R@1``, ``top1``, ...); the caller adds one (``retrieval/``, ``zeroshot/``).
:func:`run_retrieval_cli`, :func:`run_zeroshot_cli` and :func:`compare_checkpoints` back
``vlcontrast eval ...`` (and the ``eval/*.py`` shims over it): they load a checkpoint, evaluate, write
the JSON record (an earlier one is refused unless ``overwrite``; replaced atomically) and then say
what was skipped (stderr) and print a small table (a closed stdout or stderr loses nothing:
:func:`emit`, :func:`say`).
"""

from __future__ import annotations

import datetime
import json
import math
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from vlcontrast.data.samples import DEFAULT_MAX_IMAGE_PIXELS
from vlcontrast.distributed import all_gather_variable, get_rank, get_world_size
from vlcontrast.errors import ConfigError
from vlcontrast.evaluation.datasets import (ZeroShotData, build_retrieval_loader,
                                            build_zeroshot_loader, resolve_zeroshot_data)
from vlcontrast.evaluation.embed import (embed_labelled_images, embed_retrieval, model_dtype,
                                        unwrap_model)
from vlcontrast.evaluation.retrieval import clip_validation_loss, retrieval_metrics
from vlcontrast.evaluation.zeroshot import (ZeroShotMetrics, build_zeroshot_classifier,
                                            zeroshot_logits)


@contextmanager
def _eval_mode(model):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _share_from_rank0(compute, device):
    """Run ``compute()`` on rank 0 only; every rank returns its result or raises its error."""
    result = None
    if get_rank() == 0:
        try:
            result = compute()
        except Exception as error:  # noqa: BLE001 - re-raised on every rank below
            if get_world_size() == 1:
                raise
            result = error
    if get_world_size() > 1:
        box = [result]
        dist.broadcast_object_list(box, src=0, device=torch.device(device))
        result = box[0]
    if isinstance(result, Exception):
        raise result
    return result


def _model_logit_scale(model) -> float | None:
    parameter = getattr(unwrap_model(model), "logit_scale", None)
    if not isinstance(parameter, torch.Tensor) or parameter.numel() == 0:
        return None  # e.g. partitioned by ZeRO-3: the caller must pass logit_scale
    return float(parameter.detach().float().exp().mean())


def evaluate_retrieval(model, preprocess, tokenizer, shards: str | Sequence[str], *,
                       batch_size: int = 256, workers: int = 4, device="cpu",
                       max_samples: int = 0, logit_scale: float | None = None,
                       chunk_size: int = 4096, progress: bool = True,
                       members=None, image_cache: str | Path | None = None,
                       alpha: str | None = None, max_image_pixels: int | None = None,
                       report: dict | None = None) -> dict:
    """Image-text retrieval on webdataset shards (see ``datasets.py`` for layouts).

    ``logit_scale`` is the multiplier for the validation loss (already exponentiated); by default
    ``exp(model.logit_scale)``. The validation loss is open_clip's batch-wise CLIP loss over
    consecutive batches of ``batch_size`` (image, first caption) pairs in dataset order, so it does
    not depend on the number of ranks; it is reported as ``val_loss`` with ``val_loss_batch_size``.

    ``members``: the image and caption members to read (a :class:`~vlcontrast.data.samples.
    Members`, from ``data.image_key``/``data.caption_key``), the same as training reads, so both
    skip the same samples; default: the image as training finds it, the ``.txt`` (its lines, or
    the ``.json``'s ``captions`` list when there is one, are the sample's captions).

    ``image_cache``: a file that keeps the image features (with the captions and keys) between
    runs of one process whose image tower does not change
    (:mod:`vlcontrast.evaluation.image_cache`); ignored with several ranks.

    ``alpha``: the transparency rule (:data:`~vlcontrast.data.samples.ALPHA_RULES`); given, the
    result also holds ``num_transparent`` (images that had transparency) and the image cache is
    not used. None: ``white``, the training rule, and the result as the trainer logs it.

    ``max_image_pixels``: images with more pixels are skipped as ``decompression_bomb`` (None:
    PIL's limit; given, the image cache is not used). ``report``: a dict that receives
    ``reasons`` (skipped samples per reason; not filled from an image cache).

    Returns ``retrieval_metrics`` keys plus ``val_loss``, ``val_loss_batch_size``, ``num_skipped``.
    """
    rank, world = get_rank(), get_world_size()
    from vlcontrast.data.samples import DEFAULT_MEMBERS, TRAINING_ALPHA

    members = members or DEFAULT_MEMBERS
    loader = build_retrieval_loader(shards, preprocess, batch_size=batch_size, workers=workers,
                                    rank=rank, world_size=world, max_samples=max_samples,
                                    members=members, alpha=alpha or TRAINING_ALPHA,
                                    max_image_pixels=max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS)
    with _eval_mode(model):
        if image_cache and world == 1 and alpha is None and max_image_pixels is None:
            from vlcontrast.evaluation.datasets import resolve_shards
            from vlcontrast.evaluation.embed import encode_retrieval_images
            from vlcontrast.evaluation.image_cache import cached_retrieval_images, retrieval_key

            clip = unwrap_model(model)
            key = retrieval_key(clip, resolve_shards(shards), preprocess, batch_size=batch_size,
                                dtype=model_dtype(clip), max_samples=max_samples, members=members)

            def encode():
                return list(encode_retrieval_images(model, preprocess, tokenizer, loader.loader,
                                                    device=device, progress=progress,
                                                    total_batches=loader.num_batches))

            # As for zero-shot: hit and miss both leave the global RNG as they found it.
            with torch.random.fork_rng(devices=[]):
                encoded, _ = cached_retrieval_images(image_cache, key, encode)
            embeddings = embed_retrieval(model, preprocess, tokenizer, None, device=device,
                                         encoded=encoded)
        else:
            embeddings = embed_retrieval(model, preprocess, tokenizer, loader.loader,
                                         device=device, progress=progress,
                                         total_batches=loader.num_batches)
            if report is not None:
                report.update(reasons=embeddings.reasons)
        scale = logit_scale if logit_scale is not None else _model_logit_scale(model)

    def compute():
        if embeddings.image_features.shape[0] == 0:
            from vlcontrast.data.samples import pixels_hint

            raise ConfigError(f"no decodable retrieval samples in {loader.name!r} "
                             f"({embeddings.skipped} skipped); `vlcontrast prep check` names the "
                             "reasons; captions or images under other members need "
                             "data.caption_key / data.image_key (eval retrieval --caption-key)"
                             f"{pixels_hint(embeddings.reasons, max_image_pixels)}")
        compute_device = torch.device(device)
        images = embeddings.image_features.to(compute_device)
        texts = embeddings.text_features.to(compute_device)
        result = retrieval_metrics(images, texts, embeddings.text_to_image, chunk_size=chunk_size)
        if scale is not None:
            first = texts[embeddings.first_caption.to(compute_device)]
            result["val_loss"] = clip_validation_loss(images, first, scale, batch_size)
            # the batch the loss was computed over: the whole set when it is smaller
            result["val_loss_batch_size"] = min(int(batch_size), int(images.shape[0]))
        result["num_skipped"] = embeddings.skipped
        if alpha is not None:
            result["num_transparent"] = embeddings.transparent
        return result

    return _share_from_rank0(compute, device)


def evaluate_zeroshot(model, preprocess, tokenizer, data_dir, classnames=None,
                      templates=None, *, batch_size: int = 256, workers: int = 4, device="cpu",
                      split: str = "test", progress: bool = True,
                      image_cache: str | Path | None = None, alpha: str | None = None,
                      report: dict | None = None, max_image_pixels: int | None = None) -> dict:
    """Zero-shot classification of an ImageNet val dir, an ImageFolder or a CLIP_benchmark wds set.

    ``data_dir``: a directory, or its :class:`~vlcontrast.evaluation.datasets.ZeroShotData`
    already resolved (errors about a directory name the Python parameters: ``data_dir=...``). ``classnames`` / ``templates``: files or lists overriding the layout's own
    (see ``datasets.resolve_zeroshot_data``). Each rank embeds a contiguous block of the classes' prompts
    and every ``world``-th image; the classifier and features are gathered.

    ``image_cache``: a file that keeps the image features between runs of one process whose image
    tower does not change (:mod:`vlcontrast.evaluation.image_cache`); ignored with several ranks.

    ``alpha``: the transparency rule (:data:`~vlcontrast.data.samples.ALPHA_RULES`); given, the
    result also holds ``num_transparent`` (images that had transparency) and the image cache is
    not used. None: ``white``, the training rule, and the result as the trainer logs it.

    ``report``: a dict that receives ``reasons`` (skipped images per reason) and ``skipped`` (the
    skipped images' paths, in the data's order; folders only: shards' samples have no file);
    not filled from an image cache.

    ``max_image_pixels``: images with more pixels are skipped as ``decompression_bomb`` (None:
    PIL's limit; given, the image cache is not used).

    Returns ``top1``, ``top5``, ``mean_per_class_recall``, ``num_images``, ``num_classes``,
    ``num_templates``, ``num_skipped``.
    """
    from vlcontrast.data.samples import TRAINING_ALPHA

    rank, world = get_rank(), get_world_size()
    data = (data_dir if isinstance(data_dir, ZeroShotData)
            else resolve_zeroshot_data(data_dir, classnames, templates, split=split,
                                       keys=("data_dir", "classnames", "templates")))
    data_dir = data.root
    num_classes = len(data.classnames)
    first, last = rank * num_classes // world, (rank + 1) * num_classes // world
    counts: dict[str, int] = {}

    def embed() -> tuple[torch.Tensor, torch.Tensor, int]:
        loader = build_zeroshot_loader(data, preprocess, batch_size=batch_size, workers=workers,
                                       rank=rank, world_size=world,
                                       alpha=alpha or TRAINING_ALPHA,
                                       max_image_pixels=max_image_pixels
                                       or DEFAULT_MAX_IMAGE_PIXELS)
        keys, features, labels, skipped = embed_labelled_images(
            model, preprocess, loader.loader, device=device, progress=progress,
            total_batches=loader.num_batches, counts=counts)
        if report is not None:  # keys are positions in data.samples (folders)
            kept = set(keys.tolist())
            report.update(reasons=counts["reasons"], skipped=[
                path for index, (path, _) in enumerate(data.samples) if index not in kept])
        return features, labels, skipped

    with _eval_mode(model):
        clip = unwrap_model(model)
        local = build_zeroshot_classifier(clip, tokenizer, data.classnames[first:last],
                                          data.templates, device=device, batch_size=batch_size,
                                          progress=progress, synchronize=True)
        classifier = all_gather_variable(local.t().contiguous()).t().contiguous()
        if image_cache and world == 1 and alpha is None and max_image_pixels is None:
            from vlcontrast.evaluation.image_cache import cache_key, cached_image_features

            key = cache_key(clip, data, preprocess, batch_size=batch_size, dtype=model_dtype(clip))
            # Iterating the loader draws its base seed from the global RNG and a cache hit does
            # not iterate it: hit and miss both leave the RNG as they found it.
            with torch.random.fork_rng(devices=[]):
                features, labels, skipped, _ = cached_image_features(image_cache, key, embed)
        else:
            features, labels, skipped = embed()

    # Every rank holds all features (gathered above); each scores every world-th image and
    # torchmetrics sums the counts over the ranks.
    if features.shape[0] == 0:
        from vlcontrast.data.samples import pixels_hint

        raise ConfigError(f"no decodable images in {data_dir!r}"
                          f"{pixels_hint(counts.get('reasons', {}), max_image_pixels)}")
    if int(labels.min()) < 0 or int(labels.max()) >= num_classes:  # same on every rank
        raise ConfigError(f"{data_dir}: an image has label {int(labels.max())} but there are "
                         f"{num_classes} class names; give one class name per label")
    metrics = ZeroShotMetrics(num_classes, device=device, distributed=world > 1)
    mine = slice(rank, None, world)
    metrics.update(zeroshot_logits(features[mine].to(device), classifier), labels[mine].to(device))
    result = metrics.compute()
    result.update(num_images=int(features.shape[0]), num_classes=num_classes,
                  num_templates=len(data.templates), num_skipped=skipped)
    if alpha is not None:
        result["num_transparent"] = counts["transparent"]
    return result


# ----------------------------------------------------------------------------------- CLI helpers

def _setup_device(device: str | None) -> str:
    """The device of an evaluation command, chosen as training chooses it.

    Under a launcher (world size > 1) the process group is initialised by
    :func:`~vlcontrast.distributed.init_distributed`, which picks and sets this rank's device (one
    GPU per task included) and that device is used, never a raw ``LOCAL_RANK``. On CUDA the same
    numeric defaults as training are set (TF32, cuDNN autotuning), so offline evaluation of a
    checkpoint gives the numbers its run logged."""
    from vlcontrast.distributed import init_distributed, launch_env, set_gpu_defaults

    requested = "auto" if device in (None, "", "auto") else device
    if launch_env().world_size > 1:
        kind = "cuda" if requested.startswith("cuda") else requested
        resolved = str(init_distributed(device=kind).device)
    elif requested == "auto":
        resolved = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        resolved = requested
    if resolved.startswith("cuda"):
        set_gpu_defaults()
    return resolved


def format_table(record: dict) -> str:
    rows = [(key, value) for key, value in record["metrics"].items()]
    width = max(len(key) for key, _ in rows)
    lines = [f"{record['task']}: {record['checkpoint']} on {record['dataset']} (N={record['N']})"]
    for key, value in rows:
        shown = f"{value:.4f}" if isinstance(value, float) and not math.isnan(value) else str(value)
        lines.append(f"  {key:<{width}}  {shown}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ stdout

_stdout_closed = False


def emit(text: str) -> bool:
    """Print ``text`` on stdout. A reader that stopped reading (``eval ... | head -1``) ends the
    printing, not the command: stdout is pointed at the null device (:func:`close_stdout`) and
    the work goes on, every file still written; False then."""
    try:
        print(text, flush=True)
        return True
    except BrokenPipeError:
        close_stdout()
        return False


def say(line: str) -> bool:
    """Print ``line`` on stderr (a note beside the results). A reader that stopped reading
    (``eval ... 2>&1 | head -1``) ends the notes, not the command, as :func:`emit` does for
    stdout: stderr is pointed at the null device, the work goes on; False then."""
    import sys

    try:
        print(line, file=sys.stderr, flush=True)
        return True
    except BrokenPipeError:
        _to_null(sys.stderr, "stderr")
        global _stdout_closed
        _stdout_closed = True
        return False


def _to_null(stream, name: str) -> None:
    """Point ``stream`` (sys.stdout or sys.stderr) at the null device."""
    import io
    import os
    import sys

    try:
        fd = stream.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):  # not a file (a test's capture)
        setattr(sys, name, open(os.devnull, "w"))
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def close_stdout() -> None:
    """Point stdout at the null device after a ``BrokenPipeError`` (Python's documented way), so
    that neither a later print nor the flush at exit fails on the closed pipe."""
    import sys

    global _stdout_closed
    _stdout_closed = True
    _to_null(sys.stdout, "stdout")


def reset_stdout_state() -> None:
    """Forget an earlier command's closed stdout (several commands in one process: tests)."""
    global _stdout_closed
    _stdout_closed = False


def stdout_closed() -> bool:
    """Whether a reader closed stdout (or stderr) while this process printed (:func:`emit`,
    :func:`say`)."""
    return _stdout_closed


# ----------------------------------------------------------------------------- output files

RECORD_TASKS = ("retrieval", "zeroshot")
RECORD_LIMIT = 16 << 20
"""Bytes of an existing ``--out`` file read to say what it holds (records are a few KiB)."""


def describe_record(path: str | Path) -> tuple[bool, str]:
    """``(is an eval record, what the file holds)``: ``a zeroshot record of 'runs/a/...' on
    'data/x'``; an empty file is one too (nothing to lose)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size == 0:
            return True, "an empty file"
        if size > RECORD_LIMIT:
            return False, f"a file of {size:,} bytes"
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False, "not JSON"
    if isinstance(data, dict) and data.get("task") in RECORD_TASKS and "metrics" in data:
        return True, (f"a {data['task']} record of {str(data.get('checkpoint'))!r} on "
                      f"{str(data.get('dataset'))!r}")
    if isinstance(data, dict) and isinstance(data.get("metrics"), dict):
        return False, "a run's results"
    return False, "JSON that is not an eval record"


def check_record_target(out, overwrite: bool = False, option: str = "--out") -> Path:
    """``--out`` of ``eval retrieval|zeroshot``, checked before the model loads: a writable file,
    and an existing one refused (what it holds, when it was made) unless ``overwrite``, which
    replaces only an eval record."""
    from vlcontrast.outputs import check_replaceable, made, writable_file

    path = writable_file(out, option)
    if path.exists():
        is_kind, held = describe_record(path)
        check_replaceable(f"{option} {str(out)!r}", f"{held}, {made(path)}",
                          kind="an eval record", is_kind=is_kind, overwrite=overwrite)
    return path


def write_record(record: dict, out, overwrite: bool = False) -> Path:
    """The record as JSON at ``out``, atomically (a temporary file renamed over it). ``out`` was
    free at the start unless ``overwrite``: a file that appeared there while the evaluation ran is
    kept, and the record goes to the first free name beside it (``NAME.1.json``), said on stderr."""
    from vlcontrast.outputs import free_name, write_text_atomic

    target = Path(out) if overwrite else free_name(out)
    written = write_text_atomic(target, json.dumps(record, indent=2) + "\n")
    if target != Path(out):  # said once the record is safe
        say(f"vlcontrast eval {record['task']}: --out {str(out)!r} was written by something "
            f"else while this evaluation ran; it is kept and this record goes to "
            f"{str(target)!r}")
    return written


COMPARE_FILE = re.compile(r"^(\d+_(retrieval|zeroshot)\.json|comparison\.(json|md))$")
"""The files ``eval compare`` writes into its folder."""


def check_comparison_target(out, overwrite: bool = False, option: str = "--out") -> Path:
    """``eval compare --out``, checked before any model loads: a folder that can be written, and
    beside which the new comparison can be built; an existing comparison is refused (what it
    holds, when it was made) unless ``overwrite``, which replaces it whole; a folder holding
    other files is never replaced."""
    from vlcontrast.outputs import check_replaceable, made, writable_dir

    folder = writable_dir(out, option)
    writable_dir(folder.absolute().parent, f"{option} {str(out)!r}: its parent folder")
    held = sorted(folder.iterdir(), key=lambda p: p.name) if folder.is_dir() else []
    if not held:
        return folder
    others = [p.name + ("/" if p.is_dir() else "") for p in held
              if not (p.is_file() and COMPARE_FILE.match(p.name))]
    if others:
        what, newest = f"files eval compare does not write: {', '.join(others[:4])}" + (
            ", ..." if len(others) > 4 else ""), max(held, key=_mtime)
    else:
        what, newest = _describe_comparison(folder, held), max(held, key=_mtime)
    check_replaceable(f"{option} {str(out)!r}", f"{what}, {made(newest)}",
                      kind="an eval compare folder", is_kind=not others, overwrite=overwrite,
                      new="folder")
    return folder


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _describe_comparison(folder: Path, held: list[Path]) -> str:
    """``a comparison of 4 checkpoints (runs/a, runs/b, runs/c and 1 more) on retrieval and
    zeroshot``, from its comparison.json; or its records, when that is missing."""
    records = [p for p in held if p.suffix == ".json" and p.name != "comparison.json"]
    try:
        rows = json.loads((folder / "comparison.json").read_text(encoding="utf-8"))
        checkpoints = [str(row["checkpoint"]) for row in rows]
        tasks = sorted({key.split("/")[0] for row in rows for key in row if "/" in key})
    except (OSError, ValueError, KeyError, TypeError):
        return f"{len(records)} eval records and no comparison table"
    shown = ", ".join(checkpoints[:3]) + (f" and {len(checkpoints) - 3} more"
                                          if len(checkpoints) > 3 else "")
    return (f"a comparison of {len(checkpoints)} checkpoint{'s' * (len(checkpoints) != 1)} "
            f"({shown}) on {' and '.join(tasks) or 'no task'}")


def _write_record(task: str, checkpoint_dir, bundle, data, metrics: dict, out,
                  extra: dict, overwrite: bool = False, notes: Sequence[str | None] = ()) -> dict:
    """The record: written to ``out`` (rank 0), then ``notes`` said on stderr (the lines on
    skipped samples and transparency), then the table printed: a reader that closes either
    stream early (``2>&1 | head -1``) costs no result."""
    record = {
        "task": task,
        "checkpoint": str(checkpoint_dir),
        "model_name": bundle.model_name,
        "dataset": str(data),
        "N": metrics["num_images"],
        "metrics": metrics,
        **extra,
        "world_size": get_world_size(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if get_rank() == 0:
        if out:  # first: a reader that closes stdout or stderr early must not cost the results
            write_record(record, out, overwrite)
        for line in notes:
            if line:
                say(line)
        emit(format_table(record))
    return record


# ------------------------------------------------------------------------- checkpoints, data

CHECKPOINT_FORMS = ("a run directory (its latest checkpoint), a checkpoint directory "
                    "(RUN/checkpoints/step_*), a `vlcontrast export` directory or a transformers "
                    "CLIPModel directory")


def check_checkpoint(path, what: str = "--checkpoint") -> Path:
    """The model folder ``path`` names (:func:`~vlcontrast.checkpoints.resolve_model_files`),
    checked before anything loads. A file is refused in one line: with its folder as the fix
    when that folder holds a model (``model.pt`` of a checkpoint, an export's weights), else
    saying what a checkpoint is (a config such as ``run.yaml`` is none)."""
    from vlcontrast.checkpoints import resolve_model_files

    if Path(path).is_file():
        folder = Path(path).parent
        try:
            resolve_model_files(folder, what)
        except (FileNotFoundError, ConfigError):
            raise ConfigError(f"{what} {str(path)!r}: a file, not a model; give {CHECKPOINT_FORMS}"
                              ) from None
        fix = (f"{what} {str(folder)!r}" if what.startswith("-") else repr(str(folder)))
        raise ConfigError(f"{what} {str(path)!r}: a file, not a folder; give the folder holding "
                          f"it: {fix}")
    return resolve_model_files(path, what)


def check_retrieval_data(key: str, spec: str) -> list[str]:
    """:func:`~vlcontrast.data.spec.check_spec` of retrieval data (its hints name ``key``: images
    converted with ``vlcontrast prep`` are then evaluated, not trained on)."""
    from vlcontrast.data.spec import check_spec

    return check_spec(key, spec)


def check_keys_match(urls: Sequence[str], members, key: str) -> None:
    """``--image-key``/``--caption-key`` checked on the first samples of the shards before the
    model loads (:func:`~vlcontrast.data.check.sniff_member_keys`, training's preflight look):
    none of them holding a matching member is a one-line ConfigError naming the members found
    and the setting to use."""
    from vlcontrast.data.check import sniff_member_keys

    error = sniff_member_keys(list(urls), members, key,
                              options=("--image-key", "--caption-key"))
    if error:
        raise ConfigError(error)


def _load(checkpoint, device):
    from vlcontrast.checkpoints import resolve_model_files
    from vlcontrast.models import load_model_from_checkpoint

    return resolve_model_files(checkpoint), load_model_from_checkpoint(checkpoint, device=device)


def _alpha_line(task: str, metrics: dict, alpha: str) -> str:
    """``vlcontrast eval TASK: 2 of 10 images had transparency; --alpha white: ...``."""
    from vlcontrast.data.samples import alpha_summary

    return (f"vlcontrast eval {task}: "
            f"{alpha_summary(metrics['num_transparent'], metrics['num_images'], alpha)}")


def _skip_record(report: dict) -> dict:
    """The record's ``skipped_reasons`` (skipped samples per reason, summing to
    ``metrics.num_skipped``) and ``shard_events`` (events of whole input shards, such as
    ``truncated_tar``), each only when not empty."""
    from vlcontrast.data.samples import split_shard_events

    samples, events = split_shard_events(report.get("reasons", {}))
    return {**({"skipped_reasons": dict(sorted(samples.items()))} if samples else {}),
            **({"shard_events": dict(sorted(events.items()))} if events else {})}


def _skipped_line(task: str, metrics: dict, report: dict, max_image_pixels: int,
                  noun: str = "images") -> str | None:
    """``vlcontrast eval TASK: skipped 2 of 10 images (...)`` when any were or an input shard had
    an event (``...; input shards: 1 truncated_tar``, apart from the samples), else None."""
    from vlcontrast.data.samples import skipped_summary, split_shard_events

    skipped = metrics["num_skipped"]
    _, events = split_shard_events(report.get("reasons", {}))
    if not (skipped or events):
        return None
    line = skipped_summary(skipped, metrics["num_images"] + skipped, report.get("reasons", {}),
                           report.get("skipped", []), max_image_pixels=max_image_pixels,
                           noun=noun)
    return f"vlcontrast eval {task}: {line}"


def run_retrieval_cli(checkpoint, data, out=None, batch_size: int = 256, workers: int = 4,
                      max_samples: int = 0, device: str | None = None, image_key: str = "",
                      caption_key: str = "", alpha: str = "white", progress: bool = True,
                      max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                      overwrite: bool = False) -> dict:
    """``vlcontrast eval retrieval``: load CKPT (run dir -> latest), evaluate, write ``out`` JSON.
    ``image_key``/``caption_key``: as ``data.image_key``/``data.caption_key`` (empty: default).
    ``alpha``: the transparency rule (:data:`~vlcontrast.data.samples.ALPHA_RULES`); how many
    images had transparency is printed and recorded (``num_transparent``). ``progress``: the
    progress bars (plain lines in a log). ``max_image_pixels``: larger images are skipped as
    ``decompression_bomb``; skipped samples are counted on stderr. An existing ``out`` is refused
    before the model loads unless ``overwrite``; the record is written before the table is
    printed, atomically."""
    from vlcontrast.data.samples import Members, check_alpha, check_member_keys

    alpha = check_alpha(alpha)
    members = None
    if image_key or caption_key:
        check_member_keys(image_key or "jpg", caption_key or "txt", "eval retrieval")
        members = Members.parse(image_key, caption_key)
    if out:
        check_record_target(out, overwrite)
    if isinstance(data, str):  # the checkpoint's and the data's errors before the model
        check_checkpoint(checkpoint)
        urls = check_retrieval_data("--data", data)
        if members is not None:  # keys that match nothing: training's preflight look
            check_keys_match(urls, members, f"--data {data!r}")
    device = _setup_device(device)
    folder, bundle = _load(checkpoint, device)
    report: dict = {}
    metrics = evaluate_retrieval(bundle.model, bundle.preprocess_val, bundle.tokenizer, data,
                                 batch_size=batch_size, workers=workers, device=device,
                                 max_samples=max_samples, members=members, alpha=alpha,
                                 progress=progress, max_image_pixels=max_image_pixels,
                                 report=report)
    return _write_record("retrieval", folder, bundle, data, metrics, out,
                         {"num_texts": metrics["num_texts"], "batch_size": batch_size,
                          "max_samples": max_samples, "alpha": alpha, **_skip_record(report)},
                         overwrite, notes=(_alpha_line("retrieval", metrics, alpha),
                                           _skipped_line("retrieval", metrics, report,
                                                         max_image_pixels, noun="samples")))


def run_zeroshot_cli(checkpoint, data, out=None, classnames=None, templates=None,
                     batch_size: int = 256, workers: int = 4, device: str | None = None,
                     alpha: str = "white", progress: bool = True,
                     max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                     overwrite: bool = False) -> dict:
    """``vlcontrast eval zeroshot``: load CKPT, classify ``data`` zero-shot, write ``out`` JSON;
    skipped images are named on stderr (the first three). The record says where the class names
    and templates came from (``classnames``, ``templates``: :class:`ZeroShotData`'s
    ``classnames_from``, ``templates_from``). ``alpha``, ``progress``, ``max_image_pixels``,
    ``overwrite``: as for :func:`run_retrieval_cli`."""
    from vlcontrast.data.samples import check_alpha

    alpha = check_alpha(alpha)
    if out:
        check_record_target(out, overwrite)
    resolved = resolve_zeroshot_data(data, classnames, templates)  # its errors before the model
    check_checkpoint(checkpoint)
    device = _setup_device(device)
    folder, bundle = _load(checkpoint, device)
    report: dict = {}
    metrics = evaluate_zeroshot(bundle.model, bundle.preprocess_val, bundle.tokenizer, resolved,
                                batch_size=batch_size, workers=workers, device=device,
                                alpha=alpha, progress=progress, report=report,
                                max_image_pixels=max_image_pixels)
    return _write_record("zeroshot", folder, bundle, data, metrics, out,
                         {"classnames": dict(resolved.classnames_from,
                                             count=len(resolved.classnames)),
                          "templates": dict(resolved.templates_from,
                                            count=len(resolved.templates)),
                          "batch_size": batch_size, "alpha": alpha, **_skip_record(report)},
                         overwrite, notes=(_alpha_line("zeroshot", metrics, alpha),
                                           _skipped_line("zeroshot", metrics, report,
                                                         max_image_pixels)))


COMPARISON_COLUMNS = {
    "retrieval": ["image_to_text_R@1", "image_to_text_R@5", "text_to_image_R@1",
                  "text_to_image_R@5", "val_loss"],
    "zeroshot": ["top1", "top5", "mean_per_class_recall"],
}


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """One row per checkpoint, floats to 4 decimals, missing cells empty."""
    lines = ["| checkpoint | " + " | ".join(columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for row in rows:
        cells = [f"{row[c]:.4f}" if isinstance(row.get(c), float) else str(row.get(c, ""))
                 for c in columns]
        lines.append(f"| {row['checkpoint']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def compare_checkpoints(checkpoints: Sequence[str], out, *, retrieval: str = "",
                        zeroshot: str = "", classnames=None, templates=None,
                        max_samples: int = 0, batch_size: int = 256, workers: int = 4,
                        device: str | None = None, progress: bool = True,
                        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                        overwrite: bool = False) -> str:
    """``vlcontrast eval compare``: evaluate every checkpoint on the same data.

    Writes ``OUT/<n>_<task>.json`` per checkpoint and task, ``OUT/comparison.json`` and
    ``OUT/comparison.md`` (a markdown table, also returned and printed on rank 0). An existing
    comparison in ``OUT`` is refused before any model loads unless ``overwrite``; the new one is
    built in a folder beside ``OUT`` and replaces it whole only when complete. A comparison that
    stops early leaves ``OUT`` as it was, and the records it wrote in that folder (named on
    stderr).
    """
    if not retrieval and not zeroshot:
        raise ValueError("compare_checkpoints: give retrieval and/or zeroshot data")
    # Every checkpoint and the data are checked before the first is evaluated.
    for checkpoint in checkpoints:
        check_checkpoint(checkpoint, what="eval compare: checkpoint")
    if retrieval:
        check_retrieval_data("--retrieval", retrieval)
    if zeroshot:
        resolve_zeroshot_data(zeroshot, classnames, templates,
                              keys=("--zeroshot", "--classnames", "--templates"))
    out = Path(out)
    check_comparison_target(out, overwrite)
    staging = _comparison_staging(out)
    columns = [f"{task}/{column}" for task, data in (("retrieval", retrieval),
                                                     ("zeroshot", zeroshot)) if data
               for column in COMPARISON_COLUMNS[task]]
    rows = []
    try:
        for index, checkpoint in enumerate(checkpoints):
            row = {"checkpoint": str(checkpoint)}
            if retrieval:
                record = run_retrieval_cli(checkpoint, retrieval,
                                           staging / f"{index}_retrieval.json", batch_size,
                                           workers, max_samples, device, progress=progress,
                                           max_image_pixels=max_image_pixels, overwrite=True)
                row.update({f"retrieval/{k}": v for k, v in record["metrics"].items()})
            if zeroshot:
                record = run_zeroshot_cli(checkpoint, zeroshot, staging / f"{index}_zeroshot.json",
                                          classnames, templates, batch_size, workers, device,
                                          progress=progress, max_image_pixels=max_image_pixels,
                                          overwrite=True)
                row.update({f"zeroshot/{k}": v for k, v in record["metrics"].items()})
            rows.append(row)
        table = markdown_table(rows, columns)
        if get_rank() == 0:
            from vlcontrast.outputs import replace_dir, write_text_atomic

            write_text_atomic(staging / "comparison.json", json.dumps(rows, indent=2) + "\n")
            write_text_atomic(staging / "comparison.md", table)
            replace_dir(staging, out)
    except BaseException:
        _keep_partial(staging, out)
        raise
    if get_rank() == 0:
        emit(table)
    return table


def _comparison_staging(out: Path) -> Path:
    """A new folder beside ``out`` where the comparison is built (on the rank that writes; the
    others get ``out``, which they never write)."""
    import tempfile

    from vlcontrast.distributed import launch_env

    if launch_env().rank != 0:
        return out
    import os

    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.absolute().parent, prefix=f".{out.name}.comparing-"))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # as mkdir makes it (mkdtemp's is private, 0700)
    return staging


def _keep_partial(staging: Path, out: Path) -> None:
    """After a comparison that stopped early: its folder removed when it holds nothing, else kept
    (the records of the checkpoints evaluated so far) and named on stderr."""
    import shutil
    import sys

    if staging == out or not staging.is_dir():
        return
    records = sorted(p.name for p in staging.iterdir())
    if not records:
        shutil.rmtree(staging, ignore_errors=True)
        return
    print(f"vlcontrast eval compare: stopped before the comparison was complete; {str(out)!r} is "
          f"as it was, and the {len(records)} records written so far are kept in "
          f"{str(staging)!r}", file=sys.stderr, flush=True)
