#!/usr/bin/env bash
# One GPU-check group on the device machine, in one call (docs/training.md, "GPU check on the
# device machine"). The machine has Python 3.12 with torch but no venv, no make and no registry:
# the wheels that bench/device_wheels.py put in .whl/ (carried with the call) are installed first.
#
#   bench/device_run.sh GROUP[,GROUP...] [more python -m bench.gpu_check arguments]
#
# e.g. through the device tool: run(command="GPU_CHECK_TIMEOUT=340 bench/device_run.sh syncs,losses",
# carry=[".whl"], timeout_s=380): the device tool's timeout_s must exceed GPU_CHECK_TIMEOUT by the
# 40 s outside it (the wheels, timeout's 10 s grace, the copy), at most 600; `python -m
# bench.gpu_check.finish --sessions` prints both for every owed call.
# The check runs in /tmp/gpu_check (its shards, runs and job logs stay on the machine's disk; a
# warm machine keeps them for the next call, so this call's outputs are cleared first, the shards
# kept); gpu_check.md, gpu_check.json, tracebacks.txt, a tarball of the job logs (jobs/, with the
# losses group's pytest_cuda.log, also copied on its own) and, when the step group ran in this
# call, its step_<date>.json and step.md (and its op tables with --step-profile) are copied to $OUT
# (the folder the device tool brings back) when it is set; a line names each that is missing.
# `python -m bench.gpu_check.finish --collect DIR` files them into bench/results/gpu_check/.
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
# A warm machine still holds the previous call's outputs: none of them may come back as this one's.
rm -rf "$CHECK_OUT"/jobs "$CHECK_OUT"/step
rm -f "$CHECK_OUT"/gpu_check.md "$CHECK_OUT"/gpu_check.json "$CHECK_OUT"/tracebacks.txt \
    "$CHECK_OUT"/pytest_cuda.log
case ",$WANT," in
*,step,*) STEP=1 ;;
*) STEP= ;;
esac
# GPU_CHECK_TIMEOUT=SECONDS stops the check in time for the copy below to run: the check cuts its
# jobs to the time left (--time-limit), and on timeout's TERM kills the running ones and writes its
# report (it is also written before the first group, after every group and after every row).
if [ -n "${GPU_CHECK_TIMEOUT:-}" ]; then
    timeout --signal=TERM --kill-after=10 "$GPU_CHECK_TIMEOUT" $PY -m bench.gpu_check --out "$CHECK_OUT" --only "$WANT" --time-limit "$GPU_CHECK_TIMEOUT" "$@"
else
    $PY -m bench.gpu_check --out "$CHECK_OUT" --only "$WANT" "$@"
fi
rc=$?
missing() {
    echo "device_run: $1 missing from $CHECK_OUT: the check stopped before writing it (see the output above and job_logs.tar.gz)" >&2
}
if [ -n "${OUT:-}" ]; then
    for name in gpu_check.md gpu_check.json tracebacks.txt; do
        if [ -f "$CHECK_OUT/$name" ]; then cp "$CHECK_OUT/$name" "$OUT"/; else missing "$name"; fi
    done
    if [ -d "$CHECK_OUT"/jobs ]; then
        tar -czf "$OUT"/job_logs.tar.gz -C "$CHECK_OUT" jobs
    else
        missing "jobs/ (the job logs)"
    fi
    # The losses group's `pytest -m cuda` log, also on its own (it is in the tarball too).
    [ -f "$CHECK_OUT"/jobs/pytest_cuda.log ] && cp "$CHECK_OUT"/jobs/pytest_cuda.log "$OUT"/
    if [ -n "$STEP" ]; then
        # The step group's raw numbers (bench/bench_step.py): for bench/results/gpu_check/.
        if ls "$CHECK_OUT"/step/step_*.json >/dev/null 2>&1; then
            cp "$CHECK_OUT"/step/step_*.json "$OUT"/
        else
            missing "step/step_*.json"
        fi
        if [ -f "$CHECK_OUT"/step/step.md ]; then cp "$CHECK_OUT"/step/step.md "$OUT"/; else missing step/step.md; fi
        # --step-profile: the op tables of every arm, in one file.
        ls "$CHECK_OUT"/step/profile_*.txt >/dev/null 2>&1 && \
            tar -czf "$OUT"/step_profiles.tar.gz -C "$CHECK_OUT"/step $(cd "$CHECK_OUT"/step && ls profile_*.txt)
    fi
fi
exit $rc
