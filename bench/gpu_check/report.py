"""Rows, per-group wall times and the final table (stdout, ``OUT/gpu_check.md``, ``.json``)."""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from vlcontrast.outputs import write_text_atomic


@dataclass
class Row:
    section: str
    case: str
    status: str  # pass | fail | skip
    detail: str
    seconds: float


@dataclass
class GroupTime:
    group: str
    estimate_s: float
    wall_s: float


class Report:
    def __init__(self, out: Path | None = None):
        self.out = out
        """Where the report is rewritten after every row (None: only when :meth:`write` is
        called), so a run stopped by a time limit inside a group keeps the rows it finished."""
        self.rows: list[Row] = []
        self.groups: list[GroupTime] = []
        self.info: dict[str, Any] = {}
        self.tables: dict[str, str] = {}
        """Extra markdown tables by title (throughput, memory)."""
        self.tracebacks: list[str] = []

    def add(self, section: str, case: str, status: str, detail: str, seconds: float = 0.0) -> None:
        row = Row(section, case, status, detail, round(seconds, 1))
        self.rows.append(row)
        print(f"[gpu-check] {status.upper():4s} {section}/{case}: {detail} ({row.seconds:.1f} s)",
              flush=True)
        if self.out is not None:
            self.write(self.out)

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.status == "fail"]

    def timed(self, section: str, case: str, check: Callable[[], tuple[str, str]]) -> None:
        """Run one check; ``check`` returns (status, detail). An exception is a failure row."""
        start = time.perf_counter()
        try:
            status, detail = check()
        except Exception as err:  # noqa: BLE001 - every failure becomes a row, the check goes on
            status, detail = "fail", f"{type(err).__name__}: {err}"[:600]
            self.tracebacks.append(f"{section}/{case}\n{traceback.format_exc()}")
        self.add(section, case, status, detail, time.perf_counter() - start)

    def group_table(self) -> str:
        header = ("GPU estimate (one H100; not for this CPU run)" if self.info.get("reduced")
                  else "estimate on one H100")
        lines = [f"| group | {header} | wall here | rows (pass/fail/skip) |",
                 "|---|---:|---:|---|"]
        for g in self.groups:
            rows = [r for r in self.rows if r.section == g.group]
            counts = "/".join(str(sum(r.status == s for r in rows)) for s in ("pass", "fail", "skip"))
            lines.append(f"| {g.group} | {g.estimate_s / 60:.1f} min | {g.wall_s / 60:.1f} min | "
                         f"{counts} |")
        total = sum(g.wall_s for g in self.groups)
        estimate = sum(g.estimate_s for g in self.groups)
        lines.append(f"| total | {estimate / 60:.1f} min | {total / 60:.1f} min | |")
        return "\n".join(lines)

    def markdown(self) -> str:
        info = self.info
        lines = ["# vlcontrast GPU check", "",
                 f"Mode: {'reduced (CPU)' if info.get('reduced') else 'full'}; device: "
                 f"{info.get('device_name')}; torch {info.get('torch')}, torchvision "
                 f"{info.get('torchvision')}, DeepSpeed "
                 f"{info.get('deepspeed')}, open_clip {info.get('open_clip')}, Python "
                 f"{info.get('python')}. Total {info.get('total_s', 0):.0f} s.", "",
                 "## Groups", "", self.group_table(), "",
                 "## Rows", "",
                 "| group | case | status | detail | s |", "|---|---|---|---|---:|"]
        for r in self.rows:
            detail = r.detail.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {r.section} | {r.case} | {r.status} | {detail} | {r.seconds:.1f} |")
        counts = {s: sum(r.status == s for r in self.rows) for s in ("pass", "fail", "skip")}
        lines += ["", f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped."]
        for title, table in self.tables.items():
            lines += ["", f"## {title}", "", table]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        return {"info": self.info, "groups": [asdict(g) for g in self.groups],
                "rows": [asdict(r) for r in self.rows], "tables": self.tables}

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "gpu_check.md", self.markdown())
        write_text_atomic(out / "gpu_check.json", json.dumps(self.to_json(), indent=2))
        write_text_atomic(out / "tracebacks.txt", "\n\n".join(self.tracebacks))


