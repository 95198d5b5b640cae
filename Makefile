# Everything sets itself up: a fresh machine needs only `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PROTOS := protos/specdec/v1/orchestrator.proto protos/specdec/internal/v1/replica.proto

.PHONY: help setup venv redis kernels proto run demo test test-fast bench bench-bf16 bench-smoke gpu-kit models loadtest soak clean

help:  ## list the targets
	@grep -E '^[a-z0-9-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

setup: venv redis kernels  ## virtualenv with pinned packages, redis-server and the CPU kernels

kernels: $(VENV)/.kernels  ## compile the CPU kernels (specdec/native) once; the servers run without them where they cannot build
$(VENV)/.kernels: $(VENV)/.installed $(wildcard specdec/native/*.cpp specdec/native/*.h specdec/native/*.inc) specdec/native/__init__.py
	$(PY) -m specdec.native || echo "the servers will use torch's operators"
	touch $@

venv: $(VENV)/.installed
$(VENV)/.installed: requirements.txt requirements-dev.txt deploy/requirements.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

redis:  ## install redis-server (Debian package) if missing
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server"; \
	  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null || \
	  { echo "could not install redis-server: install it or set SPECDEC_REDIS_SERVER"; exit 1; }; }

proto: venv  ## regenerate the gRPC stubs from protos/
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

run: setup  ## the whole local stack in the foreground (Ctrl-C stops it)
	$(PY) -m localstack run

demo: setup  ## bring the stack up, stream a few completions with stats and speedups, take it down
	$(PY) -m localstack demo

test: setup  ## all tests (unit, statistical, end-to-end against real Redis, gRPC and models)
	$(PY) -m pytest -q --durations=12 tests

test-fast: setup  ## tests without the slow end-to-end ones
	$(PY) -m pytest -q -m "not e2e" tests

bench: setup  ## side-by-side benchmark; writes benchmarks/RESULTS.md and a plot
	$(PY) -m benchmarks.bench

bench-bf16: setup  ## make bench with a bf16 target and an fp32 draft (CPUs with native bf16); writes benchmarks/RESULTS-bf16.md
	$(PY) -m benchmarks.bench --dtype bfloat16 --draft-dtype float32 --out benchmarks/RESULTS-bf16.md

bench-smoke: setup  ## the benchmark's smoke run (as in make test)
	$(PY) -m pytest -q -m bench tests/benchmarks

gpu-kit: setup  ## wheels and redis-server into .gpukit/ for make bench on a lent GPU machine (benchmarks/gpu_kit.sh)
	PYTHON=$(PY) bash benchmarks/gpu_kit.sh prepare

models: venv  ## retrain the bundled pair (about 2 hours on 2 cores)
	$(PY) -m training --out models
	$(PY) -m training.distill --models models --seed 0
	$(PY) -m training.distill --models models --seed 1
	$(PY) -m training.distill --models models --seed 2
	$(PY) -m training.distill --models models --seed 3
	$(PY) -m training.distill --models models --seed 4 --lr 5e-4 --warmup 20

loadtest: setup  ## python load generator against a local stack
	$(PY) -m localstack loadtest

soak: setup  ## N streams for M minutes against the local stack (SOAK_STREAMS, SOAK_MINUTES; SOAK_CHAOS=S stops a replica every S seconds; SOAK_ARGS more flags)
	$(PY) -m localstack soak --streams $${SOAK_STREAMS:-8} --minutes $${SOAK_MINUTES:-10} $${SOAK_CHAOS:+--chaos $$SOAK_CHAOS} $${SOAK_ARGS:-}

clean:
	rm -rf $(VENV) .pytest_cache
