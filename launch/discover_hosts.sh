#!/usr/bin/env bash
# Horovod elastic host discovery (launch/elastic.sh passes it as --host-discovery-script):
# prints the hosts that may run ranks now, one "host:slots" per line. horovodrun runs it
# every few seconds; a host that appears gets new ranks (they start at the reference), one
# that disappears loses its ranks at the next outer step.
#
# Sources, first found wins:
#   PARLE_HVD_HOSTS_FILE   a file of "host:slots" lines (edit it to grow or shrink the job;
#                          blank lines and #-comments ignored)
#   SLURM_JOB_NODELIST     the allocation's nodes, SLURM_NTASKS_PER_NODE (1) slots each
#   otherwise              localhost with PARLE_HVD_SLOTS (2) slots
set -euo pipefail
if [[ -n ${PARLE_HVD_HOSTS_FILE:-} ]]; then
    [[ -r $PARLE_HVD_HOSTS_FILE ]] || { echo "discover_hosts.sh: cannot read $PARLE_HVD_HOSTS_FILE" >&2; exit 1; }
    sed -e 's/#.*//' -e 's/[[:space:]]//g' "$PARLE_HVD_HOSTS_FILE" | grep -E '^[^:]+:[0-9]+$' || true
elif [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
    for h in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
        echo "$h:${SLURM_NTASKS_PER_NODE:-1}"
    done
else
    echo "localhost:${PARLE_HVD_SLOTS:-2}"
fi
