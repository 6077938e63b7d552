import json
import numpy as np
import pytest
import torch
from open_clip import OPENAI_IMAGENET_TEMPLATES, build_zero_shot_classifier
from sklearn.metrics import balanced_accuracy_score

from vlcontrast.evaluation import build_zeroshot_classifier, zeroshot_metrics
from vlcontrast.evaluation.zeroshot import ZeroShotMetrics, true_class_ranks

CLASSNAMES = ["cat", "dog", "car", "tree", "boat", "house", "bird"]


def test_classifier_equals_open_clip_callable_templates(tiny):
    model, _, tokenizer = tiny
    templates = OPENAI_IMAGENET_TEMPLATES[:7]
    ours = build_zeroshot_classifier(model, tokenizer, CLASSNAMES, templates, batch_size=9)
    reference = build_zero_shot_classifier(model, tokenizer, CLASSNAMES, templates,
                                           num_classes_per_batch=3)
    assert ours.shape == (32, len(CLASSNAMES))
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.norm(dim=0), torch.ones(len(CLASSNAMES)))


def test_classifier_string_templates_use_c_placeholder(tiny):
    model, _, tokenizer = tiny
    ours = build_zeroshot_classifier(model, tokenizer, CLASSNAMES[:3], ["a photo of a {c}.",
                                                                        "a {c} again"])
    reference = build_zero_shot_classifier(model, tokenizer, CLASSNAMES[:3],
                                           ["a photo of a {}.", "a {} again"])
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    single = build_zeroshot_classifier(model, tokenizer, CLASSNAMES[:3], ["a photo of a {c}."])
    assert not torch.allclose(ours, single, atol=1e-3)


@pytest.mark.parametrize("seed", range(5))
def test_metrics_match_sklearn_and_open_clip(seed):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(200, 12, generator=generator)
    labels = torch.randint(0, 10, (200,), generator=generator)  # classes 10, 11 never appear
    ours = zeroshot_metrics(logits, labels)
    # The peers' topk accuracy (open_clip's and CLIP_benchmark's `accuracy` break on numpy 2, so
    # their two lines are restated here).
    predictions = logits.topk(5, 1, True, True)[1].t()
    correct = predictions.eq(labels.view(1, -1).expand_as(predictions))
    assert ours["top1"] == pytest.approx(correct[:1].float().sum().item() / 200)
    assert ours["top5"] == pytest.approx(correct[:5].float().sum().item() / 200)
    assert ours["mean_per_class_recall"] == pytest.approx(
        balanced_accuracy_score(labels.numpy(), logits.argmax(1).numpy()))


def test_ties_follow_argmax_first_index():
    logits = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 2.0, 2.0]])
    labels = torch.tensor([0, 1, 2])
    assert true_class_ranks(logits, labels).tolist() == [0, 1, 1]
    metrics = zeroshot_metrics(logits, labels)
    assert metrics["top1"] == pytest.approx(1 / 3)
    assert metrics["top5"] == 1.0  # top-min(5, C)
    assert metrics["mean_per_class_recall"] == pytest.approx(1 / 3)


def test_metrics_validate_inputs():
    with pytest.raises(ValueError, match="lie in"):
        zeroshot_metrics(torch.zeros(2, 3), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="no samples"):
        zeroshot_metrics(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))


def numpy_reference(logits: np.ndarray, labels: np.ndarray, k: int):
    """Top-1, top-k and per-class recall counted in plain numpy: a class ranks above the true one
    when its logit is higher, or equal at a lower index."""
    true = logits[np.arange(len(labels)), labels][:, None]
    index = np.arange(logits.shape[1])[None, :]
    ranks = ((logits > true) | ((logits == true) & (index < labels[:, None]))).sum(axis=1)
    support = np.bincount(labels, minlength=logits.shape[1])
    hits = np.bincount(labels, weights=ranks == 0, minlength=logits.shape[1])
    recall = np.divide(hits, support, out=np.zeros_like(hits), where=support > 0)
    return (ranks == 0).mean(), (ranks < k).mean(), recall, support


@pytest.mark.parametrize("seed", range(6))
def test_torchmetrics_counts_equal_a_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    num_classes = int(rng.integers(3, 40))
    labels = rng.integers(0, num_classes - 1, size=300)  # the last class never appears
    logits = rng.normal(size=(300, num_classes)).astype(np.float32)
    if seed % 2:  # coarse logits: many ties, at the true class and at the top-k boundary
        logits = np.round(logits * 2) / 2
    metrics = ZeroShotMetrics(num_classes, chunk_size=64)
    metrics.update(torch.from_numpy(logits[:170]), torch.from_numpy(labels[:170]))
    metrics.update(torch.from_numpy(logits[170:]), torch.from_numpy(labels[170:]))
    top1, top5, recall, support = numpy_reference(logits, labels, min(5, num_classes))
    ours_recall, ours_support = metrics.per_class_recall()
    np.testing.assert_allclose(ours_recall.numpy(), recall, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(ours_support.numpy(), support)
    result = metrics.compute()
    assert result["top1"] == pytest.approx(top1)
    assert result["top5"] == pytest.approx(top5)
    assert result["mean_per_class_recall"] == pytest.approx(recall[support > 0].mean())
    assert result == zeroshot_metrics(torch.from_numpy(logits), torch.from_numpy(labels))


def test_torchmetrics_macro_average_would_count_absent_classes():
    """Why the per-class mean is taken over present classes by us: torchmetrics' macro average
    counts a class that is predicted but never true as recall 0 (sklearn leaves it out)."""
    from torchmetrics.classification import MulticlassAccuracy

    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 2.0], [0.0, 2.0, 0.0]])
    labels = torch.tensor([0, 1, 1])  # class 2 never true, predicted once
    macro = MulticlassAccuracy(num_classes=3, average="macro")(logits, labels)
    assert float(macro) == pytest.approx((1 + 0.5 + 0) / 3)
    assert zeroshot_metrics(logits, labels)["mean_per_class_recall"] == pytest.approx(0.75)
    assert balanced_accuracy_score(labels.numpy(), logits.argmax(1).numpy()) == pytest.approx(0.75)


