"""Image-text retrieval of a checkpoint on webdataset shards; writes a JSON record.

    python eval/retrieval.py --checkpoint runs/my_run --data data/cc3m_val --out results/ret.json
    torchrun --nproc_per_node 8 eval/retrieval.py ...   # every rank embeds its part

Same as ``vlcontrast eval retrieval``; see docs/evaluation.md.
"""

import argparse

from vlcontrast.evaluation import run_retrieval_cli


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="run dir (its latest) or checkpoint dir")
    parser.add_argument("--data", required=True, help="shard dir, brace pattern or comma list")
    parser.add_argument("--out", default="", help="JSON file to write")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--max-samples", type=int, default=0, help="0: all")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    run_retrieval_cli(args.checkpoint, args.data, args.out, args.batch_size, args.workers,
                      args.max_samples, args.device)


if __name__ == "__main__":
    main()
