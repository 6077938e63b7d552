"""One training step, vlcontrast's against a plain PyTorch step, like with like.

Arms (each: ``--warmup`` steps, then ``--steps`` timed steps between two device synchronisations):

- ``plain``: what open_clip's trainer does per step: the forward under autocast (in the run's
  precision), open_clip's ``ClipLoss``, torch AdamW (foreach on CUDA, as open_clip builds it),
  the lr set by hand, the logit-scale clamp;
- ``plain+syncs``: ``plain`` plus the two host reads vlcontrast's step made before it kept its
  flags on the device (an overflow ``bool`` before the update, a flag ``tolist`` after it);
- ``vlcontrast``: the train loop's own calls: ``train_step`` through the engine ``build_engine``
  picks at ZeRO 0 (``train.engine=auto``: the plain step of vlcontrast/train/torch_engine.py),
  the logit-scale clamp, the step timer, the flag ledger read every ``--log-every`` steps,
  vlcontrast's ``infonce``;
- ``vlcontrast+deepspeed``: ``vlcontrast`` through DeepSpeed's engine (``train.engine=deepspeed``),
  what the step cost before the torch engine;
- ``vlcontrast+syncs``: ``vlcontrast`` with the ledger read after every step (a host read a step,
  what the loop did before);
- ``vlcontrast+compile`` (not in the default list: compiling takes a minute or more on a GPU):
  ``vlcontrast`` with ``train.compile=true``;
- ``vlcontrast+cudagraphs`` (not in the default list either): ``train.compile=true`` with
  ``train.compile_mode=reduce-overhead``, the compiled step replayed as CUDA graphs.

Feeds (``--feeds``): ``none``, one fixed batch in (pinned) memory, and ``loader``, the same
synthetic ``DataLoader`` for every arm (``--workers`` processes decoding and transforming one PIL
image per sample with the model's training transform, pinned on CUDA): the loader's processes load
the same host for every arm. Ratios are to ``plain`` on the same feed.

    python bench/bench_step.py --models ViT-B-32,RN50 --batches 128,512 --out bench/results/gpu_check
    python bench/bench_step.py --micro --device cpu --steps 3 --warmup 1     # the CPU smoke run

MFU (CUDA only): samples/s x the model's training FLOPs per pair (vlcontrast/models/flops.py) /
the GPU's peak dense bf16 FLOP/s. Writes ``step_<date>.json`` and ``step.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench/ is on the path, the repository root not
    sys.path.insert(0, str(ROOT))

ARMS = ("plain", "plain+syncs", "vlcontrast", "vlcontrast+syncs", "vlcontrast+deepspeed")
OPTIONAL_ARMS = ("vlcontrast+compile", "vlcontrast+cudagraphs")
FEEDS = ("none", "loader")
MICRO = {"ViT": "vlc-micro", "RN": "vlc-rn-micro"}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="ViT-B-32,RN50")
    parser.add_argument("--micro", action="store_true",
                        help="the package's micro towers instead of --models (CPU smoke run)")
    parser.add_argument("--batches", default="128,512")
    parser.add_argument("--arms", default=",".join(ARMS),
                        help=f"comma list of {', '.join(ARMS + OPTIONAL_ARMS)}")
    parser.add_argument("--feeds", default=",".join(FEEDS))
    parser.add_argument("--precision", default="")
    parser.add_argument("--device", default="", help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--workers", type=int, default=0,
                        help="loader processes (0: min(8, cores - 2))")
    parser.add_argument("--peak-tflops", type=float, default=0.0)
    parser.add_argument("--out", default="", help="folder for step_<date>.json and step.md")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after each arm's timed steps, STEPS more under torch.profiler: "
                             "its table of the costliest ops (self CPU time, and self CUDA time "
                             "on a GPU) goes to --out as profile_<model>_b<batch>_<feed>_<arm>.txt")
    args = parser.parse_args(argv)
    wanted = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(wanted) - set(ARMS + OPTIONAL_ARMS))
    if unknown:
        parser.error(f"--arms: unknown {unknown}; valid: {', '.join(ARMS + OPTIONAL_ARMS)}")
    feeds = [f for f in args.feeds.split(",") if f]
    if set(feeds) - set(FEEDS):
        parser.error(f"--feeds: unknown {sorted(set(feeds) - set(FEEDS))}; valid: none, loader")
    args.arm_list, args.feed_list = wanted, feeds
    return args


# --------------------------------------------------------------------------------------------
# feeds


class SyntheticPairs:
    """``count`` pairs: one PIL image per sample through the model's training transform (the
    loader's CPU work), one tokenised caption, the sample id."""

    def __init__(self, transform, tokens, count: int):
        self.transform, self.tokens, self.count = transform, tokens, count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        from PIL import Image

        image = Image.new("RGB", (256, 256), (index % 251, 90, 60))
        return self.transform(image), self.tokens, index


