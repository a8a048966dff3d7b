#!/usr/bin/env bash
# Every run behind docs/CLAIMS.md (the paper's RQ1-RQ5), in order of importance, then the page.
# Resumable: every step caches its finished runs, so a killed sweep goes on where it stopped
# and a complete one only rewrites the page (seconds). About 3 hours on 2 cores; needs root
# for the throttled hosts of RQ1 and RQ5; RQ5's timings want a machine doing nothing else. Run it in the background:
#   mkdir -p reports && nohup scripts/claims_sweep.sh > reports/claims_sweep.log 2>&1 &
#   make claims            (the same, in the foreground)
# ONLY="rq1 rq2_full" runs a subset; the page is written from whatever reports exist.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-.venv/bin/python}
SEEDS=${SEEDS:-3}
ONLY=${ONLY:-"select rq1 rq2_full rq4 rq2_small rq3 rq2_small_aug rq5"}
mkdir -p reports
want() { [[ " $ONLY " == *" $1 "* ]]; }
step() { echo "== $(date -u +%H:%M:%S) $*"; }
# The 10-pass budget of the full-data runs: the preset's schedule (x0.2 at 0.6 and 0.85 of the run).
FULL="train.epochs=10 optim.milestones=[6,8.5] eval.every=1 data.val_frac=0.1 dist.threads=1"

if want select; then
    step "Parle's initialisation, chosen on the validation split (small-data regime)"
    "$PY" scripts/select_init.py --seeds "$SEEDS"
fi
INIT=independent                    # PARLE.md's default until the selection has run
if [[ -f reports/select_init/choice.json ]]; then
    INIT=$("$PY" -c "import json; print(json.load(open('reports/select_init/choice.json'))['choice'])")
fi
step "parle.init=$INIT"
if want rq1; then
    step "RQ1 speed: parle vs dpsgd (tuned) on loopback, 100 Mbit, 10 Mbit"
    "$PY" scripts/rq1_speed.py --seeds "$SEEDS" --passes 4 --parle-passes 8 --parle-init "$INIT" --out reports/rq1
fi
if want rq2_full; then
    step "RQ2 generalization, all of Fashion-MNIST, 10 passes"
    # shellcheck disable=SC2086
    "$PY" -m parle_hvd.compare --config configs/fashion_parle.yaml \
        --algos parle,sgd,dpsgd,elastic,entropy,localsgd,diloco --np 2 --seeds "$SEEDS" --name rq2_full $FULL parle.init="$INIT"
fi
if want rq4; then
    step "RQ4 flat minima: flatness of rq2_full's final models"
    "$PY" scripts/flatness_sweep.py reports/rq2_full --algos parle,sgd,dpsgd,localsgd --out reports/rq4/flatness.jsonl
fi
if want rq2_small; then
    step "RQ2 generalization, 6000 images, no augmentation"
    SEEDS=$SEEDS PY=$PY scripts/rq2_small_sweep.sh parle.init="$INIT"
fi
if want rq3; then
    step "RQ3 split data: parle n=3 vs sgd, each replica 1/2 and 1/3 of the data"
    for frac in 0.5 0.3333333333333333; do
        name=rq3_frac$([[ $frac == 0.5 ]] && echo half || echo third)
        # shellcheck disable=SC2086
        "$PY" -m parle_hvd.compare --config configs/fashion_parle.yaml --algos parle,sgd --np 3 --seeds "$SEEDS" \
            --name "$name" $FULL data.split=frac data.frac="$frac" parle.init="$INIT"
    done
fi
if want rq2_small_aug; then
    step "RQ2 generalization, 6000 images, with augmentation"
    SEEDS=$SEEDS PY=$PY AUGMENT=true scripts/rq2_small_sweep.sh parle.init="$INIT"
fi
if want rq5; then
    step "RQ5 heterogeneous systems: overlapped sync on 3 links; 3 ranks of unequal speed, balance off/on"
    "$PY" scripts/rq5_overlap.py --seeds "$SEEDS" --out reports/rq5/overlap
    "$PY" scripts/rq5_hetero.py --out reports/rq5/hetero
fi
step "writing docs/CLAIMS.md"
"$PY" scripts/write_claims.py --reports reports --out docs/CLAIMS.md
step "done"
