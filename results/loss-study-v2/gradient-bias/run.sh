#!/bin/sh
# The measured gradient bias of every v2 setting at the study's batch sizes, on each dataset's
# first committed start (k0), text tower only (the study locks the image tower). SigLIP is
# measured on its own warm start (t = 10, b = -10), the state its cells begin from.
# Options: the first value of each setting's sweep (decl/sogclr/fastclip gamma 0.9, debiased
# tau_plus 0.1). Run from the repository root after `vlcontrast study --config
# configs/study/v2.yaml --stage prepare` (which restores the starts and the datasets).
set -e
for dataset in synthetic clipart; do
  out=results/loss-study-v2/gradient-bias/$dataset
  common="--data data/study-v2/$dataset/train --num-samples 2048 --batch-sizes 16,32,64,256,1024 --lock-image --device cpu"
  vlcontrast diagnose gradient-bias --checkpoint results/loss-study-v2/cells/starts/$dataset-k0 $common \
    --losses infonce,dcl,dclw,decl,debiased,sogclr,fastclip \
    --option decl.gamma=0.9 --option sogclr.gamma=0.9 --option fastclip.gamma=0.9 \
    --option debiased.tau_plus=0.1 --out $out
  vlcontrast diagnose gradient-bias --checkpoint runs/study-v2/starts/$dataset-k0-siglip $common \
    --losses siglip --out $out/siglip
  # debiased again at the tau_plus its tuning chose in 17 of 18 trainings (0.01); this folder
  # sorts after the first, so its row replaces the tau_plus 0.1 row in the bias-gain figures
  vlcontrast diagnose gradient-bias --checkpoint results/loss-study-v2/cells/starts/$dataset-k0 $common \
    --losses debiased --option debiased.tau_plus=0.01 --out $out/tuned-debiased
done
