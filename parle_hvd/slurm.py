"""What a SLURM job step says about its layout, read the way srun means it: the step's own
nodes and tasks (a step may run on part of the allocation: ``srun -r``, ``-w``, concurrent
steps), and tasks per node as SLURM compresses them (``2(x3),1`` is 2, 2, 2, 1). Used by
torchdist.py to form the world under srun, and by launch/slurm.sbatch (one torchrun per
node, each with its own node's task count):

    python -m parle_hvd.slurm tasks-per-node "$SLURM_TASKS_PER_NODE"   # 2(x3),1 -> 2,2,2,1
    python -m parle_hvd.slurm first-node "$SLURM_JOB_NODELIST"          # the first node's address

Imports nothing but the standard library (the batch script calls it before any training).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Mapping, Optional


class SlurmError(ValueError):
    """SLURM's variables or scontrol do not say what is needed (one line for the user)."""


def expand_tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed tasks-per-node list, expanded: '2(x3),1' -> [2, 2, 2, 1]."""
    out = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise SlurmError(f"cannot read SLURM's tasks per node {spec!r} (expected e.g. 2(x3),1)")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _first(env: Mapping[str, str], *names: str) -> Optional[str]:
    return next((env[n] for n in names if env.get(n)), None)


def step_layout(env: Mapping[str, str] = os.environ) -> dict:
    """This task's place in its step: rank, size, nodes, node (this node's index in the
    step), local_rank, local_size (the tasks on this node), nodelist (the step's)."""
    size = int(_first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") or 1)
    nodes = int(_first(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1)
    node = int(env.get("SLURM_NODEID", 0))
    spec = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if spec:
        counts = expand_tasks_per_node(spec)
        local_size = counts[node] if node < len(counts) else counts[-1]
    else:
        local_size = int(env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0] or -(-size // nodes))
    return dict(rank=int(env.get("SLURM_PROCID", 0)), size=size, nodes=nodes, node=node,
                local_rank=int(env.get("SLURM_LOCALID", 0)), local_size=local_size,
                nodelist=_first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") or "")


def first_node_addr(nodelist: str) -> str:
    """The address of the first node of ``nodelist`` as SLURM reaches it (its NodeAddr: a
    node's name need not resolve), through scontrol."""
    try:
        first = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               timeout=30, check=True).stdout.split()[0]
        node = subprocess.run(["scontrol", "show", "node", first], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError, IndexError):
        raise SlurmError(f"cannot read the first node of {nodelist!r} (scontrol show hostnames)") from None
    return next((f.split("=", 1)[1] for f in node.split() if f.startswith("NodeAddr=")), first)


def main(argv: list) -> int:
    try:
        if len(argv) == 2 and argv[0] == "tasks-per-node":
            print(",".join(map(str, expand_tasks_per_node(argv[1]))))
        elif len(argv) == 2 and argv[0] == "first-node":
            print(first_node_addr(argv[1]))
        else:
            print("usage: python -m parle_hvd.slurm tasks-per-node SPEC | first-node NODELIST", file=sys.stderr)
            return 2
    except SlurmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
