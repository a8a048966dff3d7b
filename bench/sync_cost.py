"""Cost of one sync: seconds per fused allreduce of a model's weights (parle_hvd's way,
one flat buffer, one allreduce) through Horovod (MPI controller) and through
torch.distributed (Gloo, dist.engine=torch), vs the same bytes through one hvd.allreduce
per tensor, vs an mpi4py Allreduce on one numpy buffer. LeNet, All-CNN-C and ResNet-18
sizes, 2 ranks under mpirun (mpi4py shares Horovod's MPI), the four ways alternating in
the same processes; each figure is the median of 5 rounds. Without Horovod (a
PARLE_HVD_ENGINE=torch setup) only the torch.distributed and mpi4py rows are measured.

    python -m bench.sync_cost [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess

from bench.common import MPI_ENV, PY, ROOT, VENV_BIN, emit


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    reps = 5 if a.quick else 20
    env = {**os.environ, **MPI_ENV, "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
           "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", "-x", "PYTHONPATH", "-x", "PATH",
           PY, str(ROOT / "bench/sync_cost_ranks.py"), str(reps)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"sync_cost ranks failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    for model, v in json.loads(line[7:]).items():
        emit(f"sync_{model}_mbytes", v["bytes"] / 1e6)
        emit(f"sync_{model}_tensors", v["tensors"])
        for k in ("fused", "torch_fused", "per_tensor", "mpi4py"):
            if k in v:
                emit(f"sync_{model}_{k}_ms", v[k] * 1e3)
        if "fused" in v:
            emit(f"sync_{model}_per_tensor_over_fused", v["per_tensor"] / v["fused"])
            emit(f"sync_{model}_torch_over_horovod", v["torch_fused"] / v["fused"])
            emit(f"sync_{model}_mpi4py_over_fused", v["mpi4py"] / v["fused"])
        else:
            emit(f"sync_{model}_mpi4py_over_torch", v["mpi4py"] / v["torch_fused"])


if __name__ == "__main__":
    main()