def loader_feed(bundle, batch: int, workers: int, batches: int, pin: bool):
    import torch

    tokens = bundle.tokenizer(["a photo of a striped red square near the road"])[0]
    dataset = SyntheticPairs(bundle.preprocess_train, tokens, batch * batches)
    return iter(torch.utils.data.DataLoader(dataset, batch_size=batch, num_workers=workers,
                                            pin_memory=pin, drop_last=True,
                                            persistent_workers=False))


def fixed_batch(bundle, batch: int, pin: bool):
    import torch
    from PIL import Image

    one = bundle.preprocess_train(Image.new("RGB", (256, 256), (120, 90, 60)))
    generator = torch.Generator().manual_seed(0)
    images = torch.randn((batch, *one.shape), generator=generator)
    texts = bundle.tokenizer(["a photo of a striped red square near the road"] * batch)
    tensors = (images, texts, torch.arange(batch))
    return tuple(t.pin_memory() for t in tensors) if pin else tensors


# --------------------------------------------------------------------------------------------
# arms


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_arm(model, device, precision, total: int, syncs: bool):
    """open_clip's step (train_one_epoch): lr by hand, zero_grad, autocast forward and ClipLoss,
    backward, AdamW step, clamp; ``syncs`` adds the two host reads."""
    import open_clip
    import torch

    from vlcontrast.train.optimizer import parameter_groups

    groups = parameter_groups(model, 0.2)
    kwargs = {"foreach": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(groups, lr=5e-4, betas=(0.9, 0.98), eps=1e-6, **kwargs)
    loss_fn = open_clip.ClipLoss()
    dtype = precision.parameter_dtype

    def step(i, images, texts, _ids):
        for group in optimizer.param_groups:
            group["lr"] = 5e-4 * 0.5 * (1 + math.cos(math.pi * min(i, total) / total))
        images = images.to(device=device, dtype=dtype, non_blocking=True)
        texts = texts.to(device, non_blocking=True)
        optimizer.zero_grad()
        with precision.autocast_context(device):
            out = model(images, texts)
            loss = loss_fn(out["image_features"], out["text_features"], out["logit_scale"])
        bad = ~torch.isfinite(loss.detach())
        loss.backward()
        if syncs:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"]
                     if p.grad is not None]
            if not bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()):
                return
        optimizer.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        if syncs:
            torch.stack([bad.float(), torch.zeros((), device=device)]).tolist()

    return step, optimizer


def vlcontrast_arm(model, device, precision, batch: int, total: int, settle_every: int,
                   compiled: bool, engine_kind: str = "auto", compile_mode: str = "default"):
    """The loop's calls around one step (vlcontrast/train/loop.py), on one rank."""
    import torch

    from vlcontrast.config import load_config
    from vlcontrast.data.loader import Batch
    from vlcontrast.losses import build_loss
    from vlcontrast.train.engine import build_engine, clamp_logit_scale
    from vlcontrast.train.step import StepLedger, train_step
    from vlcontrast.train.steplog import StepTimer

    config = load_config(None, [f"train.precision={precision.name}", f"data.batch_size={batch}",
                                f"train.steps={total}", "optim.lr=0.0005",
                                "optim.warmup_steps=10", "loss.name=infonce",
                                f"train.compile={'true' if compiled else 'false'}",
                                f"train.engine={engine_kind}",
                                f"train.compile_mode={compile_mode}"])
    engine, _ = build_engine(model, optim=config.optim, train=config.train,
                             deepspeed=config.deepspeed, micro_batch_size=batch,
                             total_steps=total + 10_000, world_size=1)
    engine.train()
    loss_fn = build_loss("infonce", chunk_size=0, id_space=batch).to(device)
    timer, ledger = StepTimer(device), StepLedger()
    dtype = precision.parameter_dtype

    def step(i, images, texts, ids):
        timer.start()
        micro = [Batch(images, texts, ids)]
        timer.mark("data")
        loss_fn.diagnostics = (i + 1) % 10 == 0  # as the loop: at its log steps only
        outcome = train_step(engine, loss_fn, micro, i + 1, device, dtype, timer)
        ledger.record(i + 1, outcome)
        clamp_logit_scale(engine)
        if (i + 1) % settle_every == 0:
            ledger.settle()
        if (i + 1) % 10 == 0:
            timer.read()  # the log step's one event synchronisation

    return step, engine


