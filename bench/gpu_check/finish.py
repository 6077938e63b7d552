"""The device calls that finish the GPU check after the first H200 runs (2026-11-27), each sized
to end within :data:`CALL_LIMIT_S`.

Those runs left without a verdict the ``memory`` group for every loss but infonce, the
``matrix-rn`` cells ``RN50 fp16 zero0`` and ``RN50 bf16 zero3``, and 7 of the 8 ``matrix-vit``
cells (only ``ViT-B-32 fp32 zero2 uint8`` ran). :func:`finish_calls` packs that work into calls
with ``--memory-losses`` and ``--cases``:

    python -m bench.gpu_check.finish            # one line per device call
    python -m bench.gpu_check.finish --sessions # every owed call (step, data, study, check),
                                                # most wanted first, grouped by session

Each line is a ``bench/device_run.sh`` command for the device tool (carry ``.whl``). The
estimates are the measured matrix cells of the H200 runs (36-64 s each, start-up included) and a
guess for the memory probes, which no run has timed yet; the report times every probe, so the
first memory call tells whether the others can take more losses.
"""

from __future__ import annotations

from bench.gpu_check.plan import MEMORY_SIZES, matrix_cells, matrix_group

CALL_LIMIT_S = 480.0
"""Each call must end within 8 minutes (the device tool's 10-minute limit, less installing the
wheels and copying the report back)."""
CALL_SETUP_S = 75.0
"""Per call before the first probe or cell: the carried wheels installed (~15 s), the ``info``
job (~10 s) and the check's shards written (~45 s for 7,680 224-px samples)."""
PROBE_S = {32_768: 25.0, 65_536: 35.0, 131_072: 55.0, 262_144: 95.0}
"""Seconds per memory probe by global batch (start-up plus one GradCache step over batch / 4096
micro-batches): a guess consistent with the H200 call that finished infonce's four sizes and
decl's first two before its time ran out."""
CELL_S = {"RN": 65.0, "ViT": 45.0}
"""Seconds per matrix cell, the slowest measured on the H200 (RN50 36-64 s, ViT-B-32 36 s) plus
ZeRO-3's extra start."""

DONE_MEMORY = ("infonce",)
MISSING_RN_CASES = ("RN RN50 bf16 zero3", "RN RN50 fp16 zero0 uint8")
DONE_VIT_CASES = ("ViT ViT-B-32 fp32 zero2 uint8",)


def memory_seconds(loss: str, sizes: tuple[int, ...] = MEMORY_SIZES) -> float:
    return sum(PROBE_S.get(size, 95.0) for size in sizes)


def case_name(family: str, model: str, precision: str, stage: int, uint8: bool) -> str:
    """The matrix group's case name of a cell (bench/gpu_check/groups.py's ``check_matrix``)."""
    return f"{family} {model} {precision} zero{stage}" + (" uint8" if uint8 else "")


def vit_cases(precisions: tuple[str, ...], families: list[str], model: str = "ViT-B-32",
              uint8_supported: bool = True) -> list[str]:
    """Every ``matrix-vit`` cell of the full check."""
    return [case_name(family, model, precision, stage, uint8)
            for family, precision, stage, uint8 in
            matrix_cells(families, precisions, False, uint8_supported)
            if matrix_group(family) == "matrix-vit"]


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


def finish_calls(losses: list[str], precisions: tuple[str, ...], families: list[str]
                 ) -> list[tuple[str, str, float]]:
    """(group, the call's ``--memory-losses``/``--cases`` value, estimated seconds) per call."""
    calls: list[tuple[str, str, float]] = []
    memory = [(loss, memory_seconds(loss)) for loss in sorted(losses) if loss not in DONE_MEMORY]
    vit = [(case, CELL_S["ViT"]) for case in vit_cases(precisions, families)
           if case not in DONE_VIT_CASES]
    rn = [(case, CELL_S["RN"]) for case in MISSING_RN_CASES]
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


def queue() -> list[tuple[str, str, float]]:
    """Every device call still owed, most wanted first: (what it answers, the device tool's
    command, estimated seconds). The step table (issue "GPU speed") first, then the data path's
    end-to-end rows, the study plan's missing step times, the compiled arms, and the rest of the
    check (:func:`finish_calls`)."""
    from bench.gpu_check.groups import precisions, shipped_families
    from bench.gpu_check.plan import step_seconds, throughput_seconds
    from vlcontrast.losses import LOSSES

    run = "GPU_CHECK_TIMEOUT=470 bench/device_run.sh"
    # Each arm also profiled for 3 steps: op tables and kernels per step, to find what the
    # step's remaining host time goes to.
    calls = [("step table, ViT-B-32", f"{run} step --step-models ViT-B-32 --step-profile 3",
              CALL_SETUP_S + step_seconds(("ViT-B-32",), profile=True)),
             ("step table, RN50", f"{run} step --step-models RN50 --step-profile 3",
              CALL_SETUP_S + step_seconds(("RN50",), profile=True)),
             ("loader rows and end-to-end vs step alone", "bench/device_data.sh", DATA_CALL_S)]
    for batch in (32, 512):
        calls.append((f"study plan: step time at {batch} per GPU",
                      f"{run} throughput --throughput-batch {batch}",
                      CALL_SETUP_S + throughput_seconds(batch)))
    compiled = "plain,vlcontrast,vlcontrast+compile,vlcontrast+cudagraphs"
    calls.append(("compiled arms, ViT-B-32",
                  f"{run} step --step-models ViT-B-32 --step-arms {compiled}",
                  CALL_SETUP_S + step_seconds(("ViT-B-32",), arms=4) + 120.0))
    families = sorted(shipped_families())
    for group, selection, seconds in finish_calls(sorted(LOSSES), precisions(), families):
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
