#!/usr/bin/env bash
# One-command, idempotent setup for parle_hvd.
#
#   launch/setup.sh                 # or: make setup
#   PARLE_HVD_ENGINE=torch make setup   # no Horovod: torch.distributed only (seconds, any torch)
#
# Does, in order:
#   1. apt: OpenMPI and the embedded Fashion-MNIST (skipped with a message when there is
#      no apt or no root: then MPI, e.g. `module load openmpi`, must already be on PATH);
#   2. a venv at $VENV (default .venv) with torch ($TORCH_SPEC, default torch==2.13.0),
#      requirements.txt, mpi4py built against the same MPI, and this package (editable);
#   3. Horovod $HOROVOD_VERSION built from the PyPI sdist with the patches it needs for
#      current PyTorch (C++17, CMake 4 policy), with the PyTorch, Gloo and MPI controllers
#      (and NCCL when PARLE_HVD_CUDA=1). The built wheel is cached in $PARLE_HVD_CACHE
#      (default ~/.cache/parle_hvd), keyed by Horovod, torch and Python versions, so a
#      second setup on the same machine takes seconds;
#   4. `horovodrun --check-build`, failing loudly unless PyTorch, MPI and Gloo are built.
#   With PARLE_HVD_ENGINE=torch, steps 3 and 4 are skipped: training runs on torch.distributed
#   (dist.engine=torch; torchrun, launch/torchrun.sh), which any torch has, newer than
#   2.13 too (TORCH_SPEC=torch, or a venv whose torch is already installed; Horovod 0.28.1
#   does not build against torch 2.14's headers). The check is then a 2-rank Gloo allreduce.
#
# Environment:
#   VENV=.venv  PYTHON=python3  TORCH_SPEC="torch==2.13.0"  TORCH_INDEX_URL=
#   PARLE_HVD_ENGINE=horovod|torch (torch: skip Horovod)
#   PARLE_HVD_CUDA=0|1   (1: build Horovod with NCCL; needs nvcc and a CUDA torch)
#   PARLE_HVD_SKIP_APT=1 (never touch apt)   PARLE_HVD_CACHE=~/.cache/parle_hvd
#   PARLE_HVD_NO_VENV=1  (install into the current interpreter, e.g. a conda env)
#   PARLE_HVD_SDIST=path/horovod-0.28.1.tar.gz (build from this sdist, no download; default:
#                        $PARLE_HVD_CACHE/horovod-<version>.tar.gz when present, kept there by any build)
#   PARLE_HVD_TEST_DEPS=1 (also apt-get what the test suite's SLURM and two-host tests use)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$here"

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}
PARLE_HVD_CUDA=${PARLE_HVD_CUDA:-0}
CACHE=${PARLE_HVD_CACHE:-$HOME/.cache/parle_hvd}
JOBS=${MAX_JOBS:-$(nproc)}

say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------- 1. system packages
apt_pkgs=(openmpi-bin libopenmpi-dev)          # required
apt_optional=(dataset-fashion-mnist)             # the embedded default data; not on every distro
# The test suite's real SLURM cluster and network-namespace hosts (make test sets this).
[[ ${PARLE_HVD_TEST_DEPS:-0} == 1 ]] && apt_pkgs+=(slurm-wlm openssh-server openssh-client iproute2 util-linux procps)
if [[ ${PARLE_HVD_SKIP_APT:-0} == 1 ]]; then
    say "PARLE_HVD_SKIP_APT=1: not touching apt; mpicc/mpirun must be on PATH"
elif ! command -v apt-get >/dev/null || [[ $(id -u) != 0 ]]; then
    say "no apt-get or not root: skipping system packages; needs mpicc/mpirun on PATH (e.g. 'module load openmpi') and Fashion-MNIST IDX files (data.dir)"