# --------------------------------------------------------------------------------------------


def measure(step, feed, fixed, warmup: int, steps: int, device) -> tuple[float, float | None]:
    """Seconds per step over ``steps`` after ``warmup`` (between two synchronisations), and the
    first warm-up step's seconds (synchronised; a compiled arm's start-up: the compilation of
    the forward and backward), None without warm-up."""

    def one(i):
        if feed is not None:
            images, texts, ids = next(feed)
        else:
            images, texts, ids = fixed
        step(i, images, texts, ids)

    first = None
    for i in range(warmup):
        if i == 0:
            _sync(device)
            started = time.perf_counter()
        one(i)
        if i == 0:
            _sync(device)
            first = time.perf_counter() - started
    _sync(device)
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        one(i)
    _sync(device)
    return (time.perf_counter() - start) / steps, first


def dynamo_counts() -> dict[str, int]:
    """torch.compile's running totals (``torch._dynamo.utils.counters``): graphs compiled, graph
    breaks, and frames it gave up on (the recompile limit, an unsupported construct), which then
    run eager, so that a compiled arm's row says whether it measured compiled code."""
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    return {"compiled_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "frames_eager": int(frames["total"] - frames["ok"])}


def profile(step, feed, fixed, first: int, steps: int, device, path: Path) -> dict:
    """``steps`` more steps under ``torch.profiler``; writes the op table to ``path`` (what the
    step's host and device time go to, to compare arms by) and returns the launch counts per
    step: ``leaf_ops_per_step``, the aten ops that call no other aten op (each is a kernel
    launch's host work on a GPU, whatever the device it ran on), and on CUDA
    ``kernels_per_step``."""
    import torch
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(first, first + steps):
            images, texts, ids = next(feed) if feed is not None else fixed
            step(i, images, texts, ids)
        _sync(device)
    events = prof.events()
    leaves = sum(1 for e in events if e.name.startswith("aten::")
                 and not any(c.name.startswith("aten::") for c in e.cpu_children))
    counts = {"leaf_ops_per_step": leaves / steps}
    if device.type == "cuda":
        from torch.autograd import DeviceType

        counts["kernels_per_step"] = sum(1 for e in events
                                         if e.device_type == DeviceType.CUDA) / steps
    averages = prof.key_averages()
    tables = [f"# {path.stem}: {steps} steps under torch.profiler", "",
              "## by self CPU time", averages.table(sort_by="self_cpu_time_total", row_limit=25)]
    if device.type == "cuda":
        tables += ["", "## by self CUDA time",
                   averages.table(sort_by="self_cuda_time_total", row_limit=25)]
    path.write_text("\n".join(tables) + "\n")
    return counts


def versions(device) -> dict:
    import deepspeed
    import open_clip
    import torch

    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"CPU ({platform.machine()}, {os.cpu_count()} cores)")
    return {"device_name": name, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "open_clip": open_clip.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def run(args, written=None) -> dict:
    """Every (model, batch, feed, arm); ``written(result)`` after each row (the JSON so far is
    on disk when a time limit stops the run)."""
    device_kind = args.device or ("cuda" if _cuda() else "cpu")
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if device_kind == "cpu" else "cuda")
    import torch

    from vlcontrast import distributed as dist_utils
    from vlcontrast.models import build_model
    from vlcontrast.models.flops import mfu, peak_flops, train_flops_per_sample
    from vlcontrast.train.precision import Precision

    env = dist_utils.init_distributed(timeout_s=600, device=device_kind)
    device = env.device
    if device.type == "cuda":
        dist_utils.set_gpu_defaults()
    precision = Precision(args.precision or ("amp_bf16" if device.type == "cuda" else "fp32"))
    workers = args.workers or max(1, min(8, (os.cpu_count() or 2) - 2))
    models = list(MICRO.values()) if args.micro else [m for m in args.models.split(",") if m]
    batches = [int(b) for b in args.batches.split(",") if b]
    info = versions(device)
    peak = peak_flops(info["device_name"], args.peak_tflops) if device.type == "cuda" else None
    rows = []
    setup = {"precision": precision.name, "warmup": args.warmup, "steps": args.steps,
             "workers": workers, "log_every": args.log_every,
             "flops_note": "training FLOPs per pair = 3 x analytic forward "
                           "(vlcontrast/models/flops.py)",
             "peak_flops": peak}
    result = {"info": info, "setup": setup, "rows": rows}
    pin = device.type == "cuda"
    for model_name in models:
        from vlcontrast.config import ModelConfig

        cpu_bundle = build_model(ModelConfig(name=model_name), device="cpu")
        flops = train_flops_per_sample(cpu_bundle.model_config)
        initial = copy.deepcopy(cpu_bundle.model.state_dict())
        for batch in batches:
            fixed = fixed_batch(cpu_bundle, batch, pin)
            total = args.warmup + args.steps + args.profile
            for feed_name in args.feed_list:
                base = None
                for arm in args.arm_list:
                    model = copy.deepcopy(cpu_bundle.model)
                    model.load_state_dict(initial)
                    model = model.to(device).train()
                    if arm.startswith("plain"):
                        step, holder = plain_arm(model, device, precision, total,
                                                 syncs=arm.endswith("+syncs"))
                    else:
                        settle = 1 if arm.endswith("+syncs") else args.log_every
                        step, holder = vlcontrast_arm(
                            model, device, precision, batch, total, settle,
                            compiled=arm.endswith(("+compile", "+cudagraphs")),
                            engine_kind="deepspeed" if arm.endswith("+deepspeed") else "auto",
                            compile_mode=("reduce-overhead" if arm.endswith("+cudagraphs")
                                          else "default"))
                    feed = (loader_feed(cpu_bundle, batch, workers, total + 2 * workers + 2, pin)
                            if feed_name == "loader" else None)
                    compiled = arm.endswith(("+compile", "+cudagraphs"))
                    before = dynamo_counts() if compiled else {}
                    started = time.perf_counter()
                    seconds, first = measure(step, feed, fixed, args.warmup, args.steps, device)
                    wall = time.perf_counter() - started
                    if compiled:  # what this arm compiled (the totals run over the process)
                        after = dynamo_counts()
                        counts_compile = {key: after[key] - before[key] for key in after}
                    else:
                        counts_compile = {}
                    counts = {}
                    if args.profile and args.out:
                        name = f"profile_{model_name}_b{batch}_{feed_name}_{arm}".replace("+", "-")
                        counts = profile(step, feed, fixed, args.warmup + args.steps,
                                         args.profile, device, Path(args.out) / f"{name}.txt")
                    del feed
                    row = {"model": model_name, "batch": batch, "feed": feed_name, "arm": arm,
                           "ms_per_step": seconds * 1e3, "samples_per_s": batch / seconds,
                           "wall_s": wall, **counts, **counts_compile}
                    if first is not None:
                        row["first_step_s"] = first
                    value = mfu(row["samples_per_s"], flops, peak)
                    if value is not None:
                        row["mfu"] = value
                    if arm == "plain":
                        base = row["samples_per_s"]
                    if base:
                        row["ratio_to_plain"] = row["samples_per_s"] / base
                    rows.append(row)
                    print(_line(row), flush=True)
                    if written is not None:
                        written(result)
                    if hasattr(holder, "destroy"):
                        holder.destroy()
                    del step, holder, model
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    return result


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _line(row: dict) -> str:
    extra = f", MFU {100 * row['mfu']:.1f}%" if "mfu" in row else ""
    ratio = f", {row['ratio_to_plain']:.2f}x plain" if "ratio_to_plain" in row else ""
    ops = f", {row['leaf_ops_per_step']:.0f} ops/step" if "leaf_ops_per_step" in row else ""
    ops += f", {row['kernels_per_step']:.0f} kernels/step" if "kernels_per_step" in row else ""
    if "compiled_graphs" in row:
        ops += (f"; first step {row.get('first_step_s', float('nan')):.1f} s, "
                f"{row['compiled_graphs']} graphs compiled, {row['graph_breaks']} graph breaks")
        if row["frames_eager"]:
            ops += f", WARNING: {row['frames_eager']} frames ran eager (not compiled)"
    return (f"[step] {row['model']} batch {row['batch']} feed {row['feed']:6s} {row['arm']:18s} "
            f"{row['ms_per_step']:8.2f} ms/step {row['samples_per_s']:9.1f} samples/s{extra}{ratio}"
            f"{ops}")


