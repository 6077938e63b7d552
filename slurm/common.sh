# Shared by the sbatch scripts: environment, launch with srun, requeue when stopped early.
#
# Every task reads its rank and the world from SLURM_PROCID/SLURM_NTASKS and the master address
# from the first host of SLURM_JOB_NODELIST (vlcontrast.distributed.launch_env); the port is
# derived from the job id. train.resume=latest is always set: a fresh job starts from scratch,
# a requeued one continues from its newest complete checkpoint.
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python}

run_vlcontrast() {
  local config=$1; shift
  local out
  out=$($PYTHON -m vlcontrast.cli config --config "$config" "$@" \
        | $PYTHON -c 'import sys, yaml; print(yaml.safe_load(sys.stdin)["output_dir"])') || return 2
  echo "vlcontrast: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NUM_NODES node(s), $SLURM_NTASKS tasks, run dir $out"
  # --kill-on-bad-exit: a rank that dies ends the step at once; the others would otherwise fail
  # only at their next collective (after train.dist_timeout_s at worst).
  srun --kill-on-bad-exit=1 --cpu-bind=none \
    $PYTHON -m vlcontrast.cli train --config "$config" "$@" train.resume=latest
  local rc=$?
  # Exit 0 without results.json: stopped by SIGUSR1/SIGTERM after a checkpoint (time limit or
  # preemption notice). Requeue: the next run resumes from that checkpoint.
  if [ $rc -eq 0 ] && [ ! -f "$out/results.json" ]; then
    echo "vlcontrast: stopped before the end; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return $rc
}
