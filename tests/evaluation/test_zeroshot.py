import pytest
import torch
from open_clip import OPENAI_IMAGENET_TEMPLATES, build_zero_shot_classifier
from sklearn.metrics import balanced_accuracy_score

from vlcontrast.evaluation import build_zeroshot_classifier, zeroshot_metrics
from vlcontrast.evaluation.zeroshot import true_class_ranks

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


def test_torchmetrics_is_neither_declared_nor_used():
    """The decision on torchmetrics: not used, so not a dependency.

    Zero-shot metrics are computed once, on rank 0, from features gathered from every rank, so
    they are exact under data parallelism without a metric-sync library. torchmetrics'
    conventions also differ from the ones this project reports (and open_clip / CLIP_benchmark
    use): ``MulticlassRecall(average="macro")`` counts a class absent from the labels as recall 0
    instead of leaving it out (sklearn's ``balanced_accuracy_score``), and its top-k counts a class
    tied with the true one as a hit. The metrics above are checked against sklearn and open_clip.
    """
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + [d for extra in project.get("optional-dependencies",
                                                                   {}).values() for d in extra]
    assert not [d for d in declared if d.lower().startswith("torchmetrics")]
    users = [str(path) for path in (root / "vlcontrast").rglob("*.py")
             if "torchmetrics" in path.read_text()]
    assert users == []
