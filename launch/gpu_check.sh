#!/usr/bin/env bash
# The GPU path, checked in one command on a machine with one GPU (issue 14):
#   launch/gpu_check.sh                  # a CUDA torch already installed; no internet needed
#   GPU_CHECK_DRY=1 launch/gpu_check.sh  # the same steps on the CPU at tiny sizes (part of make test)
# Steps: (1) Horovod built with NCCL and Gloo against this machine's torch, by launch/setup.sh
# (PARLE_HVD_CUDA=1 PARLE_HVD_NO_VENV=1; offline, give it the sdist: PARLE_HVD_SDIST=path/to/
# horovod-0.28.1.tar.gz, or leave one in $PARLE_HVD_CACHE); (2) the unit tier with the device
# set to CUDA; (3) every algorithm's samples per second beside plain SGD (bench.device_throughput:
# LeNet, All-CNN-C, ResNet-18); (4) 2 ranks sharing the GPU under Gloo (NCCL refuses two ranks
# on one device), the sync on CUDA tensors, with the run's allreduce count checked; (5) the same
# under torchrun (dist.engine=torch, issue 15); (6) parle.overlap and parle.balance=time under
# torchrun, the inner loops timed by CUDA events on their own stream (issue 21): the syncs
# overlapped, the allreduce count unchanged, and n*L inner steps shared in every outer step;
# (7) bench.precision: samples/s of fp32, bf16 and compiled fp32/bf16 (issue 24); (8) 2 ranks
# under fp16 with a GradScaler and train.accum=2, then bf16 with channels_last: the allreduce
# count unchanged; (9) placement with one visible device per rank (SLURM's --gpus-per-task=1:
# CUDA_VISIBLE_DEVICES=0 for local rank 1 of 4 is cuda:0), and the one-line error without it.
# (With one GPU the two ranks share it, so the sync goes over Gloo, not NCCL: step 6 is a
# smoke of the path; the NCCL-stream effect InnerTimer avoids needs a GPU per rank.)
# Writes gpu_check.log, throughput.txt and the 2-rank run under $OUT (a temporary folder if unset).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DRY=${GPU_CHECK_DRY:-0}
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
step() { echo "== $(date -u +%H:%M:%S) $*"; }
fail() { echo "gpu_check: $*" >&2; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

if [[ $DRY == 1 ]]; then
    PY=${PY:-.venv/bin/python}
    DEVICE=cpu
    step "dry run on the CPU (GPU_CHECK_DRY=1), $PY"
else
    PY=${PY:-python}
    DEVICE=cuda
    "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
        || fail "no CUDA device visible to $PY (torch.cuda.is_available() is False)"
    step "1. Horovod with NCCL and Gloo against this machine's torch (launch/setup.sh)"
    PARLE_HVD_CUDA=1 PARLE_HVD_NO_VENV=1 PARLE_HVD_SKIP_APT=${PARLE_HVD_SKIP_APT:-1} PYTHON="$PY" \
        JOBS=${JOBS:-$(nproc)} launch/setup.sh
fi
"$PY" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
PY
HVD=$(dirname "$(command -v "$PY")")/horovodrun

step "2. unit tier, device $DEVICE"
if [[ $DRY == 1 ]]; then     # a few of each kind: the full tier already runs in make test
    PARLE_HVD_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -p no:cacheprovider tests/test_parle.py tests/test_models.py \
        -k "hand or special or balance or lenet" -m "not multirank and not integration and not cluster"
else
    PARLE_HVD_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -p no:cacheprovider -m "not multirank and not integration and not cluster"
fi

step "3. samples per second of every algorithm beside plain SGD, device $DEVICE"
"$PY" -m bench.device_throughput --device "$DEVICE" $([[ $DRY == 1 ]] && echo --tiny) | tee "$OUT/throughput.txt"

two_ranks() {   # run dir, launcher...: 2 ranks sharing the device, then the counts checked
    local run=$1; shift
    rm -rf "$run"
    "$@" "$PY" train.py --config configs/fashion_parle.yaml dist.device="$DEVICE" \
        dist.share_device=true data.train_limit=2560 data.test_limit=500 parle.sync_period=5 train.batch_size=64 \
        train.epochs=1 eval.every=1 run.progress=lines dist.threads=1 run.dir="$run" ${EXTRA:-}
    "$PY" - "$run" "$DEVICE" <<'PY'
import json, sys
s = json.load(open(sys.argv[1] + "/summary.json"))
want = s["outer_steps"] + 1 + s["evaluations"]
assert s["world_size"] == 2 and s["device"].startswith(sys.argv[2]), s["device"]
assert s["allreduce_calls"] == want, (s["allreduce_calls"], want)
print(f"two ranks on {s['device']} ({s['engine']} {s['controller']}): {s['outer_steps']} outer steps, "
      f"{s['allreduce_calls']} allreduces (= K + 1 + E), test accuracy {s['test_accuracy']:.4f}")
PY
}
step "4. 2 ranks sharing the device under Gloo: the sync on $DEVICE tensors"
two_ranks "$OUT/two_ranks" "$HVD" --gloo -np 2 -H localhost:2

step "5. the same under torchrun (dist.engine=torch; Gloo carries the $DEVICE tensors of ranks sharing one GPU)"
OMP_NUM_THREADS=1 two_ranks "$OUT/two_ranks_torch" "$(dirname "$(command -v "$PY")")/torchrun" --standalone \
    --nproc-per-node 2 --no-python
step "6. parle.overlap and parle.balance=time under torchrun, inner loops timed on their own stream"
EXTRA="parle.overlap=true parle.balance=time run.log_every=1" OMP_NUM_THREADS=1 two_ranks "$OUT/overlap_balance" \
    "$(dirname "$(command -v "$PY")")/torchrun" --standalone --nproc-per-node 2 --no-python
"$PY" - "$OUT/overlap_balance" <<'PY'
import json, sys
d = sys.argv[1]
s = json.load(open(d + "/summary.json"))
assert s["overlap"] is True and s["balance"] == "time" and s["overlapped_syncs"] >= 1, s
rows = [json.loads(l) for l in open(d + "/metrics.jsonl")]
split = [(r["balance/inner_steps/0"], r["balance/inner_steps/1"]) for r in rows if "balance/inner_steps/0" in r]
secs = [(r["balance/step_seconds/0"], r["balance/step_seconds/1"]) for r in rows if "balance/step_seconds/0" in r]
assert split and all(a + b == 2 * s["inner_steps"] // s["outer_steps"] for a, b in split), split
print(f"overlap and balance: {s['overlapped_syncs']} of {s['outer_steps']} syncs overlapped, "
      f"{s['allreduce_calls']} allreduces (= K + 1 + E), last split {split[-1]}, "
      f"seconds per inner step {tuple(round(x, 4) for x in secs[-1])}")
PY

step "7. mixed precision and torch.compile: samples/s beside fp32 (bench.precision), device $DEVICE"
if [[ $DRY == 1 ]]; then     # LeNet, tiny, no compile: the compile path has its own test in make test
    "$PY" -m bench.precision --part speed --models lenet --rounds 1 --outer 2 --bs 32 --L 2 --variants fp32,bf16 \
        | tee "$OUT/precision.txt"
else
    "$PY" -m bench.precision --part speed | tee "$OUT/precision.txt"
fi

step "8. 2 ranks under fp16 (GradScaler) with train.accum=2, then bf16 with channels_last"
EXTRA="train.precision=fp16 train.accum=2" two_ranks "$OUT/fp16_accum" "$HVD" --gloo -np 2 -H localhost:2
if [[ $DRY != 1 ]]; then     # (the dry run: tests/test_speed.py covers bf16 on 2 ranks)
    EXTRA="train.precision=bf16 train.channels_last=true" two_ranks "$OUT/bf16_cl" "$HVD" --gloo -np 2 -H localhost:2
fi

step "9. placement with one visible device per rank"
if [[ $DRY == 1 ]]; then     # no GPU: the placement rules with mocked device counts
    "$PY" -m pytest -q -p no:cacheprovider tests/test_placement.py
else                         # local rank 1 of 4, bound to one GPU: cuda:0; unbound with one GPU: refused
    run="$OUT/placement"
    rm -rf "$run"
    CUDA_VISIBLE_DEVICES=0 OMPI_COMM_WORLD_LOCAL_RANK=1 OMPI_COMM_WORLD_LOCAL_SIZE=4 "$PY" train.py \
        --config configs/fashion_parle.yaml dist.backend=none dist.device=cuda data.train_limit=640 \
        data.test_limit=200 train.epochs=1 run.progress=lines run.dir="$run"
    "$PY" -c "import json,sys; d=json.load(open('$run/summary.json'))['device']; print('bound rank on', d); sys.exit(d != 'cuda:0')"
    if env -u CUDA_VISIBLE_DEVICES OMPI_COMM_WORLD_LOCAL_RANK=1 OMPI_COMM_WORLD_LOCAL_SIZE=4 "$PY" train.py \
        --config configs/fashion_parle.yaml dist.backend=none dist.device=cuda data.train_limit=640 \
        run.dir="$OUT/placement_refused" 2> "$OUT/placement_refused.err"; then
        [[ $("$PY" -c "import torch; print(torch.cuda.device_count())") -ge 4 ]] || fail "4 ranks on fewer GPUs were not refused"
    else
        echo "unbound: $(cat "$OUT/placement_refused.err")"
    fi
fi
step "done: log, throughput.txt, precision.txt and the 2-rank runs in $OUT"
