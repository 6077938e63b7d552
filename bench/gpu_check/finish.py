"""The device calls that finish the GPU check after the first H200 runs (2026-11-27), each sized
to end within :data:`CALL_LIMIT_S`.

Those runs left without a verdict the ``memory`` group for every loss but infonce, the
``matrix-rn`` cells ``RN50 fp16 zero0`` and ``RN50 bf16 zero3``, and 7 of the 8 ``matrix-vit``
cells (only ``ViT-B-32 fp32 zero2 uint8`` ran). :func:`finish_calls` packs that work into calls
with ``--memory-losses`` and ``--cases``. What is owed is read from the committed reports in
``bench/results/gpu_check/`` (:func:`recorded`): once a device run's JSON is copied there, its
rows, step tables and loader rows leave the queue.

    python -m bench.gpu_check.finish            # one line per device call
    python -m bench.gpu_check.finish --sessions # every owed call (step, data, study, check),
                                                # most wanted first, grouped by session

Each line is a ``bench/device_run.sh`` command for the device tool (carry ``.whl``). The
estimates are the measured matrix cells of the H200 runs (36-64 s each, start-up included) and a
guess for the memory probes until a committed report times them (the report times every probe,
and the estimates take the slowest recorded probe of each size), so after the first memory call
the others are packed from measured times.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

from bench.gpu_check.plan import FULL_MODELS, MEMORY_SIZES, matrix_cells, matrix_group

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "gpu_check"
"""Where the device runs' raw numbers are committed: what they hold is no longer owed."""

CALL_LIMIT_S = 480.0
"""Each call must end within 8 minutes (the device tool's 10-minute limit, less installing the
wheels and copying the report back)."""
CALL_SETUP_S = 75.0
"""Per call before the first probe or cell: the carried wheels installed (~15 s), the ``info``
job (~10 s) and the check's shards written (~45 s for 7,680 224-px samples)."""
PROBE_S = {32_768: 25.0, 65_536: 35.0, 131_072: 55.0, 262_144: 95.0}
"""Seconds per memory probe by global batch (start-up plus one GradCache step over batch / 4096
micro-batches): a guess consistent with the H200 call that finished infonce's four sizes and
decl's first two before its time ran out, used until a committed report times a probe of that
size (:func:`probe_seconds`)."""
CELL_S = {"RN": 65.0, "ViT": 45.0}
"""Seconds per matrix cell, the slowest measured on the H200 (RN50 36-64 s, ViT-B-32 36 s) plus
ZeRO-3's extra start."""

CUDA_TESTS_SINCE = "2026-11-28"
"""The cuda-marked tests changed on this date (the torch engine against DeepSpeed's on a GPU, the
decode stream, the feed under load): the ``losses`` group's ``pytest -m cuda`` row counts only from
a report whose file name (it starts with the date) is not older."""
TRANSCRIBED_MEMORY = ("infonce",)
"""Memory rows a device run reported in the issue tracker without a committed report (issue "The
data path on a GPU node": infonce's four sizes); every other verdict is read from :data:`RESULTS`."""
CONSOLE_ROW = re.compile(r"^\[gpu-check\] (PASS|FAIL|SKIP) ([^/]+)/(.+?): .*\(([0-9.]+) s\)$")


class Verdict(NamedTuple):
    status: str
    """"pass", "fail" or "skip"."""
    seconds: float
    """The row's wall time on the device."""


def cuda_tests_passed(results: Path = RESULTS, since: str = CUDA_TESTS_SINCE) -> bool:
    """Whether a report from ``since`` on has the ``losses`` group's ``pytest -m cuda`` passed."""
    rows: dict[tuple[str, str], Verdict] = {}
    for path in sorted(Path(results).glob("*")):
        if path.name >= since:
            rows.update(recorded_in(path))
    return getattr(rows.get(("losses", "pytest -m cuda")), "status", "") == "pass"


def recorded(results: Path = RESULTS) -> dict[tuple[str, str], Verdict]:
    """(group, case) -> :class:`Verdict` of every row in the committed GPU-check reports (``*.json``
    with ``rows``) and console logs (``*.log``), files in name order (they start with the date), a
    later row overriding an earlier one of the same case."""
    rows: dict[tuple[str, str], Verdict] = {}
    for path in sorted(results.glob("*")):
        rows.update(recorded_in(path))
    return rows


def recorded_in(path: Path) -> dict[tuple[str, str], Verdict]:
    """The rows of one report (``*.json`` with ``rows``) or console log (``*.log``)."""
    rows: dict[tuple[str, str], Verdict] = {}
    if path.suffix == ".json":
        for row in _json(path).get("rows", []):
            if isinstance(row, dict) and {"section", "case", "status"} <= set(row):
                rows[(row["section"], row["case"])] = Verdict(
                    row["status"], float(row.get("seconds") or 0.0))
    elif path.suffix == ".log":
        for line in path.read_text(errors="replace").splitlines():
            match = CONSOLE_ROW.match(line)
            if match:
                rows[(match[2], match[3])] = Verdict(match[1].lower(), float(match[4]))
    return rows


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def on_gpu(info: dict) -> bool:
    """Whether a report's ``info`` comes from a GPU (the CPU runs of the same tools do not count)."""
    device = str(info.get("device_name") or info.get("device") or "")
    return "NVIDIA" in device or "cuda" in device.lower()


