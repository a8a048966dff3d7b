#!/usr/bin/env bash
# The paper's RQ2 (generalization), small-data regime: 6000 Fashion-MNIST training images
# (data.train_limit; 10 % of them held out for validation), the preset's 20 passes, every
# algorithm, 3 seeds. AUGMENT=true adds flip + pad-and-crop. Resumable (compare caches runs).
#   scripts/rq2_small_sweep.sh                 (reports/rq2_small)
#   AUGMENT=true scripts/rq2_small_sweep.sh    (reports/rq2_small_aug)
# Extra arguments are more key=value overrides (scripts/claims_sweep.sh passes parle.init).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-.venv/bin/python}
AUGMENT=${AUGMENT:-false}
name=rq2_small$([[ $AUGMENT == true ]] && echo _aug || true)
"$PY" -m parle_hvd.compare --config configs/fashion_parle.yaml --algos parle,sgd,dpsgd,elastic,entropy,localsgd,diloco \
    --np 2 --seeds "${SEEDS:-3}" --name "$name" data.train_limit=6000 data.val_frac=0.1 data.augment="$AUGMENT" \
    dist.threads=1 "$@"
