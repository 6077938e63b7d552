#!/usr/bin/env bash
# The data path on the device machine, in one call of about 6 minutes (docs/benchmarks.md, "Loader
# on a GPU node"): the cuda-marked decode tests, then bench/bench_loader.py with the GPU rows and
# the main thread's step time, on 256-px JPEG shards written here.
#
#   bench/device_data.sh [STEP_MODEL] [BATCH]          # defaults: ViT-B-32 128
#   bench/device_data.sh ViT-B-32 512                  # the issue's second batch size
#
# Through the device tool: run(command="bench/device_data.sh", carry=[".whl"], timeout_s=520); its
# three steps are cut at 110 + 60 + 300 s (470 s), so with the wheels (~20 s) it ends within the
# 520 s that bench/gpu_check/finish.py (DATA_TIMEOUT_S) and docs/benchmarks.md give it.
# Installs the carried wheels as bench/device_run.sh does; loader.md, its raw numbers (loader.json,
# rewritten after every row), the test log and the bench log are written to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
MODEL=${1:-ViT-B-32}
BATCH=${2:-128}
# Timed batches per row: 40 at 128, 16 at 512 (8,192 samples at most), so that a loader pass (one
# untimed batch, two warm-up steps, the timed ones) stays within one epoch of the 12,800 samples.
BATCHES=$(( 8192 / BATCH ))
[ "$BATCHES" -gt 40 ] && BATCHES=40
[ "$BATCHES" -lt 4 ] && { echo "device_data: batch $BATCH leaves fewer than 4 timed batches in 12,800 samples: use 2048 or less" >&2; exit 2; }
ls .whl/*.whl >/dev/null 2>&1 || { echo "device_data: no .whl/ here: run bench/device_wheels.py and carry .whl" >&2; exit 2; }
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device_data_out}
mkdir -p "$OUT"
SHARDS=/tmp/loader_shards
# 12,800 samples: 100 batches of 128 or 25 of 512.
timeout 110 $PY -c "
from pathlib import Path
from bench.gpu_check.shards import write_shards
print(write_shards(Path('$SHARDS'), 12800, 256, shard_size=400))" || exit 3
timeout 60 $PY -m pytest -q -p no:cacheprovider -m cuda tests/data/test_gpu_decode.py \
    2>&1 | tee "$OUT"/cuda_tests.log
timeout 300 $PY bench/bench_loader.py --shards "$SHARDS" --source-image-size 256 --image-size 224 \
    --batch-size "$BATCH" --batches "$BATCHES" --workers 4 8 14 --repeats 1 --device cuda \
    --step "$MODEL" --precision amp_bf16 --out "$OUT"/loader.md 2>&1 | tee "$OUT"/bench.log
