import numpy as np
import pytest
import torch
import torch.nn.functional as F
from clip_benchmark.metrics.zeroshot_retrieval import batchify, recall_at_k
from open_clip_train.train import get_clip_metrics

from tests.evaluation.helpers import naive_ranks
from vlcontrast.evaluation import clip_validation_loss, retrieval_metrics, retrieval_ranks


def integer_features(generator, n, dim=8, low=-3, high=4):
    # Small integers: every dot product is exact in float32, so ties are real and frequent.
    return torch.randint(low, high, (n, dim), generator=generator).float()


def random_text_to_image(generator, num_images, extra_texts):
    # Every image gets one caption, some get more; the order of texts is shuffled.
    t2i = torch.cat([torch.arange(num_images), torch.randint(0, num_images, (extra_texts,),
                                                             generator=generator)])
    return t2i[torch.randperm(t2i.numel(), generator=generator)]


@pytest.mark.parametrize("seed", range(12))
def test_ranks_match_naive_stable_sort_with_ties_and_several_captions(seed):
    generator = torch.Generator().manual_seed(seed)
    num_images = int(torch.randint(1, 60, (1,), generator=generator))
    extra = int(torch.randint(0, 2 * num_images, (1,), generator=generator))
    images = integer_features(generator, num_images)
    t2i = random_text_to_image(generator, num_images, extra)
    texts = integer_features(generator, t2i.numel())
    chunk = int(torch.randint(1, 70, (1,), generator=generator))
    image_ranks, text_ranks = retrieval_ranks(images, texts, t2i, chunk_size=chunk)
    expected_image, expected_text = naive_ranks(images, texts, t2i)
    assert torch.equal(image_ranks, expected_image)
    assert torch.equal(text_ranks, expected_text)


def test_tie_goes_to_lower_index():
    images = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    texts = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    image_ranks, text_ranks = retrieval_ranks(images, texts, torch.tensor([0, 1, 2]))
    # Text 1 scores images 0 and 1 equally; image 0 has the lower index, so image 1 is ranked 2nd.
    assert text_ranks.tolist() == [0, 1, 0]
    assert image_ranks.tolist() == [0, 1, 0]
    # Image 1 with captions 1 and 3: caption 3 ties with caption 0 (lower index, a negative), and
    # caption 1 is an exact match too; the best caption (1) is preceded only by caption 0.
    texts4 = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    image_ranks, text_ranks = retrieval_ranks(images, texts4, torch.tensor([0, 1, 2, 1]))
    assert image_ranks.tolist() == [0, 1, 0]
    assert text_ranks.tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="no caption"):
        retrieval_metrics(images, texts, torch.tensor([1, 1, 2]))


def test_metrics_match_open_clip_single_caption():
    generator = torch.Generator().manual_seed(3)
    images = F.normalize(torch.randn(257, 24, generator=generator), dim=-1)
    texts = F.normalize(images + 0.9 * torch.randn(257, 24, generator=generator), dim=-1)
    ours = retrieval_metrics(images, texts, torch.arange(257), chunk_size=50)
    reference = get_clip_metrics(images, texts, torch.tensor(1.0))
    for key, value in reference.items():
        assert ours[key] == pytest.approx(float(value), abs=1e-12), key
    assert ours["num_images"] == 257 and ours["num_texts"] == 257
    assert 0 < ours["image_to_text_R@1"] < ours["image_to_text_R@10"] < 1


@pytest.mark.parametrize("seed", range(4))
def test_recall_matches_clip_benchmark_several_captions(seed):
    generator = torch.Generator().manual_seed(100 + seed)
    num_images, per_image = 90, 1 + seed % 3
    images = F.normalize(torch.randn(num_images, 16, generator=generator), dim=-1)
    t2i = torch.arange(num_images).repeat_interleave(per_image)
    texts = F.normalize(images[t2i] + 1.2 * torch.randn(t2i.numel(), 16, generator=generator), dim=-1)
    ours = retrieval_metrics(images, texts, t2i, chunk_size=17)
    scores = texts @ images.t()
    positive = torch.zeros_like(scores, dtype=torch.bool)
    positive[torch.arange(len(scores)), t2i] = True
    for k in (1, 5, 10):
        # clip_benchmark: image_retrieval = text->image, text_retrieval = image->text.
        image_retrieval = (batchify(recall_at_k, scores, positive, 32, "cpu", k=k) > 0).float().mean()
        text_retrieval = (batchify(recall_at_k, scores.T, positive.T, 32, "cpu", k=k) > 0).float().mean()
        assert ours[f"text_to_image_R@{k}"] == pytest.approx(image_retrieval.item(), abs=1e-6)
        assert ours[f"image_to_text_R@{k}"] == pytest.approx(text_retrieval.item(), abs=1e-6)


