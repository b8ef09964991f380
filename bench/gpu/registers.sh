#!/usr/bin/env bash
# Registers, spills and shared memory of the attention kernels on an NVIDIA card, without a GPU:
# what decides how many units a GPU keeps busy (its register file is shared among the units it
# holds, and a kernel that needs more than 255 registers a unit spills to memory), which no CPU
# test can see. The kernels' CUDA C++ is made as the cuda runtime makes it (the
# `cuda_kernels` example: each kernel's CubeCL definition, built through a wgpu adapter —
# lavapipe does — and compiled to C++ by cubecl's CUDA compiler), then compiled by NVIDIA's
# NVRTC and `ptxas -v` for ARCH, as cubecl compiles it on the card, and `cuobjdump` shows the
# machine code of each kernel's innermost loops (multiply-adds against shared-memory loads):
#
#   bench/gpu/registers.sh [ARCH] [HEAD_DIM]
#
# ARCH defaults to sm_90a (H100, H200), HEAD_DIM to 64. NVRTC, ptxas, cuobjdump and the CUDA
# headers come from NVIDIA's Python wheels, installed on first use into target/nvidia-venv (about
# 350 MB; no GPU or driver needed).
set -euo pipefail
cd "$(dirname "$0")/../.."
ARCH=${1:-sm_90a}
HEAD_DIM=${2:-64}
VENV=target/nvidia-venv
if ! "$VENV/bin/python" -c 'import nvidia' 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12 nvidia-cuda-runtime-cu12
fi
if ! compgen -G "$VENV/lib/python3*/site-packages/nvidia/*/bin/cuobjdump" > /dev/null; then
  "$VENV/bin/pip" install -q nvidia-cuda-cuobjdump
fi
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
cargo run -q --features wgpu,cuda --example cuda_kernels -- "$OUT" "$HEAD_DIM"
"$VENV/bin/python" bench/gpu/registers.py "$OUT" --arch "$ARCH"
