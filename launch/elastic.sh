#!/usr/bin/env bash
# Train in Horovod elastic mode: ranks may die or be added while the job runs. A lost
# replica is dropped from the reference's average and the others go on from the last
# commit (the end of the last outer step); a rank on a new host starts at the current
# reference. Hosts come from launch/discover_hosts.sh (a hosts file, or SLURM's nodes).
#
#   PARLE_HVD_HOSTS_FILE=hosts.txt NP=4 MIN_NP=2 MAX_NP=8 launch/elastic.sh [key.sub=value ...]
#
# Environment (defaults): NP (2, ranks to start with), MIN_NP (2: below this the job waits
# for hosts, then fails after ELASTIC_TIMEOUT), MAX_NP (NP), ELASTIC_TIMEOUT (600 s),
# CONFIG (configs/fashion_parle.yaml), VENV (.venv), DISCOVERY (launch/discover_hosts.sh),
# HOROVODRUN_ARGS (extra horovodrun arguments, e.g. "--blacklist-cooldown-range 60 600").
# Elastic mode uses the Gloo controller. Horovod blacklists a host whose rank failed, so
# give each node its own line in the hosts file.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NP=${NP:-2}
MIN_NP=${MIN_NP:-2}
MAX_NP=${MAX_NP:-$NP}
CONFIG=${CONFIG:-configs/fashion_parle.yaml}
VENV=${VENV:-.venv}
DISCOVERY=${DISCOVERY:-$PWD/launch/discover_hosts.sh}
[[ -x $VENV/bin/python ]] || { echo "launch/elastic.sh: no $VENV; run 'make setup' first" >&2; exit 2; }
VENV=$(cd "$VENV" && pwd)
export PATH="$VENV/bin:$PATH"
# shellcheck disable=SC2086  # HOROVODRUN_ARGS is a list of words on purpose
exec horovodrun --gloo -np "$NP" --min-np "$MIN_NP" --max-np "$MAX_NP" \
    --host-discovery-script "$DISCOVERY" --elastic-timeout "${ELASTIC_TIMEOUT:-600}" ${HOROVODRUN_ARGS:-} \
    "$VENV/bin/python" train.py --config "$CONFIG" --elastic "$@"