def test_image_rank_is_best_caption_rank():
    images = torch.eye(3)
    # Image 0 has captions 0 (poor) and 3 (exact); image 1 caption 1; image 2 caption 2.
    texts = torch.tensor([[0.1, 0.9, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    t2i = torch.tensor([0, 1, 2, 0])
    image_ranks, text_ranks = retrieval_ranks(images, texts, t2i)
    assert image_ranks.tolist() == [0, 0, 0]
    assert text_ranks.tolist() == [1, 0, 0, 0]
    metrics = retrieval_metrics(images, texts, t2i)
    assert metrics["image_to_text_R@1"] == 1.0
    assert metrics["text_to_image_R@1"] == 0.75
    assert metrics["text_to_image_mean_rank"] == 1.25
    assert metrics["text_to_image_median_rank"] == 1.0


def test_median_rank_uses_floor_of_numpy_median():
    ranks = torch.tensor([0, 1, 2, 3])
    # Craft scores so that text ranks are exactly 0,1,2,3: text t prefers images 0..t-1 over its own.
    images = torch.eye(4)
    texts = torch.stack([torch.tensor([1.0 if j < t else 0.0 for j in range(4)]) +
                         0.5 * F.one_hot(torch.tensor(t), 4) for t in range(4)])
    _, text_ranks = retrieval_ranks(images, texts, torch.arange(4))
    assert text_ranks.tolist() == ranks.tolist()
    metrics = retrieval_metrics(images, texts, torch.arange(4))
    assert metrics["text_to_image_median_rank"] == np.floor(np.median([0, 1, 2, 3])) + 1 == 2.0
    assert metrics["text_to_image_mean_rank"] == 2.5


def test_chunk_size_does_not_change_results():
    generator = torch.Generator().manual_seed(7)
    images = integer_features(generator, 101)
    t2i = random_text_to_image(generator, 101, 60)
    texts = integer_features(generator, t2i.numel())
    results = [retrieval_metrics(images, texts, t2i, chunk_size=c) for c in (1, 7, 100, 101, 5000)]
    assert all(r == results[0] for r in results[1:])


def test_input_validation():
    images, texts = torch.randn(3, 4), torch.randn(3, 4)
    with pytest.raises(ValueError, match="lie in"):
        retrieval_metrics(images, texts, torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="one entry per text"):
        retrieval_metrics(images, texts, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="feature sizes"):
        retrieval_metrics(images, torch.randn(3, 5), torch.tensor([0, 1, 2]))


def test_large_n_smoke_20k_chunked():
    generator = torch.Generator().manual_seed(0)
    n, dim = 20_000, 32
    images = F.normalize(torch.randn(n, dim, generator=generator), dim=-1)
    texts = F.normalize(images + 0.35 * torch.randn(n, dim, generator=generator), dim=-1)
    image_ranks, text_ranks = retrieval_ranks(images, texts, torch.arange(n), chunk_size=2048)
    # Spot-check rows against a direct count (no tie can occur with continuous random features).
    rows = torch.randint(0, n, (64,), generator=generator)
    scores = texts[rows] @ images.t()
    expected = (scores > scores[torch.arange(64), rows].unsqueeze(1)).sum(1)
    assert torch.equal(text_ranks[rows], expected)
    scores_i = images[rows] @ texts.t()
    expected_i = (scores_i > scores_i[torch.arange(64), rows].unsqueeze(1)).sum(1)
    assert torch.equal(image_ranks[rows], expected_i)
    # Noisy pairs: some texts find their image first, not all; more within the top 10.
    recall_at_1 = float((text_ranks == 0).float().mean())
    assert 0.0 < recall_at_1 < float((text_ranks < 10).float().mean()) < 1.0
    assert image_ranks.max() < n and text_ranks.min() == 0


def test_validation_loss_is_open_clip_batchwise_loss():
    generator = torch.Generator().manual_seed(1)
    images = F.normalize(torch.randn(10, 8, generator=generator), dim=-1)
    texts = F.normalize(torch.randn(10, 8, generator=generator), dim=-1)
    scale = 14.0
    expected = 0.0
    for start, size in ((0, 4), (4, 4), (8, 2)):
        logits = scale * images[start:start + size] @ texts[start:start + size].t()
        labels = torch.arange(size)
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        expected += loss.item() * size
    assert clip_validation_loss(images, texts, scale, batch_size=4) == pytest.approx(expected / 10)
    assert clip_validation_loss(images, texts, scale, 4) != pytest.approx(
        clip_validation_loss(images, texts, scale, 10))
