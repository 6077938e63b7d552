# Shared by the sbatch scripts: environment, launch with srun, requeue when stopped early.
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export NCCL_ASYNC_ERROR_HANDLING=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
VLC=${VLC:-vlcontrast}

run_vlcontrast() {
  local config=$1; shift
  local out
  out=$($VLC config --config "$config" "$@" | python -c 'import sys,yaml; print(yaml.safe_load(sys.stdin)["output_dir"])')
  # --kill-on-bad-exit: one dead rank ends the step instead of leaving the others in a collective.
  srun --kill-on-bad-exit=1 --cpu-bind=none \
    python -m vlcontrast.cli train --config "$config" train.resume=latest "$@"
  local rc=$?
  if [ $rc -eq 0 ] && [ ! -f "$out/results.json" ]; then
    echo "stopped before the end (preemption/time limit): requeueing $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return $rc
}
