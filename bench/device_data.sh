#!/usr/bin/env bash
# The data path on the device machine, in one call of about 6 minutes (docs/benchmarks.md, "Loader
# on a GPU node"): the cuda-marked decode tests, then bench/bench_loader.py with the GPU rows and
# the main thread's step time, on 256-px JPEG shards written here.
#
#   bench/device_data.sh [STEP_MODEL] [BATCH]          # defaults: ViT-B-32 128
#
# Through the device tool: run(command="bench/device_data.sh", carry=[".whl"], timeout_s=480).
# Installs the carried wheels as bench/device_run.sh does; loader.md, its raw numbers (loader.json,
# rewritten after every row), the test log and the bench log are written to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
MODEL=${1:-ViT-B-32}
BATCH=${2:-128}
ls .whl/*.whl >/dev/null 2>&1 || { echo "device_data: no .whl/ here: run bench/device_wheels.py and carry .whl" >&2; exit 2; }
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device_data_out}
mkdir -p "$OUT"
SHARDS=/tmp/loader_shards
# 12,800 samples: 100 batches of 128, enough for 40 timed batches per worker count.
timeout 150 $PY -c "
from pathlib import Path
from bench.gpu_check.shards import write_shards
print(write_shards(Path('$SHARDS'), 12800, 256, shard_size=400))" || exit 3
timeout 90 $PY -m pytest -q -p no:cacheprovider -m cuda tests/data/test_gpu_decode.py \
    2>&1 | tee "$OUT"/cuda_tests.log
timeout 330 $PY bench/bench_loader.py --shards "$SHARDS" --source-image-size 256 --image-size 224 \
    --batch-size "$BATCH" --batches 40 --workers 4 8 14 --repeats 1 --device cuda \
    --step "$MODEL" --precision amp_bf16 --out "$OUT"/loader.md 2>&1 | tee "$OUT"/bench.log
