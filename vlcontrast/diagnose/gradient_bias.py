"""``vlcontrast diagnose gradient-bias``: how far the mini-batch gradient's expectation is from
the full-data gradient, per loss and batch size, at one fixed model state (docs/diagnose.md).

Steps: load the checkpoint (towers in evaluation mode); read ``N`` pairs of the shards with the
evaluation reader and the validation preprocessing (no augmentation; each image's first caption);
compute their features once; for each estimator (:mod:`vlcontrast.diagnose.estimators`) compute
the full-data gradient, estimate ``E[g_B]`` at each batch size
(:mod:`vlcontrast.diagnose.montecarlo`), and compare, in feature space and, pushed back through
the towers (:mod:`vlcontrast.diagnose.pushback`), in parameter space. The report is written by
:mod:`vlcontrast.diagnose.report`.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from vlcontrast.diagnose.estimators import (DEFAULT_LOSSES, SIGLIP_DEFAULT_BIAS, BufferEstimator,
                                            Estimator, Features, expand_losses, setting_name)
from vlcontrast.diagnose.montecarlo import (check_seed, compare, estimate_cell, replicate_count,
                                            spread)
from vlcontrast.diagnose.pushback import TowerPushback, encode_pairs

DEFAULT_BATCH_SIZES = (16, 32, 64, 128, 256, 512, 1024)


@dataclass
class GradientBiasSettings:
    """Everything one diagnostic run depends on (written into its report)."""

    checkpoint: str
    """Run directory (its latest checkpoint) or checkpoint directory."""
    data: str
    """Shards holding the samples (directory, brace pattern or list; evaluation reader)."""
    out: str = "runs/diagnose/gradient-bias"
    """Output directory: gradient_bias.{json,csv,md,png}."""
    losses: tuple[str, ...] = DEFAULT_LOSSES
    """Losses to measure (``decl`` and ``siglip`` expand to several rows)."""
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    """Batch sizes ``B``; each must be in ``[2, num_samples]``."""
    num_samples: int = 4096
    """``N``: the fixed samples, the first ``N`` decodable pairs of ``data`` in dataset order."""
    batches_per_size: int = 512
    """At least this many batches per batch size (rounded up to whole replicates)."""
    min_replicates: int = 16
    """At least this many replicates (passes over the ``N`` samples) per batch size."""
    parameters: bool = True
    """Also measure the gradient w.r.t. the tower parameters."""
    lock_image: bool = False
    """Measure the parameter gradient over the text tower only, as a locked-image (LiT) run
    trains it: the image tower's parameters are frozen before the pushback."""
    parameter_groups: int = 4
    """Replicates are split into this many groups; their pushed-back means give the
    parameter-space Monte-Carlo error."""
    parameter_batches: int = 8
    """Single batches pushed back to estimate the parameter-space variance of one batch."""
    chunk_size: int = 512
    """Rows per block of the chunked losses, and samples per forward of the towers."""
    loss_options: dict[str, dict] = field(default_factory=dict)
    """Per-loss options, e.g. ``{"decl": {"gamma": 0.5}}``."""
    seed: int = 0
    """Seed of the batch draws (the same draws for every loss)."""
    device: str = "auto"
    """``auto`` (CUDA when available), ``cpu``, ``cuda``, ``cuda:1`` ..."""
    workers: int = 0
    """Loader workers for reading the samples."""
    overwrite: bool = False
    """Replace an earlier gradient-bias result in ``out`` (anything else there is refused)."""

    def validate(self, flags: bool = False) -> None:
        """A one-line ConfigError for a setting out of range, naming it as the command line does
        (``--num-samples``) when ``flags``, else as this class's field (``num_samples``)."""
        from vlcontrast.errors import ConfigError

        def name(field: str) -> str:
            return setting_name(field, flags)

        if self.num_samples < 2:
            raise ConfigError(f"{name('num_samples')} must be >= 2, got {self.num_samples}")
        if not self.batch_sizes:
            raise ConfigError(f"{name('batch_sizes')} is empty")
        for size in self.batch_sizes:
            if not 2 <= size <= self.num_samples:
                raise ConfigError(f"{name('batch_sizes')}: {size} is outside [2, "
                                  f"{name('num_samples')}={self.num_samples}]")
        if not self.losses:
            raise ConfigError(f"{name('losses')} is empty")
        if self.lock_image and not self.parameters:
            lock, skip = (("--lock-image", "--no-parameters") if flags else
                          ("lock_image=True", "parameters=False"))
            raise ConfigError(f"{lock} has no effect with {skip} (it restricts the parameter "
                              f"gradient, which {skip} skips); drop one of them")
        for field, low in (("batches_per_size", 1), ("min_replicates", 2),
                           ("parameter_groups", 2), ("parameter_batches", 0),
                           ("chunk_size", 1), ("workers", 0)):
            value = getattr(self, field)
            if value < low:
                raise ConfigError(f"{name(field)} must be >= {low}, got {value}")
        check_seed(self.seed, flags)


