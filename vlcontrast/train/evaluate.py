"""Evaluation during and at the end of training, on the live engine.

Evaluation embeds through ``encode_image``/``encode_text``, not through the module's ``forward``, so
under ZeRO-3 DeepSpeed's hooks never gather the partitioned parameters (every parameter above
``stage3_param_persistence_threshold``, e.g. the projections of ViT-B-32 or RN50). The weights are
gathered for the whole evaluation instead (``deepspeed.zero.GatheredParameters`` on every rank; a
collective, and evaluation runs on every rank anyway), and released afterwards.
"""

from __future__ import annotations

import contextlib

import torch

from vlcontrast.config import RunConfig


def gathered_weights(module: torch.nn.Module):
    """A context in which every parameter of ``module`` is whole (ZeRO-3), or a no-op."""
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def evaluate(module: torch.nn.Module, bundle, config: RunConfig, device) -> dict[str, float]:
    """Retrieval (``eval.retrieval`` or ``data.val``) and zero-shot (``eval.zeroshot``) metrics."""
    from vlcontrast.evaluation import evaluate_retrieval, evaluate_zeroshot

    results: dict[str, float] = {}
    was_training = module.training
    module.eval()
    try:
        with gathered_weights(module), torch.no_grad():
            shards = config.eval.retrieval or config.data.val
            if shards and shards != "none":
                metrics = evaluate_retrieval(module, bundle.preprocess_val, bundle.tokenizer,
                                             shards, batch_size=config.eval.batch_size,
                                             workers=config.data.workers, device=device,
                                             max_samples=config.eval.max_samples)
                results.update({f"retrieval/{k}": v for k, v in metrics.items()
                                if isinstance(v, (int, float))})
            if config.eval.zeroshot:
                metrics = evaluate_zeroshot(module, bundle.preprocess_val, bundle.tokenizer,
                                            config.eval.zeroshot,
                                            classnames=config.eval.classnames or None,
                                            templates=config.eval.templates or None,
                                            batch_size=config.eval.batch_size,
                                            workers=config.data.workers, device=device)
                results.update({f"zeroshot/{k}": v for k, v in metrics.items()
                                if isinstance(v, (int, float))})
    finally:
        module.train(was_training)
    return results
