"""Zero-shot classification: the prompt-ensemble classifier and its metrics.

The classifier follows open_clip's ``build_zero_shot_classifier``: every prompt ``template(c)`` is
embedded and L2-normalised, the prompts of a class are averaged and the mean is re-normalised, giving
``W`` of shape ``[D, C]``; logits are ``100 * image_features @ W``. Templates are callables (open_clip's
``OPENAI_IMAGENET_TEMPLATES``) or strings with a ``{c}`` placeholder (CLIP_benchmark's files).

Metrics use the same deterministic tie rule as retrieval (a class tied with the true class counts as
ranked above it when its index is lower, i.e. ``argmax`` picks the first maximum): top-1, top-5
(top-min(5, C) when there are fewer classes) and mean per-class recall (sklearn's
``balanced_accuracy_score``: the mean over classes present in ``labels`` of their top-1 recall).

Beside them, the chance level of each, as a label-blind guesser's best on this set (what
``vlcontrast verify`` compares with): ``chance_top1`` and ``chance_top5``, the share of the
largest class and of the k largest (always answering them; k/C only on a balanced set), and
``chance_mean_per_class_recall``, 1 over the classes present (any label-blind guess).

The counting is torchmetrics' (:class:`ZeroShotMetrics`): ``MulticlassAccuracy`` (micro) for
top-1 and top-k, ``MulticlassStatScores`` per class for the recalls, with torchmetrics' own
reduction over the ranks of a process group. Two conventions are kept on top of it: logits are
replaced by their rank in the row first (ties broken by class index, so torchmetrics' ``topk``
follows the rule above), and the per-class mean leaves out classes absent from the labels
(``MulticlassAccuracy(average="macro")`` would count a class that is predicted but never true as
recall 0).
"""

from __future__ import annotations

import warnings
from fractions import Fraction
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


def tie_broken_scores(logits: torch.Tensor) -> torch.Tensor:
    """Each row's classes scored ``C, C-1, ..., 1`` in descending logit order, ties in class-index
    order: the same ranking as :func:`true_class_ranks`, without ties."""
    order = torch.argsort(logits, dim=1, descending=True, stable=True)
    scores = torch.arange(logits.shape[1], 0, -1, dtype=torch.float32, device=logits.device)
    return torch.empty(logits.shape, dtype=torch.float32, device=logits.device).scatter_(
        1, order, scores.expand_as(order).contiguous())


class ZeroShotMetrics:
    """Top-1, top-k and mean per-class recall counted by torchmetrics over batches of logits.

    ``distributed=True``: every rank of the process group updates with its own rows and calls
    :meth:`compute`; torchmetrics sums the counts over ranks, so every rank gets the numbers of
    all rows. ``False``: this process's rows only (safe to call on one rank of a group).
    """

    def __init__(self, num_classes: int, *, top_k: int = 5, device="cpu",
                 distributed: bool = False, chunk_size: int = 65536):
        from torchmetrics.classification import MulticlassAccuracy, MulticlassStatScores

        if num_classes < 1:
            raise ValueError("ZeroShotMetrics: no classes")
        self.num_classes, self.top_k = num_classes, min(top_k, num_classes)
        self.chunk_size = chunk_size
        common = dict(num_classes=num_classes, sync_on_compute=distributed, validate_args=False)
        self.top1 = MulticlassAccuracy(top_k=1, average="micro", **common).to(device)
        self.topk = MulticlassAccuracy(top_k=self.top_k, average="micro", **common).to(device)
        self.per_class = MulticlassStatScores(top_k=1, average="none", **common).to(device)

    def update(self, logits: torch.Tensor, labels) -> None:
        labels = torch.as_tensor(labels, dtype=torch.long, device=logits.device)
        if logits.ndim != 2 or logits.shape[1] != self.num_classes or \
                labels.shape != (logits.shape[0],):
            raise ValueError(f"logits must be [N, {self.num_classes}] and labels [N]; got "
                             f"{tuple(logits.shape)} and {tuple(labels.shape)}")
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= self.num_classes):
            raise ValueError(f"labels must lie in [0, {self.num_classes})")
        for start in range(0, logits.shape[0], self.chunk_size):
            scores = tie_broken_scores(logits[start:start + self.chunk_size])
            target = labels[start:start + self.chunk_size]
            for metric in (self.top1, self.topk, self.per_class):
                metric.update(scores.to(metric.device), target.to(metric.device))

    def _per_class_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(true positives [C], support [C])`` at top-1, summed over the ranks (float64)."""
        with warnings.catch_warnings():  # a rank given no rows still takes part in the sum
            warnings.filterwarnings("ignore", message=".*called before the ``update``")
            stats = self.per_class.compute()      # [C, 5]: tp, fp, tn, fn, support
        return stats[:, 0].double(), stats[:, 4].double()

    def per_class_recall(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(recall [C], support [C])``: top-1 recall of each class (0 where it has no sample) and
        its number of samples."""
        true_positives, support = self._per_class_counts()
        return true_positives / support.clamp(min=1), support

    def compute(self) -> dict[str, float]:
        true_positives, support = self._per_class_counts()
        total = int(support.sum())
        if total == 0:
            raise ValueError("zeroshot_metrics: no samples")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*called before the ``update``")
            top1, topk = float(self.top1.compute()), float(self.topk.compute())
        # Every value is a ratio of counts, given as the float nearest it: 19 of 200 is 0.095,
        # not torchmetrics' float32 0.0949999988, nor a float64 mean's 0.08499999999999999.
        counts = [(int(tp), int(n)) for tp, n in zip(true_positives.tolist(), support.tolist())
                  if n > 0]
        largest = sorted((n for _, n in counts), reverse=True)
        return {"top1": _ratio(top1, total),
                "top5": _ratio(topk, total),
                "mean_per_class_recall": float(sum((Fraction(tp, n) for tp, n in counts),
                                                   Fraction(0)) / len(counts)),
                "chance_top1": largest[0] / total,
                "chance_top5": sum(largest[:self.top_k]) / total,
                "chance_mean_per_class_recall": 1.0 / len(counts)}


def _ratio(value: float, total: int) -> float:
    """A share of ``total`` samples computed in float32, as the float nearest the exact ratio of
    counts (exact for any ``total`` below 2**23)."""
    return round(value * total) / total if total else value


def zeroshot_metrics(logits: torch.Tensor, labels) -> dict[str, float]:
    """``top1``, ``top5``, ``mean_per_class_recall`` (and their ``chance_*``) of ``logits [N, C]``
    against ``labels [N]`` (this process's rows; :class:`ZeroShotMetrics` with
    ``distributed=True`` sums over ranks)."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [N, C] and labels [N]; got {tuple(logits.shape)}")
    if logits.shape[0] == 0:
        raise ValueError("zeroshot_metrics: no samples")
    metrics = ZeroShotMetrics(logits.shape[1], device=logits.device)
    metrics.update(logits, labels)
    return metrics.compute()
