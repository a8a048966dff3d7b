#!/usr/bin/env bash
# Regenerate docs/RESULTS.md: every full benchmark, the comparison report, split data.
# One command (make results); about 35 minutes on 2 cores. Writes docs/results/*.txt (the
# raw `name: value` lines), reports/fashion_compare/ (the report and its PNG plots, copied
# to docs/results/), and docs/RESULTS.md from them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-.venv/bin/python}
PASSES=${PASSES:-8}
out=docs/results
mkdir -p "$out"
run() {  # name, command...
    local name=$1; shift
    echo "== $name: $*" | tee "$out/$name.txt"
    local t0=$SECONDS
    "$@" 2>&1 | tee -a "$out/$name.txt"
    echo "elapsed_seconds: $((SECONDS - t0))" | tee -a "$out/$name.txt"
}
run overhead "$PY" -m bench.overhead
run pipeline "$PY" -m bench.pipeline
run sync_cost "$PY" -m bench.sync_cost
run dpsgd_engines "$PY" -m bench.dpsgd_engines
run communication "$PY" -m bench.communication
m1=$(python3 -c "print(round(0.6*$PASSES,2))"); m2=$(python3 -c "print(round(0.85*$PASSES,2))")
run compare "$PY" -m parle_hvd.compare --config configs/fashion_parle.yaml \
    --algos parle,dpsgd,elastic,entropy,localsgd,diloco --np 2 --name fashion_compare \
    train.epochs="$PASSES" eval.every=0.5 "optim.milestones=[$m1,$m2]" dist.threads=1
run time_to_accuracy "$PY" -m bench.time_to_accuracy --passes "$PASSES" --rate 100mbit --reuse reports/fashion_compare/runs
run split_data "$PY" -m bench.split_data --passes "$PASSES"
"$PY" -m bench.data_scale --folder-check --md "$out/data_scale.md" --json "$out/data_scale.json"
cp reports/fashion_compare/*.png reports/fashion_compare/report.md "$out/"
"$PY" scripts/write_results.py "$out" docs/RESULTS.md
echo "wrote docs/RESULTS.md"
