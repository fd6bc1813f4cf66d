# Source on the GPU machine from the repo root (`. bench/gpu_env.sh`): unpacks the bundles a run carried
# (.gpu/ray-site.tar.xz, .gpu/tilelang-site.tar.xz, the pure-Python wheels in .whl/: upstream laya, and
# py3langid, which the ingress needs and the Ray bundle lacks) into /tmp/site unless a previous run
# on the same warm machine already did, extracts the packed kernel caches (.gpu/fast-tl-cache.tar.xz,
# .gpu/test-tl-cache.tar.xz for the GPU tests, .gpu/pingpong-tl-cache.tar.xz for bench/pingpong_ab.py and the
# ping-pong engines of bench/fast_path.py) into /tmp/lfc, writes the
# `serve` / `ray` / `laya-serve` entry points the bundles lack, exports PYTHONPATH and the cache dir, and
# byte-compiles the site once in the background.
mkdir -p /tmp/site /tmp/lfc
_new=0
if [ -f .gpu/ray-site.tar.xz ] && [ ! -d /tmp/site/ray ]; then tar -xJf .gpu/ray-site.tar.xz -C /tmp/site; _new=1; fi
if [ -f .gpu/tilelang-site.tar.xz ] && [ ! -d /tmp/site/tilelang ]; then
  tar -xJf .gpu/tilelang-site.tar.xz -C /tmp/site; _new=1
fi
for c in .gpu/fast-tl-cache.tar.xz .gpu/test-tl-cache.tar.xz .gpu/pingpong-tl-cache.tar.xz; do
  [ -f "$c" ] && tar -xJf "$c" -C /tmp/lfc
done
for w in .whl/*.whl; do  # each wheel once: its package folder is the name before the first '-'
  p=$(basename "$w"); p=${p%%-*}
  if [ -f "$w" ] && [ ! -d "/tmp/site/$p" ]; then python3 -m zipfile -e "$w" /tmp/site; fi
done
export PYTHONPATH=/tmp/site:$PWD CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1 LAYA_FLEET_LOCAL_CACHE_DIR=/tmp/lfc
# the bundles ship no bytecode: compile it once, in the background, as pip does at install, so that every Ray
# process (GCS client, monitor, dashboard agent, workers) does not compile its imports on start-up timings
# (again on a later call when an earlier call's compile ended with it: compileall skips what is up to date)
[ "$_new" = 1 ] && rm -f /tmp/site/.bytecode-done
if [ ! -f /tmp/site/.bytecode-done ] && ! pgrep -f '[m] compileall -q -j 0 /tmp/site' >/dev/null; then
  (nice python3 -m compileall -q -j 0 /tmp/site >/tmp/site-compileall.log 2>&1; touch /tmp/site/.bytecode-done) &
fi
# start-up timings (bench/offline.py, bench/startup_profile.py) call this first: without bytecode each Ray process
# compiles what it imports, which tripled `ray.init` on the GPU host (10.4 s against 3.2 s with it)
wait_bytecode() {
  local t=$SECONDS
  while [ ! -f /tmp/site/.bytecode-done ] && [ $((SECONDS - t)) -lt 300 ]; do sleep 1; done
  echo "bytecode ready after $((SECONDS - t)) s of waiting"
}
_P=$(python3 -c "import sys; print(sys.executable)")
_shim() { printf '#!%s\nimport sys\nfrom %s import %s\nsys.exit(%s())\n' "$_P" "$2" "$3" "$3" > "$(dirname "$_P")/$1" \
  && chmod +x "$(dirname "$_P")/$1"; }
_shim serve ray.serve.scripts cli; _shim ray ray.scripts.scripts main; _shim laya-serve laya.serve main
# the launcher's module as pyproject.toml's entry point names it
_shim laya-fleet-haproxy $(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["scripts"]["laya-fleet-haproxy"].replace(":", " "))')
echo "site: $(ls /tmp/site | tr '\n' ' ' | head -c 300)"
