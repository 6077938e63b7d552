"""Evaluate several checkpoints on the same data and write one comparison table.

    python eval/compare_checkpoints.py runs/infonce runs/dcl runs/siglip \\
        --retrieval data/cc3m_val --zeroshot /data/ILSVRC2012/val --out results/compare

Writes ``OUT/<n>_<task>.json`` per checkpoint and task, ``OUT/comparison.json`` and
``OUT/comparison.md`` (one row per checkpoint; a markdown table).
"""

import argparse
import json
from pathlib import Path

from vlcontrast.evaluation import run_retrieval_cli, run_zeroshot_cli

COLUMNS = {
    "retrieval": ["image_to_text_R@1", "image_to_text_R@5", "text_to_image_R@1",
                  "text_to_image_R@5", "val_loss"],
    "zeroshot": ["top1", "top5", "mean_per_class_recall"],
}


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| checkpoint | " + " | ".join(columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for row in rows:
        cells = [f"{row[c]:.4f}" if isinstance(row.get(c), float) else str(row.get(c, ""))
                 for c in columns]
        lines.append(f"| {row['checkpoint']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--retrieval", default="", help="retrieval shards")
    parser.add_argument("--zeroshot", default="", help="zero-shot data dir")
    parser.add_argument("--classnames", default=None)
    parser.add_argument("--templates", default=None)
    parser.add_argument("--max-samples", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args()
    if not args.retrieval and not args.zeroshot:
        parser.error("give --retrieval and/or --zeroshot")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, columns = [], []
    for task in ("retrieval", "zeroshot"):
        if getattr(args, task):
            columns += [f"{task}/{c}" for c in COLUMNS[task]]
    for index, checkpoint in enumerate(args.checkpoints):
        row = {"checkpoint": checkpoint}
        if args.retrieval:
            record = run_retrieval_cli(checkpoint, args.retrieval, out / f"{index}_retrieval.json",
                                       args.batch_size, args.workers, args.max_samples, args.device)
            row.update({f"retrieval/{k}": v for k, v in record["metrics"].items()})
        if args.zeroshot:
            record = run_zeroshot_cli(checkpoint, args.zeroshot, out / f"{index}_zeroshot.json",
                                      args.classnames, args.templates, args.batch_size,
                                      args.workers, args.device)
            row.update({f"zeroshot/{k}": v for k, v in record["metrics"].items()})
        rows.append(row)
    (out / "comparison.json").write_text(json.dumps(rows, indent=2) + "\n")
    table = markdown_table(rows, columns)
    (out / "comparison.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