def table(result: dict) -> str:
    info, setup = result["info"], result["setup"]
    lines = [f"{info['device_name']}; torch {info['torch']}, DeepSpeed {info['deepspeed']}, "
             f"open_clip {info['open_clip']}; {info['date']}. {setup['precision']}, "
             f"{setup['warmup']} warm-up + {setup['steps']} timed steps; loader: {setup['workers']} "
             "worker(s), the same synthetic loader for every arm. Ratio: samples/s over the plain "
             "step's on the same feed.", "",
             "| model | batch | feed | arm | ms/step | samples/s | MFU | ratio |",
             "|---|---:|---|---|---:|---:|---:|---:|"]
    counted = [key for key in ("leaf_ops_per_step", "kernels_per_step")
               if any(key in row for row in result["rows"])]
    if counted:  # --profile: launches per step beside the times
        names = {"leaf_ops_per_step": "ops/step", "kernels_per_step": "kernels/step"}
        lines[-2] = lines[-2] + "".join(f" {names[key]} |" for key in counted)
        lines[-1] = lines[-1] + "---:|" * len(counted)
    for row in result["rows"]:
        mfu_cell = f"{100 * row['mfu']:.1f}%" if "mfu" in row else "–"
        ratio = f"{row['ratio_to_plain']:.2f}x" if "ratio_to_plain" in row else "–"
        extra = "".join(f" {row[key]:.0f} |" if key in row else " – |" for key in counted)
        lines.append(f"| {row['model']} | {row['batch']} | {row['feed']} | {row['arm']} | "
                     f"{row['ms_per_step']:.1f} | {row['samples_per_s']:.0f} | {mfu_cell} | "
                     f"{ratio} |{extra}")
    compiled = [row for row in result["rows"] if "compiled_graphs" in row]
    if compiled:  # what compiling cost and whether the compiled code is what ran
        lines += ["", "Compiled arms: the first warm-up step (compiling the forward and backward), "
                  "torch.compile's graphs and graph breaks, and the frames it left eager (should be "
                  "0; a frame runs eager past the recompile limit or on an unsupported "
                  "construct).", "",
                  "| model | batch | feed | arm | first step (s) | graphs | graph breaks | "
                  "frames eager |", "|---|---:|---|---|---:|---:|---:|---:|"]
        for row in compiled:
            first = f"{row['first_step_s']:.1f}" if "first_step_s" in row else "–"
            lines.append(f"| {row['model']} | {row['batch']} | {row['feed']} | {row['arm']} | "
                         f"{first} | {row['compiled_graphs']} | {row['graph_breaks']} | "
                         f"{row['frames_eager']} |")
    return "\n".join(lines)


def write_result(out: Path, stamp: str, result: dict) -> None:
    """``step_<stamp>.json`` and ``step.md``, each replaced in one step: the run is cut at any row
    by a device call's time limit (its process group killed), and a half-written JSON would lose
    every row before it."""
    from vlcontrast.outputs import write_text_atomic

    write_text_atomic(out / f"step_{stamp}.json", json.dumps(result, indent=2))
    write_text_atomic(out / "step.md", table(result) + "\n")


def main(argv=None) -> int:
    args = parse(argv)
    written = None
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")

        def written(result):
            write_result(out, stamp, result)

    result = run(args, written)
    print("\n" + table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
