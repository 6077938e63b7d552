#!/bin/bash
# Samples/s and time per stage of the demo's training with extra overrides: one process with 2
# threads, 60 steps, no evaluation; prints the mean over steps 11-60 (README "Demo results").
# STEPS=160 FROM=90 measures steps 91-160 instead: the second epoch (78 steps an epoch), where
# data.cache_mb serves the samples from memory.
#   results/demo-tuning/samples_per_s.sh NAME [overrides ...]
# e.g. results/demo-tuning/samples_per_s.sh A data.train=data/synthetic/train
#      results/demo-tuning/samples_per_s.sh B data.train=data/syn32/train data.normalize_on_device=true
# Run the settings to compare one after another on a quiet machine: this machine's speed drifts
# by up to 20% within an hour, so only numbers taken together compare.
set -euo pipefail
name=$1; shift
out=runs/demo-tuning/samples-per-s-$name
steps=${STEPS:-60}; from=${FROM:-10}
common="data.val=data/synthetic/val eval.zeroshot= train.steps=$steps train.log_every=10 eval.every=0
        checkpoint.every=100000 logging.progress=false optim.warmup_steps=5"
env -u OMP_NUM_THREADS .venv/bin/vlcontrast train --config configs/demo.yaml --nproc 1 \
    output_dir=$out $common "$@" > $out.log 2>&1 || { tail -n 5 $out.log; exit 1; }
.venv/bin/python - "$out/metrics.jsonl" "$name" "$from" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
rows = [r for r in rows if "samples_per_s" in r and r["step"] > int(sys.argv[3])]
keys = ["samples_per_s"] + [k for k in rows[0] if k.startswith("time/")]
print(sys.argv[2], {k: round(statistics.mean(r[k] for r in rows), 3) for k in keys})
PY
