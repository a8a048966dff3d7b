#!/usr/bin/env bash
# Start TensorBoard on a run directory (or on runs/ for all of them) and print its address.
#
#   launch/tensorboard.sh [RUN_DIR]            PORT=6006 HOST=0.0.0.0 launch/tensorboard.sh runs/x
#
# On a cluster, forward the port: ssh -L 6006:localhost:6006 login-node
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
LOGDIR=${1:-runs}
PORT=${PORT:-6006}
HOST=${HOST:-localhost}
VENV=${VENV:-.venv}
[[ -d $LOGDIR ]] || { echo "launch/tensorboard.sh: no directory $LOGDIR" >&2; exit 2; }
echo "TensorBoard on http://$HOST:$PORT/ for $LOGDIR"
exec "$VENV/bin/tensorboard" --logdir "$LOGDIR" --port "$PORT" --host "$HOST"
