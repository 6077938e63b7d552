#!/usr/bin/env bash
# Distillation evidence on the synthetic world (docs/distillation.md, "Evidence"): a teacher
# trained with vlcontrast, then a small student trained alone and distilled with each kind, at
# equal samples, 3 seeds. CPU only, one thread per process, two processes at a time.
#
#   results/distill/run.sh [data|teacher|students|table|all]
#   ARMS=alone PARALLEL=1 results/distill/run.sh students    # the students that need no teacher
#
# The distilled students read the teacher's embeddings from `vlcontrast prep teacher` (offline);
# online distillation gives the same numbers (tests/distill/test_training.py) and its cost per step
# is measured by bench/bench_distill.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
STAGE=${1:-all}
DATA=${DATA:-data/distill-synthetic}
OUT=${OUT:-runs/distill}
PYTHON=${PYTHON:-python}
SEEDS=${SEEDS:-"0 1 2"}
STUDENT_STEPS=${STUDENT_STEPS:-150}   # x batch 128 = 19,200 samples (1.9 passes)
TEACHER_STEPS=${TEACHER_STEPS:-120}   # x batch 256 = 30,720 samples (3.1 passes)
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
vlc() { nice -n 10 "$PYTHON" -m vlcontrast.cli "$@"; }

COMMON=(data.train=$DATA/train data.val=$DATA/val eval.zeroshot=$DATA/zeroshot data.workers=0
        data.augment=false data.cache_mb=256 train.precision=fp32 train.log_every=50
        logging.progress=false logging.tensorboard=false checkpoint.every=0 checkpoint.keep=1
        eval.batch_size=250)

if [[ $STAGE == data || $STAGE == all ]]; then
  vlc prep synthetic --out $DATA --train 10000 --val 1000 --zeroshot-per-class 50 \
      --image-size 32 --single-object 0.8 --bare 0.3 --workers 2 --no-progress --skip-if-current
fi

if [[ $STAGE == teacher || $STAGE == all ]]; then
  # the demo's model and loss (configs/demo.yaml), 2 threads
  OMP_NUM_THREADS=2 vlc train "${COMMON[@]}" output_dir=$OUT/teacher seed=0 \
      model.name=vlc-rn-tiny-32 loss.name=dcl data.batch_size=256 train.steps=$TEACHER_STEPS \
      optim.lr=3e-3 optim.weight_decay=0.1 optim.warmup_steps=25
  vlc prep teacher $DATA/train $OUT/teacher-features.pt --teacher $OUT/teacher \
      --augmentations 0 --no-progress
fi

student() {  # seed arm
  local seed=$1 arm=$2 extra=()
  case $arm in
    alone) ;;
    logits) extra=(distill.teacher_features=$OUT/teacher-features.pt distill.kind=logits) ;;
    features|interactive)
      extra=(distill.teacher_features=$OUT/teacher-features.pt distill.kind=$arm
             distill.projection=true) ;;
  esac
  [[ -f $OUT/$arm-$seed/results.json ]] && return 0
  vlc train "${COMMON[@]}" output_dir=$OUT/$arm-$seed seed=$seed model.name=vlc-rn-micro \
      loss.name=infonce data.batch_size=128 train.steps=$STUDENT_STEPS optim.lr=2e-3 \
      optim.weight_decay=0.1 optim.warmup_steps=20 "${extra[@]}" > $OUT/$arm-$seed.log 2>&1
}
export -f student vlc
export DATA OUT PYTHON STUDENT_STEPS
export COMMON_STRING="${COMMON[*]}"

ARMS=${ARMS:-"alone logits features interactive"}
if [[ $STAGE == students || $STAGE == all ]]; then
  mkdir -p $OUT
  for seed in $SEEDS; do for arm in $ARMS; do echo "$seed $arm"; done
  done | xargs -P ${PARALLEL:-2} -L 1 bash -c 'COMMON=($COMMON_STRING); student "$0" "$1"'
fi

if [[ $STAGE == table || $STAGE == all ]]; then
  "$PYTHON" results/distill/table.py $OUT > results/distill/table.md
fi
