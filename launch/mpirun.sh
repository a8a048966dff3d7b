#!/usr/bin/env bash
# Train with mpirun (OpenMPI) across the hosts of a hostfile; Horovod uses its MPI controller.
#
#   HOSTFILE=hosts NP=8 launch/mpirun.sh [key.sub=value ...]
#   HOSTFILE=hosts NP=8 MAP_BY=ppr:1:socket BIND_TO=socket launch/mpirun.sh     # one rank per socket (CPU)
#   HOSTFILE=hosts NP=8 MAP_BY=ppr:4:node BIND_TO=none launch/mpirun.sh         # one rank per GPU, 4 GPUs/node
#
# hostfile lines: "node1 slots=4". The repository and venv must be at the same path on every
# host (a shared filesystem), and ssh to every host must work without a password.
#
# Environment (defaults): NP (2), HOSTFILE (none: this machine), CONFIG
# (configs/fashion_parle.yaml), VENV (.venv), MAP_BY (slot), BIND_TO (none), MPIRUN_ARGS
# (extra mpirun arguments, e.g. "--mca btl_tcp_if_include eth1"). Every variable named
# HOROVOD_*, NCCL_*, PARLE_*, OMP_*, CUDA_*, PYTHON* or LD_LIBRARY_PATH is exported to
# the remote ranks (-x), with PATH.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NP=${NP:-2}
CONFIG=${CONFIG:-configs/fashion_parle.yaml}
VENV=${VENV:-.venv}
MAP_BY=${MAP_BY:-slot}
BIND_TO=${BIND_TO:-none}
[[ -x $VENV/bin/python ]] || { echo "launch/mpirun.sh: no $VENV; run 'make setup' first" >&2; exit 2; }
args=(-np "$NP" --map-by "$MAP_BY" --bind-to "$BIND_TO" --tag-output -x PATH="$PWD/$VENV/bin:$PATH")
if [[ -n ${HOSTFILE:-} ]]; then
    [[ -r $HOSTFILE ]] || { echo "launch/mpirun.sh: cannot read HOSTFILE=$HOSTFILE" >&2; exit 2; }
    args+=(--hostfile "$HOSTFILE")
else
    args+=(--oversubscribe)
fi
[[ $(id -u) == 0 ]] && args+=(--allow-run-as-root)
while IFS='=' read -r name _; do
    case $name in HOROVOD_*|NCCL_*|PARLE_*|OMP_*|CUDA_*|PYTHON*|LD_LIBRARY_PATH) args+=(-x "$name") ;; esac
done < <(env)
# parle_hvd.launcher: a failed job ends with the failing rank's own line and its exit code;
# mpirun's banners go to a log file.
# shellcheck disable=SC2086  # MPIRUN_ARGS is a list of words on purpose
exec "$PWD/$VENV/bin/python" -m parle_hvd.launcher -- mpirun "${args[@]}" ${MPIRUN_ARGS:-} \
    "$PWD/$VENV/bin/python" train.py --config "$CONFIG" "$@"
