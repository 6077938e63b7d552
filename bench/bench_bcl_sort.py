"""The row sorts behind BCL's rank weights, on one chunked block of logits.

BCL's weights need each negative's rank in its row. The chunked forward only needs each row's
multiset of ``L + log w`` and sorts values in place; the backward (and the dense path) needs the
sort order. This times, on a ``rows x cols`` float32 block (default 1024 x 16384, one
``loss.chunk_size = 1024`` block at N = 16384): torch's sort and argsort (the peer), numpy's value
sort and argsort on one thread, and vlcontrast's ``_sort_rows_`` / ``_argsort_rows`` (numpy's SIMD
sorts on row slices across torch's threads). Milliseconds, best of ``--rounds``, with ratios to
torch's ``argsort``.

    python bench/bench_bcl_sort.py
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vlcontrast.losses.bcl import _argsort_rows, _sort_rows_  # noqa: E402


def _provenance(packages: tuple[str, ...] = ()) -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import provenance

    return provenance.line(packages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path, default=ROOT / "bench/results/bcl-sort.md")
    args = parser.parse_args()
    torch.manual_seed(0)
    block = torch.randn(args.rows, args.cols) * 14.29
    array = block.numpy()
    cases = {
        "torch argsort (peer)": lambda: block.argsort(dim=1),
        "torch sort (values)": lambda: block.sort(dim=1).values,
        "numpy argsort, 1 thread": lambda: np.argsort(array, axis=1),
        "numpy value sort, 1 thread": lambda: np.sort(array, axis=1),
        f"_argsort_rows, {torch.get_num_threads()} threads (backward, dense)":
            lambda: _argsort_rows(block),
        f"_sort_rows_ in place, {torch.get_num_threads()} threads (chunked forward)":
            lambda: _sort_rows_(block.clone()),
        "block.clone() (part of the line above)": lambda: block.clone(),
    }
    expected = block.sort(dim=1).values
    assert torch.equal(block.gather(1, _argsort_rows(block)), expected)
    assert torch.equal(_sort_rows_(block.clone()), expected)
    best = dict.fromkeys(cases, float("inf"))
    for round_index in range(args.rounds):
        for name, fn in (cases.items() if round_index % 2 == 0 else reversed(cases.items())):
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    peer = best["torch argsort (peer)"]
    lines = ["# BCL row sorts on one block of logits", "",
             f"- machine: {platform.machine()}, {torch.get_num_threads()} torch threads; "
             f"torch {torch.__version__}, numpy {np.__version__}",
             f"- {_provenance(('numpy',))}",
             "- command: `" + " ".join(["python bench/bench_bcl_sort.py", *sys.argv[1:]]) + "`",
             f"- float32 block {args.rows} x {args.cols}; best of {args.rounds} rounds "
             "(alternating order)", "",
             "| sort | ms | vs torch argsort |", "|---|---:|---:|"]
    lines += [f"| {name} | {ms:.1f} | {ms / peer:.2f} |" for name, ms in best.items()]
    table = "\n".join(lines) + "\n"
    print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(table)


if __name__ == "__main__":
    main()
