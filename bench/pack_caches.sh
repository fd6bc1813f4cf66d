#!/usr/bin/env bash
# Builds and packs, on a CPU machine, the kernel caches a GPU run carries (bench/gpu_env.sh extracts them):
#   .gpu/fast-tl-cache.tar.xz      bench/fast_path.py's engines (modernbert-large: bf16, fp16, FP8, the fold)
#   .gpu/pingpong-tl-cache.tar.xz  what bench/pingpong_ab.py and the ping-pong engines add
#   .gpu/test-tl-cache.tar.xz      the GPU tests' kernels at awkward sizes
# A cache is keyed by the kernels' source, so each kernels/*.py change needs a fresh pack (about 19 minutes on
# 2 cores). PY is a Python with the checkout's requirements and TileLang's pins (../shared/gpu/make-bundles), e.g.
#   python3 -m venv /tmp/tl && /tmp/tl/bin/pip install torch==2.13.0 tilelang==0.1.15 apache-tvm-ffi==0.1.12 \
#       z3-solver==4.15.4.0 torch-c-dlpack-ext==0.1.5 && /tmp/tl/bin/pip install -c constraints.txt -e .
#   PY=/tmp/tl/bin/python bench/pack_caches.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} LAYA_FLEET_TL_ARCH=${LAYA_FLEET_TL_ARCH:-sm_90a}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p .gpu
LAYA_FLEET_LOCAL_CACHE_DIR=$work/fast "$PY" -m model.backends.fast.precompile --shapes modernbert-large \
    --fp16 --fp8 --ln-fold-m 1024 --pack .gpu/fast-tl-cache.tar.xz
LAYA_FLEET_LOCAL_CACHE_DIR=$work/pingpong "$PY" bench/pingpong_ab.py --compile-only \
    --pack .gpu/pingpong-tl-cache.tar.xz
LAYA_FLEET_LOCAL_CACHE_DIR=$work/test "$PY" -m model.backends.fast.precompile --shapes tiny --fp16 --fp8 --tests \
    --pack .gpu/test-tl-cache.tar.xz
ls -la .gpu/*-tl-cache.tar.xz
