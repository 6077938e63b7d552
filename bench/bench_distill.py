"""Training throughput with a teacher in the loop (online) against its stored embeddings (offline).

Student ``vlc-rn-micro`` (1.9 M parameters), teacher ``vlc-rn-tiny-32`` (12.0 M, 6.2x; the demo's
model, seeded weights: speed does not depend on them), both at 32 px, on a small synthetic set whose
transformed images are kept in memory (``data.cache_mb``), so decoding is out of the comparison.
Each arm is a real ``vlcontrast train`` run of ``--steps`` steps at ``--batch``; samples/s and the
time per step of each phase come from its ``metrics.jsonl``, averaged over the log windows after
step 20 (the first epoch decodes; later ones read memory). The teacher's forward runs in the
``data`` phase (before the step), the distillation term in ``loss``. Also prints the one-off cost
of ``prep teacher``.

    python bench/bench_distill.py [--steps 40 --batch 64 --threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench/ is on the path, the repository root not
    sys.path.insert(0, str(ROOT))

from bench import provenance  # noqa: E402

STUDENT, TEACHER = "vlc-rn-micro", "vlc-rn-tiny-32"


def _parameters(name: str) -> int:
    from vlcontrast.config import ModelConfig
    from vlcontrast.models import build_model

    return sum(p.numel() for p in build_model(ModelConfig(name=name)).model.parameters())


def _run(root: Path, name: str, steps: int, batch: int, extra: dict) -> dict:
    from vlcontrast.config import load_config
    from vlcontrast.train.loop import train

    values = {"output_dir": root / name, "data.train": root / "data" / "train",
              "data.batch_size": batch, "data.workers": 0, "data.augment": False,
              "data.cache_mb": 256, "model.name": STUDENT, "loss.name": "infonce",
              "train.steps": steps, "train.log_every": 10, "optim.warmup_steps": 5,
              "eval.retrieval": "none", "logging.progress": False,
              "logging.tensorboard": False, "checkpoint.every": 0, **extra}
    train(load_config(None, [f"{key}={value}" for key, value in values.items()]))
    rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    # The first epoch reads and decodes the shards; the windows after step 20 come from memory.
    windows = [row for row in rows if row.get("kind") == "train" and row["step"] > 20]
    mean = {key: sum(row[key] for row in windows) / len(windows)
            for key in windows[0] if key == "samples_per_s" or key.startswith("time/")}
    return mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--samples", type=int, default=1024, help="synthetic training samples (16 steps of 64: the windows measured read the in-memory cache)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2,
                        help="the arms run round-robin this many times; each keeps its best round "
                        "(a shared machine's neighbours slow some rounds down)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary folder (data, teacher, runs; about 230 MB) and "
                        "print its path; by default it is removed, also on failure")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    from vlcontrast.config import ModelConfig
    from vlcontrast.data.prep.synthetic import write_synthetic
    from vlcontrast.distill.offline import write_teacher_features
    from vlcontrast.models import build_model

    root = Path(tempfile.mkdtemp(prefix="bench-distill-"))
    try:
        write_synthetic(root / "data", train=args.samples, val=64, zeroshot_per_class=1, seed=0,
                        image_size=32, shard_size=1024, workers=1, progress=False)
        torch.manual_seed(0)
        weights = root / "teacher.pt"
        torch.save(build_model(ModelConfig(name=TEACHER)).model.state_dict(), weights)
        start = time.perf_counter()
        write_teacher_features(str(root / "data" / "train"), root / "features.pt", teacher=TEACHER,
                               pretrained=str(weights), augmentations=0)
        prep_seconds = time.perf_counter() - start
        online = {"distill.teacher": TEACHER, "distill.teacher_pretrained": weights}
        offline = {"distill.teacher_features": root / "features.pt"}
        arms = {
            "student alone": {},
            "online logits": {**online, "distill.kind": "logits"},
            "online features": {**online, "distill.kind": "features", "distill.projection": "true"},
            "online interactive": {**online, "distill.kind": "interactive",
                                   "distill.projection": "true"},
            "offline logits": {**offline, "distill.kind": "logits"},
            "offline interactive": {**offline, "distill.kind": "interactive",
                                    "distill.projection": "true"},
        }
        results: dict[str, dict] = {}
        for round_ in range(args.rounds):
            for name, extra in arms.items():
                measured = _run(root, f"{name.replace(' ', '-')}-{round_}", args.steps, args.batch,
                                extra)
                if name not in results or measured["samples_per_s"] > results[name]["samples_per_s"]:
                    results[name] = measured
        base = results["student alone"]["samples_per_s"]
        student, teacher = _parameters(STUDENT), _parameters(TEACHER)
        print(f"student {STUDENT} {student / 1e6:.2f} M parameters, teacher {TEACHER} "
              f"{teacher / 1e6:.2f} M ({teacher / student:.1f}x); batch {args.batch}, "
              f"{args.steps} steps, {args.threads} threads, best of {args.rounds} rounds; prep "
              f"teacher over {args.samples} samples: {prep_seconds:.1f} s\n")
        print("| arm | samples/s | vs alone | data+teacher ms | loss ms | step total ms |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, values in results.items():
            total = sum(v for k, v in values.items() if k.startswith("time/")) * 1e3
            print(f"| {name} | {values['samples_per_s']:.0f} | {values['samples_per_s'] / base:.2f} | "
                  f"{values.get('time/data', 0) * 1e3:.1f} | {values.get('time/loss', 0) * 1e3:.1f} | "
                  f"{total:.1f} |")

        print(f"\n{provenance.line(('deepspeed', 'open_clip_torch'))}")
    finally:
        if args.keep:
            print(f"kept {root} (--keep)")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
