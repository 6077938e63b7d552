"""End-to-end training throughput: ``vlcontrast train`` against open_clip's own trainer.

Both trainers read the same synthetic webdataset shards, build the same open_clip model config
(``vlcontrast/models/configs/vlc-micro.json`` by default, registered with ``open_clip.add_model_config`` for
open_clip), and run the same number of steps with the same per-process batch size, precision
(fp32), data workers, learning-rate schedule shape, loss (InfoNCE; open_clip's ``ClipLoss`` with
``--local-loss --gather-with-grad``, which is what vlcontrast's loss computes across ranks) and
``OMP_NUM_THREADS`` (``--threads``, 1 by default), once with one process and once with two
(``torchrun``, gloo). Evaluation and checkpointing are off in open_clip; vlcontrast writes its final checkpoint
after the last step, outside the timed windows.

Throughput is each trainer's own per-window figure: vlcontrast's ``samples_per_s`` from
``metrics.jsonl``, open_clip's ``global batch / Batch (t)`` from its log; both windows span data
wait + step. The first ``--skip-fraction`` of the steps is warm-up and not counted; a run's figure
is the median of its remaining windows, a configuration's the median over repetitions. Peak memory
is the largest sum of RSS over the launched process tree (trainer ranks and data workers, polled
every 0.1 s; shared pages count once per process, alike for both). Repetitions alternate the order
(A B, B A, ...) so drift in a shared machine's load hits both alike.

    python bench/bench_train.py                         # 1 and 2 processes, 3 repetitions
    python bench/bench_train.py --nprocs 1 --repeats 1 --steps 60
    python bench/bench_train.py --deepspeed-engine      # also train.engine=deepspeed

Prints a table and writes ``--output`` (default ``bench/results/train.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench/ is on the path, the repository root not
    sys.path.insert(0, str(ROOT))

from bench import openclip_launch  # noqa: E402

# --------------------------------------------------------------------------------------------
# running one trainer and watching its memory


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_watched(cmd: list[str], env: dict, log_path: Path, timeout: int) -> dict:
    """Run ``cmd``, polling the RSS of its process tree; returns rc, wall seconds, peak bytes."""
    peak = [0]
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        done = threading.Event()

        def poll():
            while not done.is_set():
                peak[0] = max(peak[0], _tree_rss(proc.pid))
                done.wait(0.1)

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = proc.wait()
        finally:
            done.set()
            watcher.join()
    return {"rc": rc, "wall_s": time.perf_counter() - start, "peak_rss": peak[0]}


def _env(args, nproc: int) -> dict:
    threads = args.threads or max(1, (os.cpu_count() or 1) // nproc)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    # DeepSpeed compiles a CPU comm op into this cache at start-up; the default one is shared with
    # other jobs on the machine, which can make every run recompile it (minutes of start-up).
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "runs" / ".torch_extensions-bench"))
    if nproc == 1:  # a single vlcontrast process still binds MASTER_PORT (default 29500)
        env["MASTER_PORT"] = str(_free_port())
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _steady(values: list[tuple[int, float]], steps: int, skip_fraction: float) -> list[float]:
    """Window values whose window ends after the warm-up part of the run."""
    kept = [v for step, v in values if step > skip_fraction * steps]
    return kept or [v for _, v in values[-1:]]


def run_vlcontrast(args, nproc: int, work: Path, tag: str, engine: str = "auto") -> dict:
    tag = tag if engine == "auto" else f"{tag}-{engine}"
    run_dir = work / f"vlc-{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "vlcontrast.cli", "train", "--nproc", str(nproc),
           f"output_dir={run_dir}", f"data.train={args.data}/train", "data.val=",
           f"model.name={args.model}", f"data.batch_size={args.batch_size}",
           f"data.workers={args.workers}", "data.shuffle_buffer=1000", f"train.steps={args.steps}",
           "train.precision=fp32", f"train.log_every={args.log_every}", f"optim.lr={args.lr}",
           "optim.weight_decay=0.1", f"optim.warmup_steps={args.warmup}", "loss.name=infonce",
           "checkpoint.every=0", "checkpoint.keep=1", "eval.zeroshot=", "eval.retrieval=none",
           "logging.tensorboard=false", "logging.progress=false", f"seed={args.seed}",
           f"train.engine={engine}"]
    result = run_watched(cmd, _env(args, nproc), work / f"vlc-{tag}.log", args.timeout)
    records = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    if result["rc"] != 0 or not train:
        tail = (work / f"vlc-{tag}.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"vlcontrast run failed (rc {result['rc']}):\n{tail}")
    steady = [r for r in train if r["step"] > args.skip_fraction * args.steps] or train[-1:]
    result["samples_per_s"] = statistics.median(r["samples_per_s"] for r in steady)
    result["split_ms"] = {k[5:]: 1000 * statistics.median(r[k] for r in steady)
                          for k in steady[0] if k.startswith("time/")}
    return result


def run_open_clip(args, nproc: int, work: Path, tag: str) -> dict:
    logs = work / f"oc-{tag}"
    shutil.rmtree(logs, ignore_errors=True)
    model_json = _model_json(args.model)
    train_args = openclip_launch.train_args(
        data=_shard_pattern(Path(args.data) / "train"), model_name=model_json.stem,
        batch_size=args.batch_size, steps=args.steps, nproc=nproc, workers=args.workers,
        precision="fp32", lr=args.lr, warmup=args.warmup, log_every=args.log_every, logs=logs,
        seed=args.seed, device="cpu", weight_decay=0.1,
        extra=("--local-loss", "--gather-with-grad", "--dist-backend", "gloo"))
    cmd = openclip_launch.command(work, tag, train_args, model_config=model_json, nproc=nproc)
    result = run_watched(cmd, _env(args, nproc), work / f"oc-{tag}.log", args.timeout)
    text = (work / f"oc-{tag}.log").read_text(errors="replace")
    global_batch = args.batch_size * nproc
    windows = openclip_launch.parse_windows(text, global_batch)
    if result["rc"] != 0 or not windows:
        raise RuntimeError(f"open_clip run failed (rc {result['rc']}):\n{text[-2000:]}")
    # open_clip's first log line is step 0 alone (start-up); windows are log_every steps after it.
    steady = windows[1:]
    rates = _steady([(w.step, w.samples_per_s) for w in steady], args.steps, args.skip_fraction)
    data = _steady([(w.step, w.data_s) for w in steady], args.steps, args.skip_fraction)
    batch = _steady([(w.step, w.batch_s) for w in steady], args.steps, args.skip_fraction)
    result["samples_per_s"] = statistics.median(rates)
    result["split_ms"] = {"data": 1000 * statistics.median(data),
                          "step": 1000 * statistics.median(batch)}
    return result


def _model_json(model: str) -> Path:
    from vlcontrast.models import find_model_config_file

    path = find_model_config_file(model)
    if path is None:
        raise SystemExit(f"--model {model}: no model-config JSON of that name or path")
    return path.resolve()


def _shard_pattern(directory: Path) -> str:
    shards = sorted(p.name for p in directory.glob("*.tar"))
    first, last = shards[0].split(".")[0], shards[-1].split(".")[0]
    return str(directory / f"{{{first}..{last}}}.tar")


def ensure_data(args) -> None:
    if (Path(args.data) / "train" / "manifest.json").is_file():
        return
    from vlcontrast.data.prep.synthetic import write_synthetic

    needed = args.steps * args.batch_size * max(args.nprocs)
    print(f"writing {needed} synthetic samples to {args.data}", flush=True)
    write_synthetic(args.data, train=max(needed, 4000), val=0, zeroshot_per_class=0, seed=0,
                    image_size=args.image_size, shard_size=500, progress=False)


# --------------------------------------------------------------------------------------------
# report


def _versions() -> dict:
    import deepspeed
    import open_clip
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"python": platform.python_version(), "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "open_clip": open_clip.__version__,
            "cpu": f"{cpu}, {os.cpu_count()} logical cores", "os": platform.platform()}


def _fmt_range(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.0f}"
    return f"{statistics.median(values):.0f} ({min(values):.0f}–{max(values):.0f})"


def _provenance(packages: tuple[str, ...] = ()) -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import provenance

    return provenance.line(packages)


def build_report(args, runs: dict, versions: dict, command: str) -> str:
    lines = ["# End-to-end training throughput: vlcontrast vs open_clip", "",
             f"Command: `{command}`", "",
             f"Machine: {versions['cpu']}; {versions['os']}. Python {versions['python']}, torch "
             f"{versions['torch']}, DeepSpeed {versions['deepspeed']}, open_clip {versions['open_clip']}.",
             "", f"Provenance: {_provenance(('deepspeed', 'open_clip_torch'))}.",
             "",
             f"Setup: model `{args.model}` ({args.image_size} px), {args.steps} steps of "
             f"{args.batch_size} samples per process, fp32, {args.workers} data worker(s) per "
             f"process, `OMP_NUM_THREADS={args.threads or 'cores / processes'}`, InfoNCE, no evaluation. "
             f"Throughput: median over windows of {args.log_every} steps after the first "
             f"{args.skip_fraction:.0%} of the run, then median over {args.repeats} alternating "
             "repetitions (min–max in brackets). Peak memory: the process tree's summed RSS.", "",
             "| processes | trainer | samples/s | peak RSS (MiB) | wall (s) | vlcontrast / open_clip |",
             "|---:|---|---:|---:|---:|---:|"]
    ours_names = [name for name in TRAINERS if name != "open_clip"
                  and any(key[0] == name for key in runs)]
    for nproc in args.nprocs:
        theirs = runs[("open_clip", nproc)]
        for name in ours_names + ["open_clip"]:
            results = runs[(name, nproc)]
            rates = [r["samples_per_s"] for r in results]
            rss = statistics.median(r["peak_rss"] for r in results) / 2**20
            wall = statistics.median(r["wall_s"] for r in results)
            ratio = statistics.median(rates) / statistics.median(r["samples_per_s"] for r in theirs)
            lines.append(f"| {nproc} | {name} | {_fmt_range(rates)} | {rss:.0f} | {wall:.0f} | "
                         + (f"**{ratio:.2f}×** |" if name != "open_clip" else " |"))
    lines += ["", "Where the time goes (milliseconds per step, medians). vlcontrast splits a step "
              "into data wait, forward, loss, backward (`engine.backward`) and optimizer "
              "step (`engine.step`); open_clip logs only data wait and the whole step.", "",
              "| processes | trainer | data | forward | loss | backward | step | whole step |",
              "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for nproc in args.nprocs:
        theirs = runs[("open_clip", nproc)]
        keys = ("data", "forward", "loss", "backward", "step")
        for name in ours_names:
            ours = runs[(name, nproc)]
            split = {k: statistics.median(r["split_ms"].get(k, 0.0) for r in ours) for k in keys}
            whole = 1000 * args.batch_size * nproc / statistics.median(r["samples_per_s"]
                                                                       for r in ours)
            lines.append(f"| {nproc} | {name} | " + " | ".join(f"{split[k]:.1f}" for k in keys)
                         + f" | {whole:.1f} |")
        data = statistics.median(r["split_ms"]["data"] for r in theirs)
        step = statistics.median(r["split_ms"]["step"] for r in theirs)
        lines.append(f"| {nproc} | open_clip | {data:.1f} | – | – | – | – | {step:.1f} |")
    return "\n".join(lines) + "\n"


TRAINERS = {"vlcontrast": run_vlcontrast,
            "vlcontrast-deepspeed": lambda *a: run_vlcontrast(*a, engine="deepspeed"),
            "open_clip": run_open_clip}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT / "data" / "bench-micro32"),
                        help="synthetic dataset root (written if missing)")
    parser.add_argument("--model", default="vlc-micro", help="a shipped model config name or a JSON path")
    parser.add_argument("--image-size", type=int, default=32, help="image size when writing data")
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--skip-fraction", type=float, default=0.25)
    parser.add_argument("--nprocs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS per process, both trainers (0: cores / processes). "
                             "1 by default: on a shared machine multi-threaded OpenMP spin-waits "
                             "against other jobs and the numbers become noise")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--deepspeed-engine", action="store_true",
                        help="also run vlcontrast through DeepSpeed's engine (train.engine="
                             "deepspeed) beside the default, train.engine=auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "train.md"))
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args(argv)

    ensure_data(args)
    work = Path(tempfile.mkdtemp(prefix="bench_train_"))
    runs: dict = {}
    trainers = {name: TRAINERS[name] for name in TRAINERS
                if name != "vlcontrast-deepspeed" or args.deepspeed_engine}
    try:
        for repeat in range(args.repeats):
            for nproc in args.nprocs:
                order = list(trainers)
                if (repeat + nproc) % 2:
                    order.reverse()
                for name in order:
                    result = trainers[name](args, nproc, work, f"p{nproc}-r{repeat}")
                    runs.setdefault((name, nproc), []).append(result)
                    print(f"repeat {repeat} procs {nproc} {name:10s} {result['samples_per_s']:8.1f} "
                          f"samples/s  peak {result['peak_rss'] / 2**20:7.0f} MiB  "
                          f"wall {result['wall_s']:5.1f} s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"run directories kept in {work}")
    command = "python bench/bench_train.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = build_report(args, runs, _versions(), command.strip())
    print("\n" + report)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
