#!/bin/bash
# One demo-tuning run (results/demo-tuning/README.md): 1 process, 1 thread, the demo's config with
# the given training data, model config and overrides; evaluation on the demo's validation and
# zero-shot sets (data/synthetic, which do not depend on the training mix).
#   results/demo-tuning/run.sh NAME TRAIN_DATA_DIR MODEL [overrides ...]
set -euo pipefail
name=$1; data=$2; model=$3; shift 3
OMP_NUM_THREADS=1 .venv/bin/vlcontrast train --config configs/demo.yaml --nproc 1 \
  output_dir=runs/demo-tuning/$name data.train=$data/train data.val=data/synthetic/val \
  eval.zeroshot=data/synthetic/zeroshot model.name=$model data.workers=1 eval.every=100 \
  checkpoint.every=100000 logging.progress=false "$@"
