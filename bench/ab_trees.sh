#!/usr/bin/env bash
# Same-host A/B of two source trees on the GPU machine: the fast path (1x1, 10x3, offline), warm start
# (compile, fast) and, with SERVE=1, `serve_load.py --config configs/prod.yaml`, for the tree in TARBALL
# (`git archive` of the baseline commit) and for this checkout, one after the other. SERVE_ONLY=1: the serve
# runs alone (levels from LEVELS, default 1,16,64,512).
#   . bench/gpu_env.sh; BEFORE_COMMIT=abc1234 bash bench/ab_trees.sh .gpu/baseline.tar CKPT OUTDIR [before|after|both]
set -euo pipefail
tarball=$1 ckpt=$2 out=$3 which=${4:-both}
after_commit=${LAYA_FLEET_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  # before run_tree sets it
run_tree() {  # $1 tree dir, $2 label, $3 its commit (recorded in the results)
  local dir=$1 label=$2
  export LAYA_FLEET_COMMIT=$3
  mkdir -p "$out/$label"
  if [ "${SERVE_ONLY:-0}" != 1 ]; then
    # the same engines and sections in both trees (a tree older than the gemm8 section and --engines lacks them)
    local extra=()
    grep -q '"--engines"' "$dir/bench/fast_path.py" && extra=(gemm8 --engines fast fast16 eager fp32)
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir python3 bench/fast_path.py --ckpt "$ckpt" --out-dir "$out/$label" \
        --skip gemm add_ln attention upstream hf profile numerics "${extra[@]}" 2>&1 \
        | grep -E "^(workload|1x|10x|offline|fast:)") || echo "[$label] fast_path failed"
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 330 python3 bench/warm_start.py --checkpoint "$ckpt" \
        --rows compile,fast --out-dir "$out/$label" --row-timeout-s 150 2>&1 | tail -8) || echo "[$label] warm_start failed"
  fi
  if [ "${SERVE:-0}" = 1 ] || [ "${SERVE_ONLY:-0}" = 1 ]; then
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir python3 bench/serve_load.py --checkpoint "$ckpt" --backend auto \
        --config configs/prod.yaml --levels "${LEVELS:-1,16,64,512}" --duration 5 --warmup 2 \
        --out "$out/$label/serve_prod.json" 2>&1 | grep -E "^(server|laya-fleet)") || echo "[$label] serve_load failed"
  fi
}
if [ "$which" != after ]; then
  rm -rf /tmp/ab_before && mkdir -p /tmp/ab_before && tar -xf "$tarball" -C /tmp/ab_before
  run_tree /tmp/ab_before before "${BEFORE_COMMIT:-baseline}"
fi
if [ "$which" != before ]; then run_tree "$PWD" after "$after_commit"; fi