def _distributed_counts(rank, world_size, logits, labels):
    metrics = ZeroShotMetrics(logits.shape[1], distributed=True)
    rows = slice(rank, None, world_size)
    metrics.update(logits[rows], labels[rows])
    return metrics.compute()


@pytest.mark.parametrize("world_size", [2, 3])
def test_torchmetrics_sums_counts_over_ranks(world_size):
    from tests.distributed import run_distributed

    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 9, generator=generator).repeat(4, 1)[:7]  # 7 rows: uneven split
    logits = torch.cat([logits, torch.randn(50, 9, generator=generator)])
    labels = torch.randint(0, 9, (logits.shape[0],), generator=generator)
    results = run_distributed(_distributed_counts, world_size, logits, labels)
    single = zeroshot_metrics(logits, labels)
    assert all(result == pytest.approx(single) for result in results)


def test_torchmetrics_is_declared_and_pinned():
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert [d for d in project["dependencies"] if d.startswith("torchmetrics>=")]
    pins = (root / "requirements.lock").read_text().splitlines()
    assert [p for p in pins if p.startswith("torchmetrics==")]
    assert [p for p in pins if p.startswith("lightning-utilities==")]


@pytest.mark.parametrize("num_classes", [3, 12])
def test_chance_levels_are_the_best_constant_guessers(num_classes):
    """``chance_top1``/``chance_top5``: the k largest class shares of the evaluated images (what
    always answering the same k classes scores); ``chance_mean_per_class_recall``: 1 over the
    classes present. Checked against Counter and against a constant guesser's own scores."""
    from collections import Counter

    generator = torch.Generator().manual_seed(num_classes)
    # class 0 is a third of the set; the last class has no image
    labels = torch.cat([torch.zeros(30, dtype=torch.long),
                        torch.randint(1, num_classes - 1, (60,), generator=generator)])
    counts = Counter(labels.tolist())
    largest = [n for _, n in counts.most_common()]
    metrics = zeroshot_metrics(torch.randn(len(labels), num_classes, generator=generator), labels)
    assert metrics["chance_top1"] == pytest.approx(largest[0] / len(labels))
    assert metrics["chance_top5"] == pytest.approx(sum(largest[:5]) / len(labels))
    assert metrics["chance_mean_per_class_recall"] == pytest.approx(1 / len(counts))
    assert metrics["chance_top1"] > 1 / num_classes  # the constant guesser beats 1/K here
    scores = torch.tensor([float(counts[c]) for c in range(num_classes)]).expand(len(labels), -1)
    constant = zeroshot_metrics(scores, labels)
    assert constant["top1"] == pytest.approx(metrics["chance_top1"])
    assert constant["top5"] == pytest.approx(metrics["chance_top5"])
    assert constant["mean_per_class_recall"] == pytest.approx(
        metrics["chance_mean_per_class_recall"])


def test_metrics_are_the_floats_nearest_their_ratios_of_counts():
    """17 of 200 is 0.085: not torchmetrics' float32 0.08500000089406967 (what results.json and
    metrics.jsonl showed), nor a float64 mean's 0.08499999999999999."""
    from vlcontrast.evaluation.zeroshot import ZeroShotMetrics

    labels = torch.arange(10).repeat_interleave(20)
    hits = [3, 2, 2, 2, 2, 2, 1, 1, 1, 1]  # 17 right answers
    logits = torch.zeros(200, 10)
    for row, label in enumerate(labels.tolist()):
        if row % 20 < hits[label]:
            logits[row, label] = 1.0
        else:  # wrong, and the true class last: outside the top 5 too
            logits[row, (label + 1) % 10] = 1.0
            logits[row, label] = -1.0
    metrics = ZeroShotMetrics(10)
    metrics.update(logits[:77], labels[:77])
    metrics.update(logits[77:], labels[77:])
    result = metrics.compute()
    assert result["top1"] == 0.085 and result["mean_per_class_recall"] == 0.085
    assert result["top5"] == 0.085 and result["chance_top5"] == 0.5
    assert json.dumps(result["top1"]) == "0.085"
