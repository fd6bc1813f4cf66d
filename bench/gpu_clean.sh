#!/usr/bin/env bash
# Run first on a GPU machine that stayed warm between calls: kills what an earlier call that timed out left
# running (serve_load's `serve run`, its Ray cluster and HAProxy, load clients), which would otherwise share
# the GPU and cores with the next measurement. The patterns are bracketed so they do not match this command.
for pat in '[s]erve_load.py' '[r]ay::' '[r]aylet' '[g]cs_server' '[h]aproxy' '[d]ashboard' '[s]erve run'; do
  pkill -9 -f "$pat" 2>/dev/null
done
sleep 2
echo "GPU processes left: $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | wc -l)"
