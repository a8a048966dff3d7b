#!/usr/bin/env bash
# Train with torchrun (dist.engine=torch: torch.distributed, Gloo on CPUs, NCCL on GPUs).
# Needs no Horovod: PARLE_HVD_ENGINE=torch make setup is enough.
#
#   launch/torchrun.sh [key.sub=value ...]                              # NP ranks on this machine
#   NP=4 CONFIG=configs/fashion_dpsgd.yaml launch/torchrun.sh train.epochs=3
#   NNODES=2 NP=4 RDZV=node1:29400 launch/torchrun.sh                   # run on each of the 2 nodes
#   ELASTIC=1 NNODES=1:4 MAX_RESTARTS=3 RDZV=node1:29400 launch/torchrun.sh
#       # elastic: 1 to 4 nodes; when a worker fails or a node joins or leaves, torchrun
#       # restarts every worker and the run resumes from its newest complete checkpoint
#       # (docs/robustness.md, "Elastic mode under torchrun")
#
# Environment (defaults): NP (2, ranks per node), NNODES (1; MIN:MAX for elastic), RDZV
# (host:port of the rendezvous; unset: --standalone, this machine only), RDZV_ID (parle,
# the same on every node), MAX_RESTARTS (0; 3 with ELASTIC=1), ELASTIC (0|1: adds
# dist.elastic=true), CONFIG (configs/fashion_parle.yaml), VENV (.venv), TORCHRUN_ARGS
# (extra torchrun arguments).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NP=${NP:-2}
NNODES=${NNODES:-1}
CONFIG=${CONFIG:-configs/fashion_parle.yaml}
VENV=${VENV:-.venv}
ELASTIC=${ELASTIC:-0}
MAX_RESTARTS=${MAX_RESTARTS:-$([[ $ELASTIC == 1 ]] && echo 3 || echo 0)}
[[ -x $VENV/bin/torchrun ]] || { echo "launch/torchrun.sh: no $VENV/bin/torchrun; run 'make setup' first" >&2; exit 2; }
if [[ -n ${RDZV:-} ]]; then
    rdzv=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV" --rdzv-id "${RDZV_ID:-parle}")
elif [[ $NNODES == 1 ]]; then
    rdzv=(--standalone)
else
    echo "launch/torchrun.sh: NNODES=$NNODES needs RDZV=host:port (the rendezvous every node reaches)" >&2; exit 2
fi
extra=()
[[ $ELASTIC == 1 ]] && extra=(dist.elastic=true)
# The trainer sets its own threads per rank (dist.threads); this only silences torchrun's notice.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Every line tagged with its global rank, "[1]:..." (what parle_hvd.launcher reads; --tee 3 turns it on)
export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=${TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE:-'[${rank}]:'}
export PATH="$PWD/$VENV/bin:$PATH"
# parle_hvd.launcher: a failed job ends with the failing rank's own line and its exit code.
# shellcheck disable=SC2086  # TORCHRUN_ARGS is a list of words on purpose
exec "$PWD/$VENV/bin/python" -m parle_hvd.launcher -- "$PWD/$VENV/bin/torchrun" "${rdzv[@]}" \
    --nproc-per-node "$NP" --max-restarts "$MAX_RESTARTS" --tee 3 ${TORCHRUN_ARGS:-} --no-python \
    "$PWD/$VENV/bin/python" train.py --config "$CONFIG" "${extra[@]}" "$@"
