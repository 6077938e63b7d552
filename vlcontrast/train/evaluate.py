"""Evaluation during and at the end of training, on the live engine: the :class:`Evaluator`.

Evaluation embeds through ``encode_image``/``encode_text``, not through the module's ``forward``, so
under ZeRO-3 DeepSpeed's hooks never gather the partitioned parameters (every parameter above
``stage3_param_persistence_threshold``, e.g. the projections of ViT-B-32 or RN50). The weights are
gathered for the whole evaluation instead (``deepspeed.zero.GatheredParameters`` on every rank; a
collective, and evaluation runs on every rank anyway), and released afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import torch

from vlcontrast.config import EvalConfig
from vlcontrast.train.precision import Precision

NO_RETRIEVAL = "none"
"""``eval.retrieval=none``: skip retrieval even when ``data.val`` is set."""


def gathered_weights(module: torch.nn.Module):
    """A context in which every parameter of ``module`` is whole (ZeRO-3), or a no-op."""
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


class Evaluator:
    """Retrieval (``eval.retrieval``, else ``data.val``) and zero-shot (``eval.zeroshot``) on the
    live model, every ``eval.every`` steps and at the end.

    Owns its section: the retrieval shards are resolved once here (the one place that reads
    ``eval.retrieval``'s fallback to ``data.val`` and its ``none``), :meth:`check` validates the
    paths before heavy work, and :meth:`should_evaluate` decides when. Under ``amp_bf16`` the
    embeddings are computed under the same bf16 autocast as the training forward. ``progress``
    (``logging.progress``): whether the embedding passes show their progress (rank 0), as the
    training steps do.
    """

    def __init__(self, config: EvalConfig, *, val_shards: str = "", workers: int = 0,
                 precision: Precision = Precision(), members=None, image_cache_dir: str = "",
                 progress: bool = True, max_image_pixels: int | None = None):
        self.config = config
        self.progress = progress
        # data.max_image_pixels, when the run raised or lowered PIL's limit (None: PIL's); a
        # set value also skips the image-feature cache, whose key does not hold the limit.
        self.max_image_pixels = max_image_pixels
        # A frozen image tower shared by many runs (model.lock_image_features): the zero-shot
        # image features are kept in this folder between runs (evaluation/image_cache.py).
        self.image_cache_dir = image_cache_dir
        self.members = members  # data.image_key / data.caption_key, for the retrieval shards
        self.workers = workers
        self.precision = precision
        retrieval = config.retrieval or val_shards
        self.retrieval_shards = "" if retrieval == NO_RETRIEVAL else retrieval
        self.retrieval_key = "eval.retrieval" if config.retrieval else "data.val"

    def check(self) -> None:
        """Every evaluation path exists and every shard spec parses (reads no shard); the
        zero-shot set's layout, class names and templates resolve (lists its files, opens no
        image), so a bad set stops the run before training, not after it."""
        from vlcontrast.data.spec import check_spec
        from vlcontrast.evaluation.datasets import resolve_zeroshot_data

        if self.retrieval_shards:
            check_spec(self.retrieval_key, self.retrieval_shards)
        if not self.config.zeroshot:
            return
        # The one check of the set, its class names and templates (``vlcontrast eval``'s); its
        # errors start with the key they are about.
        resolve_zeroshot_data(self.config.zeroshot, classnames=self.config.classnames or None,
                              templates=self.config.templates or None,
                              keys=("eval.zeroshot", "eval.classnames", "eval.templates"))

    def _image_cache(self) -> Path | None:
        """The zero-shot image-feature file of this set, or None (no cache folder)."""
        if not (self.image_cache_dir and self.config.zeroshot):
            return None
        name = hashlib.sha256(os.path.realpath(self.config.zeroshot).encode()).hexdigest()[:16]
        return Path(self.image_cache_dir) / f"zeroshot-{name}.pt"

    def _retrieval_cache(self) -> Path | None:
        """The retrieval image-feature file of these shards, or None (no cache folder)."""
        if not (self.image_cache_dir and self.retrieval_shards):
            return None
        spec = self.retrieval_shards
        name = hashlib.sha256(f"{os.getcwd()}\n{spec}".encode()).hexdigest()[:16]
        return Path(self.image_cache_dir) / f"retrieval-{name}.pt"

    def should_evaluate(self, step: int, total_steps: int) -> bool:
        """Periodic evaluation inside the loop (the final one runs after it)."""
        every = self.config.every
        return bool(every) and step % every == 0 and step < total_steps

    def evaluate(self, module: torch.nn.Module, bundle, device) -> dict[str, float]:
        """``retrieval/*`` and ``zeroshot/*`` metrics of ``module`` (every rank takes part)."""
        from vlcontrast.evaluation import evaluate_retrieval, evaluate_zeroshot

        config = self.config
        results: dict[str, float] = {}
        was_training = module.training
        module.eval()
        try:
            with gathered_weights(module), torch.no_grad(), self.precision.autocast_context(device):
                if self.retrieval_shards:
                    metrics = evaluate_retrieval(module, bundle.preprocess_val, bundle.tokenizer,
                                                 self.retrieval_shards,
                                                 batch_size=config.batch_size,
                                                 workers=self.workers, device=device,
                                                 max_samples=config.max_samples,
                                                 members=self.members, progress=self.progress,
                                                 image_cache=self._retrieval_cache(),
                                                 max_image_pixels=self.max_image_pixels)
                    results.update({f"retrieval/{k}": v for k, v in metrics.items()
                                    if isinstance(v, (int, float))})
                if config.zeroshot:
                    metrics = evaluate_zeroshot(module, bundle.preprocess_val, bundle.tokenizer,
                                                config.zeroshot,
                                                classnames=config.classnames or None,
                                                templates=config.templates or None,
                                                batch_size=config.batch_size,
                                                workers=self.workers, device=device,
                                                progress=self.progress,
                                                image_cache=self._image_cache(),
                                                max_image_pixels=self.max_image_pixels)
                    results.update({f"zeroshot/{k}": v for k, v in metrics.items()
                                    if isinstance(v, (int, float))})
        finally:
            module.train(was_training)
        return results
