# Shared by the sbatch scripts: environment, CPU binding, launch with srun, requeue when preempted.
#
# Every task reads its rank and the world from SLURM_PROCID/SLURM_NTASKS and the master address
# from the first host of SLURM_JOB_NODELIST (vlcontrast.distributed.launch_env); the port is
# derived from the job id. train.resume=latest is always set: a fresh job starts from scratch,
# a requeued one continues from its newest complete checkpoint.
#
# CPU binding. Since Slurm 22.05 srun no longer inherits the job's --cpus-per-task: without it
# each task (one GPU rank and its data.workers loader processes) would get one core. srun gets it
# explicitly (SRUN_CPUS_PER_TASK and --cpus-per-task) and every task is bound to its own cores
# (--cpu-bind=cores, VLC_CPU_BIND to change). Inside a task: data.workers loader processes (at most
# cores - 1, lowered with a notice otherwise) and OMP_NUM_THREADS = the cores left to the rank.
#
# Requeue. A run stopped by a signal (SIGUSR1 from --signal before the time limit, SIGTERM on
# preemption) checkpoints, exits 0 and leaves RUN/preempted.json (vlcontrast.requeue): then the job
# is requeued and resumes; a notice during a task's start-up is held and acted on after step 1, the
# same way (one in the very first moments of a task ends it with exit 128+SIGUSR1: requeued too,
# nothing was trained). A run that exits 0 without that marker finished (results.json) or
# stopped at train.stop_at_step: not requeued. A failure (non-zero exit) is not requeued either.
# "Finished" means this job wrote RUN/results.json: one left by an earlier run does not count.
if [ -z "${SLURM_JOB_ID:-}" ] || [ -z "${SLURM_JOB_NODELIST:-}" ]; then
  echo "vlcontrast: $0 runs inside a SLURM job (SLURM_JOB_ID and SLURM_JOB_NODELIST are not set): submit it with sbatch (sbatch $0 CONFIG [key=value ...])" >&2
  exit 2
fi
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python}
# Requeues allowed before giving up (a job preempted again and again without progress ends here).
VLC_MAX_RESTARTS=${VLC_MAX_RESTARTS:-100}

# Print KEY VALUE lines of the resolved config: output_dir and data.workers. A config that does
# not resolve (a missing file, an unknown key) is `vlcontrast config`'s one-line error, exit 2.
_vlcontrast_settings() {
  local resolved
  resolved=$("$PYTHON" -m vlcontrast.cli config "$@") || return 2
  "$PYTHON" -c '
import sys, yaml
config = yaml.safe_load(sys.stdin)
print("output_dir", config["output_dir"])
print("workers", config["data"]["workers"])' <<<"$resolved"
}

# A signature of RUN/results.json (modification time with nanoseconds, size, checksum), or
# nothing when there is none: the run finished in this job only if it changed.
_results_signature() {
  [ -f "$1" ] || return 0
  printf '%s %s' "$(stat -c '%y %s' "$1" 2>/dev/null)" "$(cksum <"$1" 2>/dev/null)"
}

run_vlcontrast() {
  local config=$1; shift
  local settings out workers
  settings=$(_vlcontrast_settings --config "$config" "$@") || return 2
  out=$(awk '$1 == "output_dir" { sub(/^output_dir /, ""); print }' <<<"$settings")
  workers=$(awk '$1 == "workers" { print $2 }' <<<"$settings")

  local cpus=${SLURM_CPUS_PER_TASK:-1}
  export SRUN_CPUS_PER_TASK=$cpus
  local extra=()
  if [ "$workers" -gt $((cpus - 1)) ]; then
    local fitted=$((cpus > 1 ? cpus - 1 : 0))
    echo "vlcontrast: data.workers=$workers needs $((workers + 1)) cores per task, the task has $cpus (--cpus-per-task): using data.workers=$fitted"
    workers=$fitted
    extra+=("data.workers=$workers")
  fi
  # The rank's own threads: the cores its loader workers leave (each worker runs one thread).
  local threads=$((cpus - workers))
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((threads > 0 ? threads : 1))}

  echo "vlcontrast: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NUM_NODES:-1} node(s), ${SLURM_NTASKS:-1} tasks x $cpus cores ($workers loader workers, OMP_NUM_THREADS=$OMP_NUM_THREADS), run dir $out"
  rm -f "$out/preempted.json"  # a marker from an earlier stop must not requeue this run
  local before
  before=$(_results_signature "$out/results.json")  # an earlier run's results.json is not ours
  # --kill-on-bad-exit: a rank that dies ends the step at once; the others would otherwise fail
  # only at their next collective (after train.dist_timeout_s at worst).
  srun --kill-on-bad-exit=1 --cpus-per-task="$cpus" --cpu-bind="${VLC_CPU_BIND:-cores}" \
    "$PYTHON" -m vlcontrast.cli train --config "$config" "$@" ${extra[@]+"${extra[@]}"} train.resume=latest
  local rc=$?
  # A notice while a task starts is held by `vlcontrast train` (the run stops after step 1 with a
  # checkpoint and the marker, below), except in the first tenths of a second, before the command
  # line installs its handler: SIGUSR1 then ends the task, and srun reports 128 + the signal.
  # Nothing was trained: the job runs again like a stopped one.
  if [ $rc -eq $((128 + $(kill -l USR1))) ]; then
    if [ "${SLURM_RESTART_COUNT:-0}" -ge "$VLC_MAX_RESTARTS" ]; then
      echo "vlcontrast: stopped by the time limit's notice (SIGUSR1) before step 1, after $VLC_MAX_RESTARTS requeues (VLC_MAX_RESTARTS); not requeueing"
      return $rc
    fi
    echo "vlcontrast: stopped by the time limit's notice (SIGUSR1, exit $rc) while a task was starting, before step 1 (nothing trained, no checkpoint needed); requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    return 0
  fi
  if [ $rc -ne 0 ]; then
    echo "vlcontrast: training failed (exit $rc); not requeueing"
    return $rc
  fi
  if [ -f "$out/preempted.json" ]; then
    if [ "${SLURM_RESTART_COUNT:-0}" -ge "$VLC_MAX_RESTARTS" ]; then
      echo "vlcontrast: stopped by a signal after $VLC_MAX_RESTARTS requeues (VLC_MAX_RESTARTS); not requeueing"
      return 0
    fi
    echo "vlcontrast: stopped by a signal after a checkpoint; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
  elif [ -f "$out/results.json" ] && [ "$(_results_signature "$out/results.json")" != "$before" ]; then
    echo "vlcontrast: finished; results in $out/results.json"
  elif [ -f "$out/results.json" ]; then
    echo "vlcontrast: stopped at train.stop_at_step with a checkpoint, not finished: $out/results.json is an earlier run's (this job did not write it); not requeueing (resubmit with a later train.stop_at_step, or 0 for the end, to continue)"
  else
    echo "vlcontrast: stopped at train.stop_at_step with a checkpoint; not requeueing (resubmit to continue)"
  fi
  return 0
}
