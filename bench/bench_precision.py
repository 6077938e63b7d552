"""Training step time per ``train.precision`` on this machine, side by side in one run.

For each model, one single-process DeepSpeed engine per precision (``fp32``, ``amp_bf16``,
``bf16``) is built exactly as ``vlcontrast train`` builds it (:func:`build_engine`), and full
optimizer steps (forward, InfoNCE, backward, AdamW step) run on fixed random images and captions of
the model's resolution. The precisions take turns: ``--rounds`` rounds of ``--steps`` steps each,
after ``--warmup`` steps per engine, so slow drift in a shared machine's load hits every precision
alike; a precision's time is its fastest round (the spread, slowest / fastest, is shown). The ratio
is fp32's step time over the other's: above 1 means faster than fp32.

    python bench/bench_precision.py                          # vlc-tiny and vlc-rn-micro, batch 64
    python bench/bench_precision.py --models vlc-tiny --batch-size 128 --threads 2

Writes a markdown table to ``--output`` (default ``bench/results/precision.md``).
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _provenance(packages: tuple[str, ...] = ()) -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import provenance

    return provenance.line(packages)


def _init_single_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    dist.init_process_group("gloo", rank=0, world_size=1)


def _engine(model_name: str, precision: str, batch_size: int):
    import torch

    from vlcontrast.config import ModelConfig, load_config
    from vlcontrast.models import build_model
    from vlcontrast.train.engine import build_engine

    torch.manual_seed(0)
    bundle = build_model(ModelConfig(name=model_name))
    config = load_config(None, ["data.train=unused", "train.steps=1000",
                                f"data.batch_size={batch_size}", f"train.precision={precision}",
                                "optim.warmup_steps=0", "logging.progress=false"])
    engine, _ = build_engine(bundle.model, optim=config.optim, train=config.train, deepspeed=config.deepspeed,
                             micro_batch_size=config.data.batch_size, total_steps=1000, world_size=1)
    return bundle, engine


def _step(engine, loss_fn, images, texts, sample_ids) -> float:
    out = engine(images, texts)
    result = loss_fn(out["image_features"], out["text_features"], out["logit_scale"],
                     sample_ids=sample_ids)
    engine.backward(result["loss"])
    engine.step()
    return float(result["loss"].detach())


def measure(model_name: str, precisions: list[str], batch_size: int, warmup: int, steps: int,
            rounds: int) -> dict[str, list[float]]:
    """Seconds per step of each precision in each round."""
    import torch

    from vlcontrast.losses import build_loss
    from vlcontrast.train.precision import Precision

    loss_fn = build_loss("infonce")
    engines = {}
    for precision in precisions:
        bundle, engine = _engine(model_name, precision, batch_size)
        size = bundle.model_config["model_cfg"]["vision_cfg"]["image_size"]
        generator = torch.Generator().manual_seed(0)
        images = torch.rand(batch_size, 3, size, size, generator=generator).to(Precision(precision).parameter_dtype)
        texts = bundle.tokenizer([f"a photo of thing {i}" for i in range(batch_size)])
        sample_ids = torch.arange(batch_size)
        for _ in range(warmup):
            _step(engine, loss_fn, images, texts, sample_ids)
        engines[precision] = (engine, images, texts, sample_ids)
    times: dict[str, list[float]] = {p: [] for p in precisions}
    for _ in range(rounds):
        for precision in precisions:
            engine, images, texts, sample_ids = engines[precision]
            start = time.perf_counter()
            for _ in range(steps):
                loss = _step(engine, loss_fn, images, texts, sample_ids)
            times[precision].append((time.perf_counter() - start) / steps)
            if loss != loss:
                raise RuntimeError(f"{model_name} {precision}: the loss became NaN")
    return times


def _cpu_flags() -> str:
    """Which of the CPU extensions that matter for bf16/fp16 this machine reports."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split()
    except (OSError, IndexError):
        return "unknown"
    return ", ".join(f"{f} {'yes' if f in flags else 'no'}"
                     for f in ("avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["vlc-tiny", "vlc-rn-micro"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "amp_bf16", "bf16"])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (OMP_NUM_THREADS)")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "precision.md"))
    args = parser.parse_args(argv)

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    torch.set_num_threads(args.threads)
    _init_single_process_group()
    shown = sys.argv[1:] if argv is None else argv
    lines = [f"Command: `{' '.join(['python bench/bench_precision.py', *shown])}`",
             "",
             f"Machine: {platform.processor() or platform.machine()}, CPU flags: {_cpu_flags()}; "
             f"torch {torch.__version__}, {args.threads} thread(s), batch {args.batch_size}, "
             f"{args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up steps.",
             "",
             f"Provenance: {_provenance(('deepspeed',))}.",
             "",
             "| model | precision | step (ms, fastest round) | spread | fp32 / this |",
             "|---|---|---|---|---|"]
    for model_name in args.models:
        times = measure(model_name, args.precisions, args.batch_size, args.warmup, args.steps,
                        args.rounds)
        base = min(times["fp32"]) if "fp32" in times else None
        for precision in args.precisions:
            best = min(times[precision])
            ratio = f"{base / best:.2f}x" if base else "-"
            lines.append(f"| {model_name} | {precision} | {1000 * best:.0f} | "
                         f"{max(times[precision]) / best:.2f} | {ratio} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