# ----------------------------------------------------------------------------------- the inputs


def read_samples(data: str, preprocess, tokenizer, num_samples: int, *,
                 workers: int = 0, flags: bool = False) -> tuple[Tensor, Tensor, int]:
    """The first ``num_samples`` decodable pairs of ``data``: ``(images, tokens, skipped)``.

    Images go through ``preprocess`` (the validation transform); the text is each image's first
    caption. Undecodable samples are skipped and counted. Too few is a one-line ConfigError
    naming the settings as :func:`~vlcontrast.diagnose.estimators.setting_name` does.
    """
    from vlcontrast.errors import ConfigError
    from vlcontrast.evaluation.datasets import build_retrieval_loader

    loader = build_retrieval_loader(data, preprocess, batch_size=256, workers=workers)
    images, captions, skipped = [], [], 0
    for batch_images, batch_captions, _, batch_skipped in loader.loader:
        skipped += int(batch_skipped)
        if batch_images is not None:
            images.append(batch_images)
            captions += [texts[0] for texts in batch_captions]
        if len(captions) >= num_samples:
            break
    if len(captions) < num_samples:
        data_named = f"--data {data!r}" if flags else f"data={data!r}"
        raise ConfigError(f"{data_named}: only {len(captions)} decodable pairs ({skipped} "
                          f"skipped), but {setting_name('num_samples', flags)}={num_samples}; "
                          f"give fewer samples or more data")
    return torch.cat(images)[:num_samples], tokenizer(captions[:num_samples]), skipped


@torch.no_grad()
def compute_features(model, images: Tensor, tokens: Tensor, *, chunk_size: int,
                     dtype: torch.dtype = torch.float64) -> Features:
    """Features of every sample (towers in evaluation mode), the temperature and logit bias."""
    device = next(model.parameters()).device
    image_parts, text_parts = [], []
    for start in range(0, images.shape[0], chunk_size):
        image, text = encode_pairs(model, images[start:start + chunk_size].to(device),
                                   tokens[start:start + chunk_size].to(device))
        image_parts.append(image.to(dtype))
        text_parts.append(text.to(dtype))
    scale = model.logit_scale.detach().exp().to(dtype).reshape(())
    bias = getattr(model, "logit_bias", None)
    bias = (bias.detach().to(dtype).reshape(()) if isinstance(bias, torch.Tensor)
            else torch.tensor(SIGLIP_DEFAULT_BIAS, dtype=dtype, device=device))
    return Features(torch.cat(image_parts), torch.cat(text_parts), scale, bias)


# ---------------------------------------------------------------------------------- measurement


def measure(estimators: list[Estimator], features: Features, settings: GradientBiasSettings,
            pushback: TowerPushback | None = None, progress=None) -> list[dict]:
    """One report row per (estimator, batch size)."""
    groups = settings.parameter_groups if pushback is not None else 1
    rows = []
    for estimator in estimators:
        started = time.perf_counter()
        target = estimator.full_gradient(features)
        target_parameters = pushback.push_full([target])[0] if pushback is not None else None
        target_seconds = time.perf_counter() - started
        for batch_size in settings.batch_sizes:
            started = time.perf_counter()
            replicates = replicate_count(features.size, batch_size, settings.batches_per_size,
                                         settings.min_replicates, groups)
            cell = estimate_cell(estimator, features, batch_size, replicates=replicates,
                                 groups=groups,
                                 sample_batches=settings.parameter_batches if pushback else 0,
                                 seed=settings.seed)
            row = {"estimator": estimator.name, "loss": estimator.loss_name,
                   "batch_size": batch_size, "num_samples": features.size,
                   "replicates": cell.replicates, "batches": cell.batches}
            row.update(compare(cell.mean, target, cell.mc_variance,
                               cell.batch_variance).as_dict("feature"))
            if pushback is not None:
                pushed = pushback.push_full(list(cell.group_means))
                centre, group_variance = spread(pushed)
                singles = [pushback.push(indices, [gradient])[0]
                           for indices, gradient in cell.sample_batches]
                batch_variance = spread(singles)[1] if len(singles) >= 2 else math.nan
                row.update(compare(centre, target_parameters, group_variance / groups,
                                   batch_variance).as_dict("parameter"))
                row["parameter_batches"] = len(singles)
            row.update(cell.info)
            row["seconds"] = round(time.perf_counter() - started + target_seconds, 3)
            target_seconds = 0.0
            rows.append(row)
            if progress is not None:
                progress.set_postfix(row=f"{estimator.name}@{batch_size}",
                                     bias=row["feature_relative_bias"])
                progress.update()
    return rows


