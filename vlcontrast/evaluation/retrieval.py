"""Image-text retrieval metrics from embeddings: recall@K, mean/median rank, validation loss.

Definitions follow open_clip's ``get_clip_metrics`` (0-based rank of the true item; ``mean_rank`` is
``mean + 1``, ``median_rank`` is ``floor(median) + 1``; ``R@K`` is the share of queries whose rank is
below K) extended to several captions per image the way CLIP papers and CLIP_benchmark count: an
image is a hit at K when **any** of its captions is among its top K texts, i.e. its rank is the rank
of its best-ranked caption.

Ties are broken deterministically: the rank of a positive is the number of candidates with a strictly
higher score plus the number with an equal score at a lower index (a stable descending sort). The
score matrix is never materialised: queries are processed ``chunk_size`` rows at a time, so memory is
O(chunk_size x N) and a 100K x 100K evaluation fits in a few GB (see ``bench/bench_retrieval.py``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

DEFAULT_KS = (1, 5, 10)


class _Counter:
    """Per row of a score chunk: how many scores are > and == the row's threshold.

    On CPU the comparisons write into one reused boolean buffer and numpy counts them: torch's bool
    reductions are several times slower there, and fresh [chunk, N] allocations cost page faults.
    """

    def __init__(self, rows: int, columns: int, device: torch.device):
        self.on_cpu = device.type == "cpu"
        self.mask = np.empty((rows, columns), dtype=bool) if self.on_cpu else None

    def __call__(self, scores: torch.Tensor, threshold: torch.Tensor):
        if not self.on_cpu:
            return (scores > threshold).sum(dim=1), (scores == threshold).sum(dim=1)
        values, limit = scores.numpy(), threshold.numpy()
        mask = self.mask[: values.shape[0]]
        higher = np.count_nonzero(np.greater(values, limit, out=mask), axis=1)
        equal = np.count_nonzero(np.equal(values, limit, out=mask), axis=1)
        return torch.from_numpy(higher).long(), torch.from_numpy(equal).long()


def _positive_ranks(queries: torch.Tensor, candidates: torch.Tensor, pair_query: torch.Tensor,
                    pair_candidate: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """0-based rank of each query's best-ranked positive among all candidates.

    Positives are the pairs ``(pair_query[p], pair_candidate[p])``, sorted by ``pair_query``; every
    query must have at least one. Scores are ``queries @ candidates.T``, computed a chunk of queries
    at a time; the positive's score is read from the same chunk so it compares bit-exactly.
    """
    num_queries, num_candidates = queries.shape[0], candidates.shape[0]
    device = queries.device
    ranks = torch.empty(num_queries, dtype=torch.long, device=device)
    candidates_t = candidates.t().contiguous()
    rows_per_chunk = min(chunk_size, max(num_queries, 1))
    buffer = torch.empty(rows_per_chunk, num_candidates, dtype=queries.dtype, device=device)
    count = _Counter(rows_per_chunk, num_candidates, device)
    bounds = torch.searchsorted(pair_query, torch.arange(0, num_queries + chunk_size, chunk_size,
                                                         device=device).clamp_(max=num_queries))
    for chunk_index, start in enumerate(range(0, num_queries, chunk_size)):
        end = min(start + chunk_size, num_queries)
        scores = torch.matmul(queries[start:end], candidates_t, out=buffer[: end - start])
        lo, hi = int(bounds[chunk_index]), int(bounds[chunk_index + 1])
        rows = pair_query[lo:hi] - start
        cols = pair_candidate[lo:hi]
        values = scores[rows, cols]
        # Best positive per query: highest score, lowest index among equals (first in a stable sort).
        best = torch.full((end - start,), -math.inf, dtype=scores.dtype, device=device)
        best.scatter_reduce_(0, rows, values, reduce="amax")
        is_best = values == best[rows]
        first = torch.full((end - start,), num_candidates, dtype=torch.long, device=device)
        first.scatter_reduce_(0, rows[is_best], cols[is_best], reduce="amin")
        threshold = best.unsqueeze(1)
        higher, equal = count(scores, threshold)
        higher, equal = higher.to(device), equal.to(device)
        # Only rows with a tie need the index-aware count; they are rare, so do them separately.
        tied = torch.nonzero(equal > 1).flatten()
        if tied.numel():
            tied_scores = scores[tied]
            lower_index = torch.arange(num_candidates, device=device).unsqueeze(0) < first[tied].unsqueeze(1)
            higher[tied] += ((tied_scores == threshold[tied]) & lower_index).sum(dim=1)
        ranks[start:end] = higher
    return ranks


def _rank_summary(name: str, ranks: torch.Tensor, ks) -> dict[str, float]:
    ranks_np = ranks.cpu().numpy()
    out = {f"{name}_R@{k}": float(np.mean(ranks_np < k)) for k in ks}
    out[f"{name}_mean_rank"] = float(ranks_np.mean() + 1)
    out[f"{name}_median_rank"] = float(np.floor(np.median(ranks_np)) + 1)
    return out


def retrieval_ranks(image_features: torch.Tensor, text_features: torch.Tensor,
                    text_to_image: torch.Tensor, chunk_size: int = 4096
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(image_to_text ranks [N_images], text_to_image ranks [N_texts]), 0-based, see module doc."""
    if image_features.ndim != 2 or text_features.ndim != 2:
        raise ValueError("image_features and text_features must be 2-D [N, D]")
    if image_features.shape[1] != text_features.shape[1]:
        raise ValueError(f"feature sizes differ: images D={image_features.shape[1]}, "
                         f"texts D={text_features.shape[1]}")
    num_images, num_texts = image_features.shape[0], text_features.shape[0]
    device = image_features.device
    text_to_image = torch.as_tensor(text_to_image, dtype=torch.long).to(device)
    if text_to_image.shape != (num_texts,):
        raise ValueError(f"text_to_image must have one entry per text ({num_texts}), "
                         f"got shape {tuple(text_to_image.shape)}")
    if num_texts and (int(text_to_image.min()) < 0 or int(text_to_image.max()) >= num_images):
        raise ValueError(f"text_to_image values must lie in [0, {num_images})")
    captions_per_image = torch.bincount(text_to_image, minlength=num_images)
    if num_images and int(captions_per_image.min()) == 0:
        missing = int((captions_per_image == 0).sum())
        raise ValueError(f"{missing} image(s) have no caption in text_to_image")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    text_features = text_features.to(device=device, dtype=image_features.dtype)
    text_index = torch.arange(num_texts, device=device)
    text_ranks = _positive_ranks(text_features, image_features, text_index, text_to_image,
                                 chunk_size)
    order = torch.argsort(text_to_image, stable=True)
    image_ranks = _positive_ranks(image_features, text_features, text_to_image[order],
                                  text_index[order], chunk_size)
    return image_ranks, text_ranks