else
    missing=(); missing_opt=()
    installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
    for p in "${apt_pkgs[@]}"; do installed "$p" || missing+=("$p"); done
    for p in "${apt_optional[@]}"; do installed "$p" || missing_opt+=("$p"); done
    if ((${#missing[@]} + ${#missing_opt[@]})); then
        export DEBIAN_FRONTEND=noninteractive
        say "apt-get install ${missing[*]} ${missing_opt[*]}"
        apt-get update -qq
        ((${#missing[@]})) && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
        if ((${#missing_opt[@]})); then
            apt-get install -y -qq --no-install-recommends "${missing_opt[@]}" >/dev/null \
                || say "could not install ${missing_opt[*]}: point data.dir at the Fashion-MNIST IDX files"
        fi
    else
        say "system packages present"
    fi
fi
command -v mpicc >/dev/null || die "mpicc not found: install OpenMPI (apt-get install libopenmpi-dev openmpi-bin) or 'module load openmpi'"

# ---------------------------------------------------------------- 2. venv
if [[ ${PARLE_HVD_NO_VENV:-0} == 1 ]]; then
    py=$(command -v "$PYTHON")
else
    if [[ ! -x $VENV/bin/python ]]; then
        say "creating venv $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
    [[ $VENV == /* ]] || VENV=$here/$VENV
    py=$VENV/bin/python
fi
# (the grep drops pip's notes about find-links/index locations absent on this machine)
pip() { "$py" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

pip install "pip>=23" "setuptools<81" wheel >/dev/null  # horovodrun imports distutils/pkg_resources; no --upgrade: offline-safe when satisfied
# torch first, alone: every later install sees it satisfied and never pulls a CUDA build.
torch_args=("$TORCH_SPEC")
[[ -n ${TORCH_INDEX_URL:-} ]] && torch_args+=(--index-url "$TORCH_INDEX_URL")
if ! "$py" -c "import torch" 2>/dev/null; then
    say "pip install ${torch_args[*]}"
    pip install "${torch_args[@]}"
fi
torch_ver=$("$py" -c "import torch; print(torch.__version__)")
py_ver=$("$py" -c "import sys; print('%d.%d' % sys.version_info[:2])")
say "torch $torch_ver, python $py_ver"

# requirements.txt, with torch pinned to what is installed so nothing can replace it.
pin=$(mktemp); trap 'rm -f "$pin"' EXIT
echo "torch==$torch_ver" > "$pin"
MPICC=mpicc pip install -c "$pin" -r requirements.txt
pip install -c "$pin" --no-deps --no-build-isolation -e .

# ---------------------------------------------------------------- 3. Horovod
# The engine this venv was set up for is remembered: `make test` after
# `PARLE_HVD_ENGINE=torch make setup` does not build Horovod behind the user's back.
ENGINE=${PARLE_HVD_ENGINE:-$(cat "$VENV/.parle_hvd_engine" 2>/dev/null || echo horovod)}
[[ $ENGINE == horovod || $ENGINE == torch ]] || die "PARLE_HVD_ENGINE must be horovod or torch, not $ENGINE"
if [[ $ENGINE == torch ]]; then
    # torch.distributed only: no build. The check: two processes allreduce through Gloo.
    check=$(mktemp -d)/dist_check.py      # a file: spawned processes re-import it
    cat > "$check" <<'PY'
import datetime, os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
def work(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.tensor([rank + 1.0]); dist.all_reduce(t); assert t.item() == 3.0, t
    dist.destroy_process_group()
if __name__ == "__main__":
    import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.start_processes(work, args=(port,), nprocs=2, start_method="spawn")
    print(f"torch {torch.__version__}: torch.distributed Gloo allreduce on 2 processes OK "
          f"(NCCL {'available' if dist.is_nccl_available() else 'not built'})")
PY
    out=$("$py" "$check" 2>&1) || { echo "$out" >&2; die "torch.distributed check failed: this torch cannot run dist.engine=torch"; }
    rm -rf "$(dirname "$check")"
    say "$out"
    "$py" -c "import horovod" 2>/dev/null && say "note: Horovod is installed in this venv too; PARLE_HVD_ENGINE=torch selects torch.distributed at run time"
    [[ ${PARLE_HVD_NO_VENV:-0} == 1 ]] || echo torch > "$VENV/.parle_hvd_engine"   # a later `make test` keeps it
    say "done: $(basename "$py") in $(dirname "$py"), torch $torch_ver, engine torch (no Horovod)"
    exit 0
fi
hvd_ok() { "$py" - <<'PY' 2>/dev/null
import horovod.torch as hvd
import sys
sys.exit(0 if (hvd.mpi_built() and hvd.gloo_built()) else 1)
PY
}
want_nccl=0
if [[ $PARLE_HVD_CUDA == 1 ]]; then
    want_nccl=1
    command -v nvcc >/dev/null || [[ -x ${HOROVOD_CUDA_HOME:-/usr/local/cuda}/bin/nvcc ]] \
        || die "PARLE_HVD_CUDA=1 needs the CUDA toolkit (nvcc) for Horovod's NCCL build"
    "$py" -c "import torch,sys; sys.exit(torch.version.cuda is None)" \
        || die "PARLE_HVD_CUDA=1 needs a CUDA build of torch: set TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cu126)"
fi
key="horovod-${HOROVOD_VERSION}-torch-${torch_ver//+/_}-py${py_ver}-nccl${want_nccl}"
wheel_dir=$CACHE/$key
if hvd_ok && "$py" -c "import horovod,sys; sys.exit(horovod.__version__!='$HOROVOD_VERSION')"; then
    say "Horovod $HOROVOD_VERSION already installed"
else
    if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
        say "building Horovod $HOROVOD_VERSION from sdist (takes ~7 min on 2 cores); cache: $wheel_dir"
        work=$(mktemp -d)
        (
            cd "$work"
            sdist=${PARLE_HVD_SDIST:-$CACHE/horovod-$HOROVOD_VERSION.tar.gz}
            if [[ -f $sdist ]]; then
                cp "$sdist" "horovod-$HOROVOD_VERSION.tar.gz"          # offline: the sdist travels with the job
            else
                pip download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d .
                mkdir -p "$CACHE" && cp "horovod-$HOROVOD_VERSION.tar.gz" "$CACHE/" || true   # for an offline machine later
            fi
            tar xzf "horovod-$HOROVOD_VERSION.tar.gz"
            cd "horovod-$HOROVOD_VERSION"
            # Current torch headers need C++17; gloo must match or the link fails.
            sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/; s/-std=c++14/-std=c++17/g' CMakeLists.txt horovod/torch/CMakeLists.txt
            sed -i 's/-std=c++11/-std=c++17/g' third_party/gloo/CMakeLists.txt
            grep -q "CMAKE_CXX_STANDARD 17\|c++17" CMakeLists.txt || { echo "C++17 patch did not apply" >&2; exit 1; }
            grep -q "c++17" third_party/gloo/CMakeLists.txt || { echo "gloo C++17 patch did not apply" >&2; exit 1; }
            export CMAKE_POLICY_VERSION_MINIMUM=3.5   # CMake 4 rejects gloo's cmake_minimum_required
            export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
            export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
            [[ $want_nccl == 1 ]] && export HOROVOD_GPU_OPERATIONS=NCCL
            export MAKEFLAGS="-j$JOBS"
            "$py" -m pip wheel --no-deps --no-build-isolation -w dist . >build.log 2>&1 \
                || { tail -40 build.log >&2; exit 1; }
            mkdir -p "$wheel_dir"
            cp dist/horovod-*.whl "$wheel_dir/"
        ) || { rm -rf "$work"; die "Horovod build failed (log tail above)"; }
        rm -rf "$work"
    else
        say "using cached Horovod wheel $wheel_dir"
    fi
    pip install --force-reinstall --no-deps "$wheel_dir"/horovod-*.whl
    pip install -c "$pin" cloudpickle psutil pyyaml packaging  # horovod's runtime deps, torch untouched
fi

# ---------------------------------------------------------------- 4. check
bin=$(dirname "$py")
out=$("$bin/horovodrun" --check-build 2>&1) || { echo "$out" >&2; die "horovodrun --check-build failed"; }
echo "$out" | sed 's/^/[setup]   /'
for f in PyTorch MPI Gloo; do
    echo "$out" | grep -q "\[X\] $f" || die "horovodrun --check-build does not list [X] $f"
done
[[ $want_nccl == 1 ]] && { echo "$out" | grep -q "\[X\] NCCL" || die "NCCL requested but not built"; }
say "done: $(basename "$py") in $bin, Horovod $HOROVOD_VERSION, torch $torch_ver"
