#!/usr/bin/env bash
# Same-host A/B of the cluster environment configs/prod.yaml is started with: `serve_load.py --config
# configs/prod.yaml` as shipped, then once per variant, each a set of NAME=VALUE separated by commas (given to
# serve_load's --cluster-env, so Ray's processes and HAProxy see them), one after the other on this machine.
#   . bench/gpu_env.sh; bash bench/serve_env_ab.sh CKPT OUTDIR "LAYA_FLEET_HAPROXY_BUSY_POLLING=1" ...
# LEVELS, DURATION and WARMUP set the load (default: 1,2,16,64,512,1 clients, 4 s each after 2 s).
set -uo pipefail
ckpt=$1 out=$2
shift 2
levels=${LEVELS:-1,2,16,64,512,1}
run() {  # $1 label, $2 comma-separated NAME=VALUE list (may be empty)
  local args=()
  IFS=',' read -ra kvs <<< "$2"
  for kv in "${kvs[@]}"; do [ -n "$kv" ] && args+=(--cluster-env "$kv"); done
  echo "== $1: ${2:-as shipped}"
  python3 bench/serve_load.py --checkpoint "$ckpt" --backend auto --config configs/prod.yaml --levels "$levels" \
      --duration "${DURATION:-4}" --warmup "${WARMUP:-2}" "${args[@]}" --out "$out/serve_env_$1.json" 2>&1 \
      | grep -E "^(server|laya-fleet|Traceback|[A-Za-z]*Error)"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || echo "[$1] serve_load exited $rc (1: a request was refused or failed)"
}
run shipped ""
i=1
for v in "$@"; do run "variant$i" "$v"; i=$((i + 1)); done
