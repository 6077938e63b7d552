"""Zero-shot classification of a checkpoint; writes a JSON record.

    python eval/zeroshot.py --checkpoint runs/my_run --data /data/ILSVRC2012/val --out zs.json
    python eval/zeroshot.py --checkpoint CKPT --data my_folder --classnames names.txt \\
        --templates templates.txt --out zs.json

``--data``: ImageNet val dir (1000 WNID folders), any ImageFolder, or a CLIP_benchmark webdataset
directory. Same as ``vlcontrast eval zeroshot``; see docs/evaluation.md.
"""

import argparse

from vlcontrast.evaluation import run_zeroshot_cli


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="run dir (its latest) or checkpoint dir")
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", default="", help="JSON file to write")
    parser.add_argument("--classnames", default=None, help="one class name per line")
    parser.add_argument("--templates", default=None, help="one prompt per line with {c}")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    run_zeroshot_cli(args.checkpoint, args.data, args.out, args.classnames, args.templates,
                     args.batch_size, args.workers, args.device)


if __name__ == "__main__":
    main()
