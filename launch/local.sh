#!/usr/bin/env bash
# Train on this machine with horovodrun (Gloo controller), one rank per replica.
#
#   launch/local.sh [key.sub=value ...]
#   NP=4 CONFIG=configs/fashion_parle.yaml launch/local.sh train.epochs=3
#
# Environment: NP (ranks, default 2), CONFIG (default configs/fashion_parle.yaml),
# VENV (default .venv), CONTROLLER (gloo|mpi, default gloo).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NP=${NP:-2}
CONFIG=${CONFIG:-configs/fashion_parle.yaml}
VENV=${VENV:-.venv}
CONTROLLER=${CONTROLLER:-gloo}
export PATH="$PWD/$VENV/bin:$PATH"
# mpirun refuses root unless told; harmless otherwise.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec horovodrun "--$CONTROLLER" -np "$NP" -H "localhost:$NP" \
    python train.py --config "$CONFIG" "$@"