def exact_numerics() -> dict[str, object]:
    """IEEE fp32 matmuls and convolutions (no TF32) and deterministic cuDNN: the diagnostic
    compares gradients at a precision a training run does not need. Returns the settings as
    recorded in the report."""
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return {"float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark}


def run_gradient_bias(settings: GradientBiasSettings, progress: bool = True, *,
                      flags: bool = False) -> dict:
    """Run the diagnostic and write its report under ``settings.out``; returns the report.
    ``progress``: show the progress over the cells (a bar on a terminal, lines in a log).
    The settings and the output folder are checked first, before the checkpoint and the data
    are read: one-line ConfigErrors naming the settings' fields (``out='x' exists ...; add
    overwrite=True``), or with ``flags`` the command line's (``--out``, ``--overwrite``)."""
    from vlcontrast.diagnose.report import check_out, write_report
    from vlcontrast.checkpoints import resolve_weights
    from vlcontrast.models import load_model_from_checkpoint
    from vlcontrast.progress import Progress

    settings.validate(flags)
    check_out(settings.out, settings.overwrite,  # before the checkpoint and data are read
              option=setting_name("out", flags))
    device = settings.device
    if device in ("", "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    folder = resolve_weights(settings.checkpoint, setting_name("checkpoint", flags))
    # Option and name errors surface here, before the checkpoint and data are read.
    expand_losses(settings.losses, settings.num_samples, settings.chunk_size,
                  settings.loss_options, flags=flags)
    numerics = exact_numerics()  # before any model or feature is computed
    started = time.perf_counter()
    bundle = load_model_from_checkpoint(folder, device=device)
    model = bundle.model.eval()
    images, tokens, skipped = read_samples(settings.data, bundle.preprocess_val,
                                           bundle.tokenizer, settings.num_samples,
                                           workers=settings.workers, flags=flags)
    features = compute_features(model, images, tokens, chunk_size=settings.chunk_size)
    estimators = expand_losses(settings.losses, settings.num_samples, settings.chunk_size,
                               settings.loss_options, flags=flags)
    for estimator in estimators:
        estimator.loss.to(device)
    if settings.lock_image:
        for name, parameter in model.named_parameters():
            if name.startswith("visual."):
                parameter.requires_grad_(False)
    pushback = (TowerPushback(model, images, tokens, chunk_size=settings.chunk_size)
                if settings.parameters else None)
    with Progress(len(estimators) * len(settings.batch_sizes), "gradient-bias",
                  unit="cell", disable=not progress) as bar:
        rows = measure(estimators, features, settings, pushback, bar)
    report = {
        "settings": {**asdict(settings), "losses": list(settings.losses),
                     "batch_sizes": list(settings.batch_sizes), "device": device},
        "checkpoint": str(folder),
        "numerics": numerics,
        "model_name": bundle.model_name,
        "num_samples": features.size,
        "skipped_samples": skipped,
        "logit_scale": float(features.logit_scale),
        "logit_bias": float(features.logit_bias) if features.logit_bias is not None else None,
        "tower_parameters": pushback.num_parameters if pushback is not None else None,
        "decl_gamma": next((float(e.loss.gamma) for e in estimators
                            if e.name == "decl_loss1"), None),
        "buffer_gamma": {e.name: float(e.loss.gamma) for e in estimators
                         if isinstance(e, BufferEstimator) and not e.fixed},
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    write_report(report, Path(settings.out))
    return report
