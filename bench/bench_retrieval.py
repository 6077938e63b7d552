"""Retrieval metrics from features: vlcontrast vs CLIP_benchmark, time and peak extra memory.

    python bench/bench_retrieval.py                      # 13,443 x 13,443, D=512 (CC3M validation)
    python bench/bench_retrieval.py --n 100000 --only-ours   # the 100K x 100K run

Each implementation runs in its own subprocess so peak memory (ru_maxrss) is its own; "extra" memory
is the peak minus the RSS after the features were created and both implementations were imported
and warmed on a tiny input (so neither side pays its imports, e.g. vlcontrast's package import of
about 170 MB, inside its figure), and the timer starts at the same point. CLIP_benchmark's path is what its
``zeroshot_retrieval.evaluate`` does after embedding: the full score matrix, the positive-pair
matrix, and ``batchify(recall_at_k, ...)`` per K and direction (batch = its dataloader batch size).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import provenance  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize() / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def features(n: int, dim: int, seed: int = 0):
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(seed)
    images = F.normalize(torch.randn(n, dim, generator=generator), dim=-1)
    texts = F.normalize(images + 1.5 * torch.randn(n, dim, generator=generator), dim=-1)
    return images, texts


def _vlcontrast(images, texts, chunk: int) -> dict:
    import torch
    from vlcontrast.evaluation import retrieval_metrics

    metrics = retrieval_metrics(images, texts, torch.arange(len(images)), chunk_size=chunk)
    return {k: metrics[f"image_to_text_R@{k}"] for k in (1, 5, 10)}


def _clip_benchmark(images, texts, batch: int) -> dict:
    import torch
    from clip_benchmark.metrics.zeroshot_retrieval import batchify, recall_at_k

    n = len(images)
    scores = texts @ images.t()
    positive = torch.zeros_like(scores, dtype=torch.bool)
    positive[torch.arange(len(scores)), torch.arange(n)] = True
    recalls = {}
    for k in (1, 5, 10):
        _ = (batchify(recall_at_k, scores, positive, batch, "cpu", k=k) > 0).float().mean().item()
        recalls[k] = (batchify(recall_at_k, scores.T, positive.T, batch, "cpu", k=k) > 0
                      ).float().mean().item()
    return recalls


def run_one(impl: str, n: int, dim: int, chunk: int, batch: int, only_ours: bool = False) -> dict:
    # Import and warm both implementations (the one measured and, unless --only-ours, the other)
    # before the baseline and the timer, in every worker alike: the figures are the metric's own.
    small_images, small_texts = features(16, dim, seed=1)
    _vlcontrast(small_images, small_texts, chunk)
    if not only_ours:
        _clip_benchmark(small_images, small_texts, batch)
    del small_images, small_texts
    images, texts = features(n, dim)
    base = rss_mb()
    start = time.perf_counter()
    if impl == "vlcontrast":
        recalls = _vlcontrast(images, texts, chunk)
    else:
        recalls = _clip_benchmark(images, texts, batch)
    seconds = time.perf_counter() - start
    return {"impl": impl, "n": n, "dim": dim, "seconds": seconds,
            "extra_peak_mb": max(peak_mb() - base, 0.0), "image_to_text_R": recalls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=13443)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=1024, help="vlcontrast chunk_size")
    parser.add_argument("--batch", type=int, default=64, help="CLIP_benchmark batch size")
    parser.add_argument("--only-ours", action="store_true")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_one(args.worker, args.n, args.dim, args.chunk, args.batch,
                                 args.only_ours)))
        return
    results = []
    for impl in ["vlcontrast"] + ([] if args.only_ours else ["clip_benchmark"]):
        command = [sys.executable, __file__, "--worker", impl, "--n", str(args.n), "--dim",
                   str(args.dim), "--chunk", str(args.chunk), "--batch", str(args.batch)]
        command += ["--only-ours"] if args.only_ours else []
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(output.strip().splitlines()[-1]))
    info = provenance.line(("clip-benchmark",))
    print(f"N={args.n} D={args.dim}; {info}")
    print(f"{'implementation':<16}{'seconds':>10}{'extra peak MB':>16}  R@1/5/10 (image->text)")
    for r in results:
        recalls = "/".join(f"{v:.4f}" for v in r["image_to_text_R"].values())
        print(f"{r['impl']:<16}{r['seconds']:>10.2f}{r['extra_peak_mb']:>16.0f}  {recalls}")
    if len(results) == 2:
        ours, theirs = results
        agree = all(abs(ours["image_to_text_R"][k] - theirs["image_to_text_R"][k]) < 1e-4
                    for k in ours["image_to_text_R"])
        print(f"recalls agree: {agree}")
        print(f"time ratio {ours['seconds'] / theirs['seconds']:.3f}, "
              f"extra-memory ratio {ours['extra_peak_mb'] / max(theirs['extra_peak_mb'], 1):.3f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"provenance": info, "command": " ".join(sys.argv), "results": results},
                      handle, indent=2)


if __name__ == "__main__":
    main()