def retrieval_metrics(image_features: torch.Tensor, text_features: torch.Tensor,
                      text_to_image, ks=DEFAULT_KS, chunk_size: int = 4096) -> dict[str, float]:
    """Recall@K and mean/median rank in both directions.

    Args:
        image_features: ``[N_images, D]`` (normalised for cosine similarity; not re-normalised here).
        text_features: ``[N_texts, D]``.
        text_to_image: ``[N_texts]`` ints, the image index of each caption (several captions may
            point at one image; every image needs at least one).
        ks: the K of recall@K.
        chunk_size: query rows scored at once; memory is about ``chunk_size * N * 6`` bytes.

    Returns a flat dict: ``image_to_text_R@K``, ``text_to_image_R@K``, ``{direction}_mean_rank``,
    ``{direction}_median_rank``, ``num_images``, ``num_texts``.
    """
    image_ranks, text_ranks = retrieval_ranks(image_features, text_features, text_to_image,
                                              chunk_size)
    metrics: dict[str, float] = {}
    metrics.update(_rank_summary("image_to_text", image_ranks, ks))
    metrics.update(_rank_summary("text_to_image", text_ranks, ks))
    metrics["num_images"] = int(image_features.shape[0])
    metrics["num_texts"] = int(text_features.shape[0])
    return metrics


def clip_validation_loss(image_features: torch.Tensor, text_features: torch.Tensor,
                         logit_scale, batch_size: int) -> float:
    """open_clip's validation loss: symmetric InfoNCE within consecutive batches of ``batch_size``
    paired rows, averaged over samples (the last batch may be smaller). Depends on ``batch_size``,
    which is why it is always reported next to it."""
    if image_features.shape != text_features.shape:
        raise ValueError("validation loss needs paired rows: image and text features differ in shape")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    scale = torch.as_tensor(logit_scale, dtype=torch.float32).reshape(-1).mean().item()
    total, count = 0.0, 0
    for start in range(0, image_features.shape[0], batch_size):
        images = image_features[start:start + batch_size].float()
        texts = text_features[start:start + batch_size].float()
        logits = scale * images @ texts.t()
        labels = torch.arange(images.shape[0], device=logits.device)
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        total += float(loss) * images.shape[0]
        count += images.shape[0]
    return total / max(count, 1)
