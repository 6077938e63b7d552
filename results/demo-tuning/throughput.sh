#!/bin/bash
# Demo throughput (README "Demo results", results/demo-tuning/README.md): one process with 2 threads
# (loader worker in its own process, or data.workers=0: decoded in the training process) against
# two single-thread processes at the same global batch. 40 steps each, no evaluation; compare
# samples_per_s and time/* in the runs' metrics.jsonl. Extra overrides apply to all three runs
# (e.g. results/demo-tuning/throughput.sh data.normalize_on_device=true). Run it on a quiet machine (other training jobs can be paused with
# kill -STOP / kill -CONT around it, as was done for the recorded numbers).
set -euo pipefail
common="data.train=data/synthetic/train data.val=data/synthetic/val eval.zeroshot= train.steps=40
        train.log_every=10 eval.every=0 checkpoint.every=100000 logging.progress=false optim.warmup_steps=5"
env -u OMP_NUM_THREADS .venv/bin/vlcontrast train --config configs/demo.yaml --nproc 1 \
    output_dir=runs/demo-tuning/throughput-n1 $common "$@"
env -u OMP_NUM_THREADS .venv/bin/vlcontrast train --config configs/demo.yaml --nproc 1 \
    output_dir=runs/demo-tuning/throughput-n1-workers0 data.workers=0 $common "$@"
env -u OMP_NUM_THREADS .venv/bin/vlcontrast train --config configs/demo.yaml --nproc 2 \
    output_dir=runs/demo-tuning/throughput-n2 data.batch_size=128 $common "$@"