def step_rows(results: Path = RESULTS) -> list[dict]:
    """The rows of every step table measured on a GPU (``bench/bench_step.py``'s JSON)."""
    return [row for path in sorted(results.glob("*.json"))
            for data in [_json(path)] if on_gpu(data.get("info", {})) and "setup" in data
            for row in data.get("rows", []) if isinstance(row, dict) and "arm" in row]


def loader_batches(results: Path = RESULTS) -> set[int]:
    """The batch sizes a GPU run of ``bench/device_data.sh`` recorded the end-to-end rows for
    (``bench/bench_loader.py``'s JSON with at least one row fed by a loader)."""
    return {data["info"]["batch_size"] for path in sorted(results.glob("*.json"))
            for data in [_json(path)]
            if "loaders" in data and on_gpu(data.get("info", {}))
            and (data.get("step") or {}).get("fed")}


def throughput_batches(results: Path = RESULTS) -> set[int]:
    """The per-GPU batches of the throughput group's recorded runs (transcribed ones included:
    the study's plan prices from them either way)."""
    return {setup["batch_per_gpu"] for path in sorted(results.glob("*.json"))
            for setup in [_json(path).get("info", {}).get("throughput_setup") or {}]
            if "batch_per_gpu" in setup}


def probe_seconds(rows: dict[tuple[str, str], Verdict] | None = None) -> dict[int, float]:
    """Seconds per memory probe by global batch: the slowest recorded probe of that size on the
    device (any loss), else the guess :data:`PROBE_S`."""
    from bench.gpu_check.groups import size_label

    measured: dict[int, float] = {}
    for size in MEMORY_SIZES:
        times = [v.seconds for (section, case), v in (rows or {}).items()
                 if section == "memory" and case.endswith(f" {size_label(size)}")
                 and v.status == "pass" and v.seconds > 0]
        measured[size] = max(times) if times else PROBE_S.get(size, 95.0)
    return measured


def memory_seconds(loss: str, sizes: tuple[int, ...] = MEMORY_SIZES,
                   per_probe: dict[int, float] | None = None) -> float:
    per_probe = per_probe or PROBE_S
    return sum(per_probe.get(size, 95.0) for size in sizes)


def case_name(family: str, model: str, precision: str, stage: int, uint8: bool) -> str:
    """The matrix group's case name of a cell (bench/gpu_check/groups.py's ``check_matrix``)."""
    return f"{family} {model} {precision} zero{stage}" + (" uint8" if uint8 else "")


def pack(items: list[tuple[str, float]], limit_s: float = CALL_LIMIT_S,
         setup_s: float = CALL_SETUP_S) -> list[list[str]]:
    """Items in order, cut into calls whose setup plus items stay within ``limit_s``; an item
    longer than a call on its own gets a call of its own."""
    calls: list[list[str]] = []
    spent = limit_s
    for name, seconds in items:
        if spent + seconds > limit_s and (not calls or calls[-1]):
            calls.append([])
            spent = setup_s
        calls[-1].append(name)
        spent += seconds
    return calls


def matrix_cases(precisions: tuple[str, ...], families: list[str]) -> dict[str, list[str]]:
    """Every cell of the full check's matrix, by group (``matrix-rn``, ``matrix-vit``)."""
    cases: dict[str, list[str]] = {"matrix-rn": [], "matrix-vit": []}
    for family, precision, stage, uint8 in matrix_cells(families, precisions, False):
        model = FULL_MODELS.get(family)
        if model is not None:
            cases[matrix_group(family)].append(case_name(family, model, precision, stage, uint8))
    return cases


def memory_done(loss: str, rows: dict[tuple[str, str], Verdict]) -> bool:
    """Every size of ``loss`` has a verdict (an OOM is one; the sizes after it are skipped)."""
    from bench.gpu_check.groups import size_label

    return loss in TRANSCRIBED_MEMORY or all(
        getattr(rows.get(("memory", f"{loss} {size_label(size)}")), "status", "") in ("pass", "skip")
        for size in MEMORY_SIZES)


def finish_calls(losses: list[str], precisions: tuple[str, ...], families: list[str],
                 results: Path = RESULTS) -> list[tuple[str, str, float]]:
    """(group, the call's ``--memory-losses``/``--cases`` value, estimated seconds) per call, for
    the memory rows and matrix cells that :data:`RESULTS` holds no verdict of (a failed cell is
    owed again)."""
    rows = recorded(results)
    calls: list[tuple[str, str, float]] = []
    per_probe = probe_seconds(rows)  # measured once a memory call has run
    memory = [(loss, memory_seconds(loss, per_probe=per_probe)) for loss in sorted(losses)
              if not memory_done(loss, rows)]
    cases = matrix_cases(precisions, families)
    # A matrix row's section is "matrix" (one group then) or its group's name.
    passed = {case for (section, case), verdict in rows.items()
              if section.startswith("matrix") and verdict.status == "pass"}
    vit = [(case, CELL_S["ViT"]) for case in cases["matrix-vit"] if case not in passed]
    rn = [(case, CELL_S["RN"]) for case in cases["matrix-rn"] if case not in passed]
    for group, items in (("memory", memory), ("matrix-rn", rn), ("matrix-vit", vit)):
        seconds = dict(items)
        for names in pack(items):
            calls.append((group, ",".join(names),
                          CALL_SETUP_S + sum(seconds[name] for name in names)))
    return calls


