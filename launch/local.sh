#!/usr/bin/env bash
# Train with horovodrun (Gloo controller): on this machine by default (what `make run` uses),
# or across hosts with HOSTS.
#
#   launch/local.sh [key.sub=value ...]
#   NP=4 CONFIG=configs/fashion_dpsgd.yaml launch/local.sh train.epochs=3
#   NP=8 HOSTS=node1:4,node2:4 launch/local.sh            # needs passwordless ssh to the nodes
#
# Environment (defaults): NP (2), HOSTS (localhost:$NP), CONFIG (configs/fashion_parle.yaml),
# VENV (.venv), CONTROLLER (gloo|mpi, gloo), HOROVODRUN_ARGS (extra horovodrun arguments,
# e.g. "--ssh-identity-file KEY --network-interface eth1").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NP=${NP:-2}
HOSTS=${HOSTS:-localhost:$NP}
CONFIG=${CONFIG:-configs/fashion_parle.yaml}
VENV=${VENV:-.venv}
CONTROLLER=${CONTROLLER:-gloo}
[[ -x $VENV/bin/python ]] || { echo "launch/local.sh: no $VENV; run 'make setup' first" >&2; exit 2; }
export PATH="$PWD/$VENV/bin:$PATH"
# mpirun refuses root unless told; harmless otherwise.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# parle_hvd.launcher: a failed job ends with the failing rank's own line and its exit code
# (2 bad input, 3 divergence, 4 a silent rank); horovodrun's traceback goes to a log file.
# shellcheck disable=SC2086  # HOROVODRUN_ARGS is a list of words on purpose
exec "$PWD/$VENV/bin/python" -m parle_hvd.launcher -- horovodrun "--$CONTROLLER" -np "$NP" -H "$HOSTS" \
    ${HOROVODRUN_ARGS:-} "$PWD/$VENV/bin/python" train.py --config "$CONFIG" "$@"
