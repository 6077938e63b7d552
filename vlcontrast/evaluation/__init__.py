"""Evaluation: image-text retrieval, zero-shot classification, distributed embedding of eval sets.

``retrieval.py`` and ``zeroshot.py`` hold the metrics (pure functions of embeddings), ``datasets.py``
the readers of evaluation data (retrieval shards, ImageNet/ImageFolder, CLIP_benchmark webdatasets),
``embed.py`` the distributed encode-and-gather loop, and ``runner.py`` the jobs that tie them together
for the trainer (:func:`evaluate_retrieval`, :func:`evaluate_zeroshot`) and the command line
(:func:`run_retrieval_cli`, :func:`run_zeroshot_cli`). Metric definitions: ``docs/evaluation.md``.
"""

from vlcontrast.evaluation.retrieval import clip_validation_loss, retrieval_metrics, retrieval_ranks
from vlcontrast.evaluation.runner import (evaluate_retrieval, evaluate_zeroshot, run_retrieval_cli,
                                          run_zeroshot_cli)
from vlcontrast.evaluation.zeroshot import (build_zeroshot_classifier, zeroshot_logits,
                                            zeroshot_metrics)

__all__ = [
    "build_zeroshot_classifier",
    "clip_validation_loss",
    "evaluate_retrieval",
    "evaluate_zeroshot",
    "retrieval_metrics",
    "retrieval_ranks",
    "run_retrieval_cli",
    "run_zeroshot_cli",
    "zeroshot_logits",
    "zeroshot_metrics",
]
