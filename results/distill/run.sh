#!/usr/bin/env bash
# Distillation evidence (docs/distillation.md, "Evidence"): a teacher trained with vlcontrast, then
# a small student trained alone and distilled with each kind, at equal samples, 3 seeds. CPU only,
# one thread per process, two processes at a time. Two datasets: the synthetic world (default) and
# the openclipart-png clip art of docs/tutorial-own-data.md (DATASET=clipart; its data stage needs
# the package's folder, CLIPART=/usr/share/openclipart/png by default).
#
#   results/distill/run.sh [data|teacher|students|table|all]
#   ARMS=alone PARALLEL=1 results/distill/run.sh students    # the students that need no teacher
#   DATASET=clipart CLIPART=/tmp/openclipart/usr/share/openclipart/png results/distill/run.sh
#
# The distilled students read the teacher's embeddings from `vlcontrast prep teacher` (offline);
# online distillation gives the same numbers (tests/distill/test_training.py) and its cost per step
# is measured by bench/bench_distill.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
STAGE=${1:-all}
DATASET=${DATASET:-synthetic}
case $DATASET in
  synthetic)
    DATA=${DATA:-data/distill-synthetic}
    ZEROSHOT=${ZEROSHOT:-$DATA/zeroshot}
    OUT=${OUT:-runs/distill}
    TABLE=${TABLE:-results/distill/table.md}
    TEACHER_STEPS=${TEACHER_STEPS:-120}   # x batch 256 = 30,720 samples (3.1 passes)
    TEACHER_MODEL=${TEACHER_MODEL:-vlc-rn-tiny-32}
    ;;
  clipart)
    # the tutorial's split: 7,328 training and 777 held-out drawings, shards at 64 px (both
    # models see 32 px), captions from the file names; zero-shot over the 22 category folders
    CLIPART=${CLIPART:-/usr/share/openclipart/png}
    DATA=${DATA:-data/openclipart}
    ZEROSHOT=${ZEROSHOT:-data/openclipart-classes/val}
    OUT=${OUT:-runs/distill-clipart}
    TABLE=${TABLE:-results/distill/table-clipart.md}
    TEACHER_STEPS=${TEACHER_STEPS:-100}   # x batch 256 = 25,600 samples (3.5 passes)
    TEACHER_MODEL=${TEACHER_MODEL:-vlc-rn-tiny-32}  # vlc-rn-tiny (64 px): 26-40 samples/s vs 54
    ;;
  *) echo "DATASET=$DATASET: synthetic or clipart" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python}
SEEDS=${SEEDS:-"0 1 2"}
STUDENT_STEPS=${STUDENT_STEPS:-150}   # x batch 128 = 19,200 samples (1.9 passes; clip art 2.6)
export OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
vlc() { nice -n 10 "$PYTHON" -m vlcontrast.cli "$@"; }

COMMON=(data.train=$DATA/train data.val=$DATA/val eval.zeroshot=$ZEROSHOT data.workers=0
        data.augment=false data.cache_mb=256 train.precision=fp32 train.log_every=50
        logging.progress=false logging.tensorboard=false checkpoint.every=0 checkpoint.keep=1
        eval.batch_size=250)

if [[ ($STAGE == data || $STAGE == all) && $DATASET == clipart ]]; then
  # docs/tutorial-own-data.md, steps 2 and 3 (resumable: a second run keeps finished shards)
  vlc prep folder "$CLIPART" $DATA --caption-from name --caption-template "{name}, {path} clip art" \
      --val-fraction 0.1 --image-size 64 --workers 2 --no-progress
  vlc prep folder "$CLIPART" ${ZEROSHOT%/val} --caption-from class \
      --template "clip art of a {c}." --template "a drawing of a {c}." \
      --val-fraction 0.1 --image-size 64 --workers 2 --no-progress
elif [[ $STAGE == data || $STAGE == all ]]; then
  vlc prep synthetic --out $DATA --train 10000 --val 1000 --zeroshot-per-class 50 \
      --image-size 32 --single-object 0.8 --bare 0.3 --workers 2 --no-progress --skip-if-current
fi

if [[ $STAGE == teacher || $STAGE == all ]]; then
  # the demo's model and loss (configs/demo.yaml), 2 threads
  OMP_NUM_THREADS=2 vlc train "${COMMON[@]}" output_dir=$OUT/teacher seed=0 \
      model.name=$TEACHER_MODEL loss.name=dcl data.batch_size=256 train.steps=$TEACHER_STEPS \
      optim.lr=3e-3 optim.weight_decay=0.1 optim.warmup_steps=25
  vlc prep teacher $DATA/train $OUT/teacher-features.pt --teacher $OUT/teacher \
      --augmentations 0 --no-progress --overwrite  # the teacher above is new
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
  "$PYTHON" results/distill/table.py $OUT > $TABLE
fi