SESSION_CALL_S = 13 * 60.0
"""Device time a session can give its calls: 15 minutes less the machine's start (1-2 min)."""
DATA_CALL_S = 6 * 60.0
"""``bench/device_data.sh``: the cuda-marked decode tests and the loader bench (its own header)."""


def queue(results: Path = RESULTS) -> list[tuple[str, str, float]]:
    """Every device call still owed, most wanted first: (what it answers, the device tool's
    command, estimated seconds). The step table (issue "GPU speed") first, then the data path's
    end-to-end rows, the study plan's missing step times, the compiled arms, and the rest of the
    check (:func:`finish_calls`); a call whose numbers :data:`RESULTS` already holds is left out."""
    from bench.gpu_check.groups import precisions, shipped_families
    from bench.gpu_check.plan import estimate_seconds, step_seconds, throughput_seconds
    from vlcontrast.losses import LOSSES

    steps = step_rows(results)
    arms = {(row.get("model"), row["arm"]) for row in steps}
    run = "GPU_CHECK_TIMEOUT=470 bench/device_run.sh"
    calls = []
    for model in ("ViT-B-32", "RN50"):
        # Each arm also profiled for 3 steps: op tables and kernels per step, to find what the
        # step's remaining host time goes to.
        if (model, "vlcontrast") not in arms:
            calls.append((f"step table, {model}",
                          f"{run} step --step-models {model} --step-profile 3",
                          CALL_SETUP_S + step_seconds((model,), profile=True)))
        if model == "ViT-B-32" and not cuda_tests_passed(results):
            # The engines compared on the GPU before their step is timed, with the other
            # cuda-marked tests (the losses group's first row; its loss checks come along).
            calls.append(("cuda-marked tests, losses group", f"{run} losses",
                          CALL_SETUP_S + estimate_seconds("losses", (), [])))
    fed = loader_batches(results)
    for batch, command_ in ((128, "bench/device_data.sh"), (512, "bench/device_data.sh ViT-B-32 512")):
        if batch not in fed:
            calls.append((f"loader rows and end-to-end vs step alone, batch {batch}", command_,
                          DATA_CALL_S))
    priced = throughput_batches(results)
    for batch in (32, 512):
        if batch not in priced:
            calls.append((f"study plan: step time at {batch} per GPU",
                          f"{run} throughput --throughput-batch {batch}",
                          CALL_SETUP_S + throughput_seconds(batch)))
    if ("ViT-B-32", "vlcontrast+compile") not in arms:
        compiled = "plain,vlcontrast,vlcontrast+compile,vlcontrast+cudagraphs"
        calls.append(("compiled arms, ViT-B-32",
                      f"{run} step --step-models ViT-B-32 --step-arms {compiled}",
                      CALL_SETUP_S + step_seconds(("ViT-B-32",), arms=4) + 120.0))
    families = sorted(shipped_families())
    for group, selection, seconds in finish_calls(sorted(LOSSES), precisions(), families,
                                                  results):
        calls.append((f"{group} {selection}", command(group, selection), seconds))
    return calls


def sessions(calls: list[tuple[str, str, float]], budget_s: float = SESSION_CALL_S
             ) -> list[list[tuple[str, str, float]]]:
    """``calls`` in order, cut into sessions whose calls fit ``budget_s`` of device time."""
    out: list[list[tuple[str, str, float]]] = []
    spent = budget_s
    for call in calls:
        if spent + call[2] > budget_s:
            out.append([])
            spent = 0.0
        out[-1].append(call)
        spent += call[2]
    return out


def command(group: str, selection: str) -> str:
    option = "--memory-losses" if group == "memory" else "--cases"
    return f"GPU_CHECK_TIMEOUT=540 bench/device_run.sh {group} {option} '{selection}'"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="the device calls still owed")
    parser.add_argument("--sessions", action="store_true",
                        help="every owed call, most wanted first, grouped into sessions of "
                             f"{SESSION_CALL_S / 60:.0f} minutes of device time")
    args = parser.parse_args(argv)
    if args.sessions:
        for number, calls in enumerate(sessions(queue()), 1):
            total = sum(seconds for _, _, seconds in calls)
            print(f"# session {number} (~{total / 60:.1f} min of calls)")
            for what, cmd, seconds in calls:
                print(f"{cmd}    # ~{seconds / 60:.1f} min: {what}")
        return 0
    from bench.gpu_check.groups import precisions, shipped_families
    from vlcontrast.losses import LOSSES

    families = sorted(shipped_families())
    for group, selection, seconds in finish_calls(sorted(LOSSES), precisions(), families):
        print(f"{command(group, selection)}    # ~{seconds / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
