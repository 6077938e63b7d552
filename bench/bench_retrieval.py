"""Retrieval metrics from features: vlcontrast vs CLIP_benchmark, time and peak extra memory.

    python bench/bench_retrieval.py                      # 13,443 x 13,443, D=512 (CC3M validation)
    python bench/bench_retrieval.py --n 100000 --only-ours   # the 100K x 100K run

Each implementation runs in its own subprocess so peak memory (ru_maxrss) is its own; "extra" memory
is the peak minus the RSS after the features were created. CLIP_benchmark's path is what its
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


def run_one(impl: str, n: int, dim: int, chunk: int, batch: int) -> dict:
    import torch

    images, texts = features(n, dim)
    base = rss_mb()
    start = time.perf_counter()
    if impl == "vlcontrast":
        from vlcontrast.evaluation import retrieval_metrics

        metrics = retrieval_metrics(images, texts, torch.arange(n), chunk_size=chunk)
        recalls = {k: metrics[f"image_to_text_R@{k}"] for k in (1, 5, 10)}
    else:
        from clip_benchmark.metrics.zeroshot_retrieval import batchify, recall_at_k

        scores = texts @ images.t()
        positive = torch.zeros_like(scores, dtype=torch.bool)
        positive[torch.arange(len(scores)), torch.arange(n)] = True
        recalls = {}
        for k in (1, 5, 10):
            _ = (batchify(recall_at_k, scores, positive, batch, "cpu", k=k) > 0).float().mean().item()
            recalls[k] = (batchify(recall_at_k, scores.T, positive.T, batch, "cpu", k=k) > 0
                          ).float().mean().item()
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
        print(json.dumps(run_one(args.worker, args.n, args.dim, args.chunk, args.batch)))
        return
    results = []
    for impl in ["vlcontrast"] + ([] if args.only_ours else ["clip_benchmark"]):
        command = [sys.executable, __file__, "--worker", impl, "--n", str(args.n), "--dim",
                   str(args.dim), "--chunk", str(args.chunk), "--batch", str(args.batch)]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(output.strip().splitlines()[-1]))
    print(f"N={args.n} D={args.dim}")
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
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
