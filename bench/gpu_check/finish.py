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
    python -m bench.gpu_check.finish --collect DIR   # file a call's returned files

Each line is the device tool's call: ``run(command=..., carry=[".whl"], timeout_s=...)``, its
``GPU_CHECK_TIMEOUT`` and ``timeout_s`` sized from the call's estimate (:func:`plan_call`), and the
calls of a session sized so that their ``timeout_s`` together fit its device time. The estimates
are the measured matrix cells of the H200 runs (36-64 s each, start-up included) and a guess for
the memory probes until a committed report times them (the report times every probe, and the
estimates take the slowest recorded probe of each size), so after the first memory call the
others are packed from measured times.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

from bench.gpu_check.plan import FULL_MODELS, MEMORY_SIZES, matrix_cells, matrix_group

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "gpu_check"
"""Where the device runs' raw numbers are committed: what they hold is no longer owed."""

DEVICE_CALL_MAX_S = 600
"""The device tool's limit on one call (its ``timeout_s``)."""
CALL_MARGIN_S = 40
"""What a ``bench/device_run.sh`` call spends outside its ``GPU_CHECK_TIMEOUT``: the carried wheels
installed and imported (~20 s), ``timeout``'s 10 s grace after its TERM, the copy to ``$OUT``. A
call's ``timeout_s`` is its ``GPU_CHECK_TIMEOUT`` plus this, so the tool never cuts the copy."""
CHECK_TIMEOUT_MAX_S = DEVICE_CALL_MAX_S - CALL_MARGIN_S
"""The largest ``GPU_CHECK_TIMEOUT`` of a call (560 s)."""
HEADROOM = 1.25
"""A call's ``GPU_CHECK_TIMEOUT`` over its estimate (the estimates are partly guesses)."""
CALL_LIMIT_S = 440.0
"""What a call's estimate must fit: the largest ``GPU_CHECK_TIMEOUT`` less the headroom (8
minutes; ``CALL_LIMIT_S * HEADROOM <= CHECK_TIMEOUT_MAX_S``)."""
CALL_SETUP_S = 75.0
"""Per call before the first probe or cell: the carried wheels installed (~15 s), the ``info``
job (~10 s) and the check's shards written (~45 s for 7,680 224-px samples)."""
STEP_CALL_SETUP_S = 30.0
""":data:`CALL_SETUP_S` of a call of only the step group: it writes no shards."""
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
a report whose date (:func:`report_date`: its ``info.date``, else its file name's) is not older."""
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
    for path in ordered(results):
        if report_date(path) >= since:
            rows.update(recorded_in(path))
    return getattr(rows.get(("losses", "pytest -m cuda")), "status", "") == "pass"


DATE = re.compile(r"^(\d{4}-\d{2}-\d{2})")


def report_date(path: Path) -> str:
    """A result file's date, ``YYYY-MM-DD``: its JSON's ``info.date`` (every report since
    2026-11-29 records it, as do the step and loader tables), else the date its name starts
    with, else "" (older than any: an undated copy never overrides a dated report)."""
    if path.suffix == ".json":
        match = DATE.match(str(_json(path).get("info", {}).get("date") or ""))
        if match:
            return match[1]
    match = DATE.match(path.name)
    return match[1] if match else ""


def ordered(results: Path = RESULTS) -> list[Path]:
    """The result files by date (:func:`report_date`), then name: what a later one says of a case
    overrides an earlier one."""
    return sorted((p for p in Path(results).glob("*") if p.is_file()),
                  key=lambda p: (report_date(p), p.name))


def recorded(results: Path = RESULTS) -> dict[tuple[str, str], Verdict]:
    """(group, case) -> :class:`Verdict` of every row in the committed GPU-check reports (``*.json``
    with ``rows``) and console logs (``*.log``), files in date order (:func:`ordered`), a later
    row overriding an earlier one of the same case."""
    rows: dict[tuple[str, str], Verdict] = {}
    for path in ordered(results):
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


_UNREADABLE: set[Path] = set()


def _json(path: Path) -> dict:
    """A result file's JSON object; one that cannot be read is said once (one line on stderr)
    and counts as holding nothing."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        if path not in _UNREADABLE:
            _UNREADABLE.add(path)
            print(f"finish: {path} is not readable JSON ({type(err).__name__}: {err}); its rows "
                  "are left out: fix or remove the file", file=sys.stderr)
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


SESSION_DEVICE_S = 15 * 60.0
"""Device time of a session that is lent a machine, every call and the machine's start together."""
MACHINE_START_S = 2 * 60.0
"""The machine's start, out of a session's device time."""
SESSION_CALL_S = SESSION_DEVICE_S - MACHINE_START_S
"""What a session's calls may hold together: the sum of their ``timeout_s`` (13 minutes), so no
call of a session can be cut by the device time running out (which would lose its copy to
``$OUT``)."""
DATA_CALL_S = 6 * 60.0
"""``bench/device_data.sh``: the cuda-marked decode tests and the loader bench (its own header)."""
DATA_TIMEOUT_S = 520
"""``bench/device_data.sh``'s ``timeout_s``: its three steps are cut at 110 + 60 + 300 s, plus the
wheels (~20 s) and a margin (its own header and docs/benchmarks.md give the same)."""
COMPILED_ARMS = ("plain", "vlcontrast", "vlcontrast+compile", "vlcontrast+cudagraphs")
COMPILE_S = 120.0
"""The compiled arms' compiles (a minute or more each on a GPU), over :func:`step_seconds`."""


def step_missing(rows: list[dict], model: str, arms: tuple[str, ...],
                 batches: tuple[int, ...], feeds: tuple[str, ...]) -> tuple[int, ...]:
    """The batches of ``model`` whose step table lacks a (feed, arm) row: a call cut after its
    first batch leaves the second owed."""
    have = {(row.get("model"), row.get("batch"), row.get("feed"), row.get("arm")) for row in rows}
    return tuple(batch for batch in batches
                 if any((model, batch, feed, arm) not in have for feed in feeds for arm in arms))


def queue(results: Path = RESULTS) -> list[tuple[str, str, float]]:
    """Every device call still owed, most wanted first: (what it answers, the command, estimated
    seconds). The step table (issue "GPU speed") first, then the data path's end-to-end rows, the
    study plan's missing step times, the compiled arms, and the rest of the check
    (:func:`finish_calls`); a call whose numbers :data:`RESULTS` already holds is left out (a step
    table only once every planned batch x feed x arm row is there)."""
    from bench.bench_step import ARMS, FEEDS
    from bench.gpu_check.groups import precisions, shipped_families
    from bench.gpu_check.plan import (STEP_BATCHES, estimate_seconds, step_seconds,
                                      throughput_seconds)
    from vlcontrast.losses import LOSSES

    steps = step_rows(results)
    run = "bench/device_run.sh"
    calls = []

    def only(batches: tuple[int, ...]) -> str:
        return "" if batches == STEP_BATCHES else f" --step-batches {','.join(map(str, batches))}"

    for model in ("ViT-B-32", "RN50"):
        # Each arm also profiled for 3 steps: op tables and kernels per step, to find what the
        # step's remaining host time goes to.
        missing = step_missing(steps, model, ARMS, STEP_BATCHES, FEEDS)
        if missing:
            calls.append((f"step table, {model}",
                          f"{run} step --step-models {model}{only(missing)} --step-profile 3",
                          STEP_CALL_SETUP_S + step_seconds((model,), profile=True,
                                                           batches=missing)))
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
    missing = step_missing(steps, "ViT-B-32", COMPILED_ARMS, STEP_BATCHES, FEEDS)
    if missing:
        calls.append(("compiled arms, ViT-B-32",
                      f"{run} step --step-models ViT-B-32{only(missing)} --step-arms "
                      + ",".join(COMPILED_ARMS),
                      STEP_CALL_SETUP_S + step_seconds(("ViT-B-32",), arms=len(COMPILED_ARMS),
                                                       batches=missing) + COMPILE_S))
    families = sorted(shipped_families())
    for group, selection, seconds in finish_calls(sorted(LOSSES), precisions(), families,
                                                  results):
        calls.append((f"{group} {selection}", command(group, selection), seconds))
    return calls


class DeviceCall(NamedTuple):
    """One planned device call: what it answers, its command, its estimate, the device tool's
    ``timeout_s`` and (``bench/device_run.sh``) the ``GPU_CHECK_TIMEOUT`` the check runs
    under."""

    what: str
    command: str
    seconds: float
    timeout_s: int
    check_timeout_s: int | None

    def line(self) -> str:
        """The device tool's call, as the session makes it, and what it is for."""
        command = (f"GPU_CHECK_TIMEOUT={self.check_timeout_s} {self.command}"
                   if self.check_timeout_s is not None else self.command)
        return (f'run(command="{command}", carry=[".whl"], timeout_s={self.timeout_s})'
                f"    # ~{self.seconds / 60:.1f} min: {self.what}")


def plan_call(what: str, command: str, seconds: float, cap_s: float | None = None
              ) -> DeviceCall | None:
    """The call with its limits: ``GPU_CHECK_TIMEOUT`` the estimate plus :data:`HEADROOM`
    (whole tens of seconds, at most :data:`CHECK_TIMEOUT_MAX_S`) and ``timeout_s`` that plus
    :data:`CALL_MARGIN_S`; ``bench/device_data.sh`` has its own limits (:data:`DATA_TIMEOUT_S`).
    ``cap_s``: the device time left to the call, its ``timeout_s`` lowered to fit, down to the
    estimate plus the margin; None when even that does not fit."""
    cap = DEVICE_CALL_MAX_S if cap_s is None else min(cap_s, DEVICE_CALL_MAX_S)
    if not command.startswith("bench/device_run.sh"):
        return DeviceCall(what, command, seconds, DATA_TIMEOUT_S, None) \
            if DATA_TIMEOUT_S <= cap else None
    wanted = min(CHECK_TIMEOUT_MAX_S, 10 * math.ceil(seconds * HEADROOM / 10))
    least = min(CHECK_TIMEOUT_MAX_S, 10 * math.ceil(seconds / 10))
    check = min(wanted, int(cap - CALL_MARGIN_S) // 10 * 10)
    if check < least:
        return None
    return DeviceCall(what, command, seconds, check + CALL_MARGIN_S, check)


def sessions(calls: list[tuple[str, str, float]], budget_s: float = SESSION_CALL_S
             ) -> list[list[DeviceCall]]:
    """``calls`` in order, planned (:func:`plan_call`) and cut into sessions whose calls'
    ``timeout_s`` together fit ``budget_s``: a call that does not fit what is left of a session
    has its limits lowered to fit if its estimate still does, else it starts the next session."""
    out: list[list[DeviceCall]] = []
    left = 0.0
    for what, command_, seconds in calls:
        planned = plan_call(what, command_, seconds, cap_s=left) if out else None
        if planned is None:
            out.append([])
            left = budget_s
            planned = plan_call(what, command_, seconds, cap_s=left)
            if planned is None:  # longer than a session on its own: the tool's limits, alone
                planned = plan_call(what, command_, seconds)
        out[-1].append(planned)
        left -= planned.timeout_s
    return out


def command(group: str, selection: str) -> str:
    option = "--memory-losses" if group == "memory" else "--cases"
    return f"bench/device_run.sh {group} {option} '{selection}'"


# --------------------------------------------------------------------------------------------
# --collect: a call's returned files into bench/results/gpu_check/


FILED = {"gpu_check.json": ".json", "gpu_check.md": ".md", "tracebacks.txt": "-tracebacks.txt",
         "job_logs.tar.gz": "-job-logs.tar.gz", "pytest_cuda.log": "-pytest-cuda.log",
         "step.md": "-table.md", "step_profiles.tar.gz": "-step-profiles.tar.gz",
         "loader.json": ".json", "loader.md": ".md", "cuda_tests.log": "-cuda-tests.log",
         "bench.log": "-bench.log"}
"""A returned file's name -> its ending after the call's stem (``step_<stamp>.json``:
``-table.json``)."""


def device_slug(name: str) -> str:
    """``NVIDIA H200 x1, CUDA 13.0`` -> ``h200``; a CPU -> ``cpu``; else the name's first word."""
    name = str(name or "")
    if "NVIDIA" in name:
        name = name.split("NVIDIA", 1)[1]
    if name.strip().lower().startswith("cpu") or not name.strip():
        return "cpu" if name.strip() else "unknown"
    return re.sub(r"[^a-z0-9]+", "-", name.split()[0].lower()).strip("-") or "unknown"


def call_stem(folder: Path) -> str:
    """``<date>-<device>-<group(s)>`` of the call whose files ``folder`` holds: from its
    ``gpu_check.json`` (groups joined by ``-``), else its ``loader.json`` (``loader-b<batch>``),
    else its step table (``step``); the date is the report's (UTC), else the file's time."""
    for name, label in (("gpu_check.json", None), ("loader.json", "loader"),
                        ("step_*.json", "step")):
        found = sorted(folder.glob(name))
        if not found:
            continue
        data = _json(found[-1])
        info = data.get("info", {}) if isinstance(data.get("info"), dict) else {}
        if label is None:
            options = info.get("options") if isinstance(info.get("options"), dict) else {}
            label = "-".join(info.get("groups") or []) or "check"
            if options.get("step_models"):  # the two step calls of a day apart by name
                label += "-" + str(options["step_models"]).replace(",", "-")
            if options.get("throughput_batch"):
                label += f"-b{options['throughput_batch']}"
            label = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
        elif label == "loader" and info.get("batch_size"):
            label = f"loader-b{info['batch_size']}"
        match = DATE.match(str(info.get("date") or ""))
        date = match[1] if match else datetime.datetime.fromtimestamp(
            found[-1].stat().st_mtime, datetime.timezone.utc).strftime("%Y-%m-%d")
        device = device_slug(info.get("device_name") or info.get("device") or "")
        return f"{date}-{device}-{label}"
    raise SystemExit(f"finish --collect: {folder} holds no gpu_check.json, loader.json or "
                     "step_*.json: give the folder a device call's files came back to")


def collect(folder: Path, results: Path = RESULTS) -> list[tuple[Path, Path]]:
    """File the returned files of one device call (``folder``: the device tool's ``files_at``)
    into ``results`` as ``<date>-<device>-<group(s)><ending>`` (:data:`FILED`); never over an
    existing file: the call's stem takes a suffix (``-2``, ...) when any of its names is taken,
    and a call already filed (the same bytes under one stem) is not filed again. Returns (source,
    filed) pairs; an empty ``tracebacks.txt`` is left out."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SystemExit(f"finish --collect: {folder} is not a folder: give the folder a device "
                         "call's files came back to")
    stem = call_stem(folder)
    sources: list[tuple[Path, str]] = []
    for path in sorted(folder.iterdir()):
        if path.name == "tracebacks.txt" and not path.read_text(errors="replace").strip():
            continue
        if path.name in FILED:
            sources.append((path, FILED[path.name]))
        elif re.fullmatch(r"step_.+\.json", path.name):
            sources.append((path, "-table.json"))
    endings = [ending for _, ending in sources]
    sources = [(path, ending if endings.count(ending) == 1 else
                ending.replace(".", f"-{index}.", 1))
               for index, (path, ending) in enumerate(sources, 1)]
    results.mkdir(parents=True, exist_ok=True)
    for number in range(1, 100):
        name = stem if number == 1 else f"{stem}-{number}"
        targets = [(path, results / f"{name}{ending}") for path, ending in sources]
        if all(target.is_file() and target.read_bytes() == path.read_bytes()
               for path, target in targets):
            print(f"finish --collect: already filed as {name}*: nothing to do")
            return []
        if not any(target.exists() for _, target in targets):
            break
    else:
        raise SystemExit(f"finish --collect: {stem}-2 to -99 are all taken in {results}: "
                         "file by hand")
    for path, target in targets:
        shutil.copyfile(path, target)
    return targets


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="the device calls still owed")
    parser.add_argument("--sessions", action="store_true",
                        help="every owed call, most wanted first, grouped into sessions of "
                             f"{SESSION_DEVICE_S / 60:.0f} minutes of device time")
    parser.add_argument("--collect", metavar="DIR",
                        help="file the files a device call brought back (DIR) into "
                             "bench/results/gpu_check/, named by date, device and group(s)")
    args = parser.parse_args(argv)
    if args.collect:
        for source, target in collect(Path(args.collect), RESULTS):
            print(f"filed {source.name} -> {target}")
        return 0
    if args.sessions:
        grouped = sessions(queue())
        for number, calls in enumerate(grouped, 1):
            total = sum(call.seconds for call in calls)
            caps = sum(call.timeout_s for call in calls)
            print(f"# session {number}: ~{total / 60:.1f} min of calls; their timeout_s "
                  f"{caps / 60:.1f} min + ~{MACHINE_START_S / 60:.0f} min machine start, of "
                  f"{SESSION_DEVICE_S / 60:.0f}")
            for call in calls:
                print(call.line())
        print("# after each call: python -m bench.gpu_check.finish --collect FILES_AT")
        return 0
    from bench.gpu_check.groups import precisions, shipped_families
    from vlcontrast.losses import LOSSES

    families = sorted(shipped_families())
    for group, selection, seconds in finish_calls(sorted(LOSSES), precisions(), families):
        print(plan_call(f"{group} {selection}", command(group, selection), seconds).line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
