"""Zero-shot classification: the prompt-ensemble classifier and its metrics.

The classifier follows open_clip's ``build_zero_shot_classifier``: every prompt ``template(c)`` is
embedded and L2-normalised, the prompts of a class are averaged and the mean is re-normalised, giving
``W`` of shape ``[D, C]``; logits are ``100 * image_features @ W``. Templates are callables (open_clip's
``OPENAI_IMAGENET_TEMPLATES``) or strings with a ``{c}`` placeholder (CLIP_benchmark's files).

Metrics use the same deterministic tie rule as retrieval (a class tied with the true class counts as
ranked above it when its index is lower, i.e. ``argmax`` picks the first maximum): top-1, top-5
(top-min(5, C) when there are fewer classes) and mean per-class recall (sklearn's
``balanced_accuracy_score``: the mean over classes present in ``labels`` of their top-1 recall).
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch
import torch.nn.functional as F

Template = Union[str, Callable[[str], str]]


def format_prompt(template: Template, classname: str) -> str:
    if callable(template):
        return template(classname)
    return template.replace("{c}", classname)


def _encode_texts(model, tokens: torch.Tensor) -> torch.Tensor:
    return F.normalize(model.encode_text(tokens).float(), dim=-1)


@torch.no_grad()
def build_zeroshot_classifier(model, tokenizer, classnames: Sequence[str],
                              templates: Sequence[Template], *, device="cpu",
                              batch_size: int = 256, progress: bool = False,
                              synchronize: bool = False) -> torch.Tensor:
    """Class weights ``[D, C]`` (float32, unit columns) from prompt ensembles.

    ``batch_size`` is the number of prompts encoded per forward pass. ``synchronize=True`` (used by
    ``evaluate_zeroshot``, where every rank builds a block of classes) keeps the ranks' forward
    passes in lock step; then a rank given no classes returns ``[D, 0]``.
    """
    if len(templates) == 0:
        raise ValueError("build_zeroshot_classifier: no templates")
    from vlcontrast.evaluation.embed import encode_in_lockstep, text_dummy

    num_templates = len(templates)
    prompts = [format_prompt(t, c) for c in classnames for t in templates]
    batches = (prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size))
    total = (len(prompts) + batch_size - 1) // batch_size
    pieces, dim = [], 0
    for batch in encode_in_lockstep(batches, device, progress=progress, total=total,
                                    description="zero-shot classifier", synchronize=synchronize):
        if batch is None:  # this rank is done; others still encode (ZeRO-3 needs every rank)
            dim = _encode_texts(model, text_dummy(tokenizer, device)).shape[1]
            continue
        pieces.append(_encode_texts(model, tokenizer(batch).to(device)))
    if not pieces:
        if not dim:
            raise ValueError("build_zeroshot_classifier: no classnames")
        return torch.zeros(dim, 0, device=device)
    embeddings = torch.cat(pieces).reshape(len(classnames), num_templates, -1).mean(dim=1)
    return F.normalize(embeddings, dim=-1).t().contiguous()


def zeroshot_logits(image_features: torch.Tensor, classifier: torch.Tensor,
                    chunk_size: int = 65536) -> torch.Tensor:
    """``100 * image_features @ classifier`` (open_clip's and CLIP_benchmark's logit scale)."""
    classifier = classifier.to(device=image_features.device, dtype=torch.float32)
    return torch.cat([100.0 * image_features[i:i + chunk_size].float() @ classifier
                      for i in range(0, max(image_features.shape[0], 1), chunk_size)])


def true_class_ranks(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """0-based rank of the true class per row: strictly higher logits plus equal ones at a lower index."""
    labels = torch.as_tensor(labels, dtype=torch.long, device=logits.device)
    true = logits.gather(1, labels.unsqueeze(1))
    higher = (logits > true).sum(dim=1)
    lower_index = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0) < labels.unsqueeze(1)
    return higher + ((logits == true) & lower_index).sum(dim=1)


def zeroshot_metrics(logits: torch.Tensor, labels) -> dict[str, float]:
    """``top1``, ``top5``, ``mean_per_class_recall`` of ``logits [N, C]`` against ``labels [N]``."""
    labels = torch.as_tensor(labels, dtype=torch.long, device=logits.device)
    if logits.ndim != 2 or labels.shape != (logits.shape[0],):
        raise ValueError(f"logits must be [N, C] and labels [N]; got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")
    if logits.shape[0] == 0:
        raise ValueError("zeroshot_metrics: no samples")
    num_classes = logits.shape[1]
    if int(labels.min()) < 0 or int(labels.max()) >= num_classes:
        raise ValueError(f"labels must lie in [0, {num_classes})")
    ranks = true_class_ranks(logits, labels)
    correct = (ranks == 0).double()
    per_class_hits = torch.zeros(num_classes, dtype=torch.float64, device=logits.device)
    per_class_hits.index_add_(0, labels, correct)
    per_class_count = torch.bincount(labels, minlength=num_classes).double()
    present = per_class_count > 0
    return {
        "top1": float(correct.mean()),
        "top5": float((ranks < min(5, num_classes)).double().mean()),
        "mean_per_class_recall": float((per_class_hits[present] / per_class_count[present]).mean()),
    }
