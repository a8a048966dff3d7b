#!/usr/bin/env bash
# Run "$@" on the core this rank is given: PARLE_PIN="0,0,1" puts ranks 0 and 1 on core 0
# and rank 2 on core 1 (replicas of unequal speed without injected sleeps; scripts/rq5_hetero.py).
#   horovodrun --gloo -np 3 -H localhost:3 tools/pin.sh python train.py ...
set -euo pipefail
r=${HOROVOD_RANK:-${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}}
IFS=, read -ra cores <<< "${PARLE_PIN:?set PARLE_PIN, e.g. 0,0,1}"
(( r < ${#cores[@]} )) || { echo "tools/pin.sh: rank $r has no core in PARLE_PIN=$PARLE_PIN" >&2; exit 2; }
exec taskset -c "${cores[$r]}" "$@"
