"""Channels-last against the default layout for a ResNet image tower, forward + backward, one run.

    python bench/bench_channels_last.py [--model vlc-rn-tiny] [--batch 128] [--threads 2]

Both layouts are timed alternately in one process (after warm-up) and the ratio is printed; the
result backs the choice in ``vlcontrast.models.use_channels_last``.
"""

import argparse
import time

import torch


def main() -> None:
    from vlcontrast.config import ModelConfig
    from vlcontrast.models import build_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vlc-rn-tiny")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bundle = build_model(ModelConfig(name=args.model), device="cpu")
    model, size = bundle.model, bundle.model.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    images = torch.randn(args.batch, 3, size, size)
    texts = torch.randint(0, 1000, (args.batch, 32))

    def seconds_per_step(layout) -> float:
        model.visual.to(memory_format=layout)
        batch = images.contiguous(memory_format=layout)
        for i in range(args.steps + 2):
            if i == 2:
                start = time.perf_counter()
            out = model.visual(batch)
            (out.float().square().mean() + model.encode_text(texts).float().square().mean()).backward()
        return (time.perf_counter() - start) / args.steps

    best = {"contiguous": float("inf"), "channels_last": float("inf")}
    for _ in range(args.rounds):
        best["contiguous"] = min(best["contiguous"], seconds_per_step(torch.contiguous_format))
        best["channels_last"] = min(best["channels_last"], seconds_per_step(torch.channels_last))
    print(f"| model | batch | threads | contiguous s/step | channels_last s/step | speed-up |")
    print(f"|---|---:|---:|---:|---:|---:|")
    print(f"| {args.model} | {args.batch} | {args.threads} | {best['contiguous']:.3f} | "
          f"{best['channels_last']:.3f} | {best['contiguous'] / best['channels_last']:.2f}x |")


if __name__ == "__main__":
    main()
