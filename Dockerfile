# parle_hvd for GPU clusters: CUDA toolkit, the CUDA build of torch 2.13, OpenMPI, and
# Horovod 0.28.1 built with NCCL by the SAME script as the local setup (launch/setup.sh).
#
#   docker build -t parle_hvd .
#   docker run --gpus all --rm parle_hvd horovodrun -np 1 python train.py --config configs/fashion_parle.yaml
#
# torch 2.13 because torch 2.14's headers need C++20, which Horovod 0.28.1 does not build
# with. Not built in this project's CI (no Docker engine there): see README.
FROM nvidia/cuda:12.6.3-cudnn-devel-ubuntu24.04

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
ENV DEBIAN_FRONTEND=noninteractive

RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev build-essential cmake git \
        openmpi-bin libopenmpi-dev libnccl2 libnccl-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/parle_hvd
COPY . .

ENV HOROVOD_CUDA_HOME=/usr/local/cuda \
    HOROVOD_NCCL_LINK=SHARED \
    VENV=/opt/venv \
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
RUN PARLE_HVD_CUDA=1 TORCH_SPEC="$TORCH_SPEC" TORCH_INDEX_URL="$TORCH_INDEX_URL" \
    PARLE_HVD_CACHE=/tmp/hvd-cache launch/setup.sh && rm -rf /tmp/hvd-cache
ENV PATH=/opt/venv/bin:$PATH

# Last step: fail the image unless PyTorch, MPI, Gloo and NCCL are built in.
RUN horovodrun --check-build | tee /dev/stderr | grep -q "\[X\] NCCL"
