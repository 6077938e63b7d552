#!/usr/bin/env bash
# One GPU-check group on the device machine, in one call (docs/training.md, "GPU check on the
# device machine"). The machine has Python 3.12 with torch but no venv, no make and no registry:
# the wheels that bench/device_wheels.py put in .whl/ (carried with the call) are installed first.
#
#   bench/device_run.sh GROUP[,GROUP...] [more python -m bench.gpu_check arguments]
#
# e.g. through the device tool: run(command="bench/device_run.sh syncs,losses", carry=[".whl"]).
# The check runs in /tmp/gpu_check (its shards, runs and job logs stay on the machine's disk);
# gpu_check.md, gpu_check.json, tracebacks.txt, the step group's step_<date>.json and step.md (and
# its op tables with --step-profile) and a tarball of the job logs are copied to $OUT
# (the folder the device tool brings back) when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WANT=${1:?usage: bench/device_run.sh GROUP[,GROUP...] [gpu_check arguments]}
shift
ls .whl/*.whl >/dev/null 2>&1 || { echo "device_run: no .whl/ here: run bench/device_wheels.py and carry .whl" >&2; exit 2; }
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
$PY -c "import deepspeed, open_clip, open_clip_train.main, webdataset, braceexpand, ftfy, pydantic" || exit 2
CHECK_OUT=${GPU_CHECK_OUT:-/tmp/gpu_check}
# GPU_CHECK_TIMEOUT=SECONDS stops the check in time for the copy below to run (the report is
# rewritten after every row, so the rows that ended come back).
if [ -n "${GPU_CHECK_TIMEOUT:-}" ]; then
    timeout --signal=TERM --kill-after=10 "$GPU_CHECK_TIMEOUT" $PY -m bench.gpu_check --out "$CHECK_OUT" --only "$WANT" "$@"
else
    $PY -m bench.gpu_check --out "$CHECK_OUT" --only "$WANT" "$@"
fi
rc=$?
if [ -n "${OUT:-}" ]; then
    cp "$CHECK_OUT"/gpu_check.md "$CHECK_OUT"/gpu_check.json "$CHECK_OUT"/tracebacks.txt "$OUT"/ 2>/dev/null
    tar -czf "$OUT"/job_logs.tar.gz -C "$CHECK_OUT" jobs 2>/dev/null
    # The step group's raw numbers (bench/bench_step.py): for bench/results/gpu_check/.
    cp "$CHECK_OUT"/step/step_*.json "$CHECK_OUT"/step/step.md "$OUT"/ 2>/dev/null
    # --step-profile: the op tables of every arm, in one file.
    ls "$CHECK_OUT"/step/profile_*.txt >/dev/null 2>&1 && \
        tar -czf "$OUT"/step_profiles.tar.gz -C "$CHECK_OUT"/step $(cd "$CHECK_OUT"/step && ls profile_*.txt)
fi
exit $rc
