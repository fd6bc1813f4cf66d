#!/usr/bin/env bash
# Run first on a GPU machine that stayed warm between calls: kills what an earlier call that timed out left
# running (serve_load's `serve run`, its Ray cluster and HAProxy, load clients), which would otherwise share
# the GPU and cores with the next measurement. This shell and its parents are spared: the command that runs
# this script often names the same programs (`bash bench/gpu_clean.sh; python3 bench/serve_load.py ...`).
spare=" "
p=$$
while [ -n "$p" ] && [ "$p" -gt 1 ]; do
  spare="$spare$p "
  p=$(awk '{print $4}' "/proc/$p/stat" 2>/dev/null)
done
for pat in 'serve_load.py' 'ray::' 'raylet' 'gcs_server' 'haproxy' 'dashboard' 'serve run'; do
  for pid in $(pgrep -f "$pat"); do
    case "$spare" in *" $pid "*) ;; *) kill -9 "$pid" 2>/dev/null ;; esac
  done
done
sleep 2
echo "GPU processes left: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | wc -l)"
