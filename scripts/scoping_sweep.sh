#!/usr/bin/env bash
# parle.scoping: PARLE.md's number (0.5) against auto, on the preset's budget (20 passes of
# Fashion-MNIST, 2 replicas), 3 seeds each, a 10 % validation split held out. The variant is
# chosen on the validation error; the test error is only reported. Resumable: finished runs
# are cached by parle_hvd.compare. About 40 minutes on 2 cores.
#   scripts/scoping_sweep.sh            (writes reports/scoping_number, reports/scoping_auto)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-.venv/bin/python}
SEEDS=${SEEDS:-3}
common=(--config configs/fashion_parle.yaml --algos parle --np 2 --seeds "$SEEDS" data.val_frac=0.1 dist.threads=1)
"$PY" -m parle_hvd.compare "${common[@]}" --name scoping_number parle.scoping=0.5
"$PY" -m parle_hvd.compare "${common[@]}" --name scoping_auto parle.scoping=auto
