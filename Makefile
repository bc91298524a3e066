# The two commands of the README: `make serve` (set up, then serve the default model on tritonserver)
# and `make test` (set up, then run every test). Each does its own set-up on a fresh machine.
SHELL := /bin/bash
PY := .venv/bin/python
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
THREADS ?= 2
MINUTES ?= 10
CONCURRENCY ?= 1,2,4,8,16,32
REQUESTS ?= 64
TEST_WORKERS ?= $(if $(wildcard /dev/nvidia0),0,2)
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
IN_WORKERS = -n $(TEST_WORKERS) --dist worksteal

.PHONY: setup setup-serving serve test test-fast bench bench-kernels bench-gpu compile-kernels load soak clean

setup:
	@bash scripts/setup.sh

setup-serving:
	@bash scripts/setup.sh --serving

serve: setup-serving
	HTTP_PORT=$(HTTP_PORT) GRPC_PORT=$(GRPC_PORT) METRICS_PORT=$(METRICS_PORT) $(PY) scripts/serve.py

# The engine's tests in TEST_WORKERS processes (pytest-xdist; one per core of a 2-core CI host, none on
# a GPU host, where they would share one GPU's memory), then the served ones one at a time: their
# timings (refusals within a second, latency gaps) assume the server has the cores to itself. (Tried
# 2026-12-07: the kernels' and the offline random mixes' tests beside them at nice 19, to fill the time
# a served test's client waits: the served part took 1,179 s instead of 686, its latency-bound steps
# slowed by whatever ran beside them, niced or not.)
test: setup-serving
	$(PYTEST) --durations=15 -m "not server" $(IN_WORKERS) tests; \
	engine=$$?; \
	$(PYTEST) --durations=15 -m server tests; \
	served=$$?; \
	exit $$(( engine || served ))

test-fast: setup
	$(PYTEST) -m "not slow and not server" $(IN_WORKERS) tests

bench: setup-serving
	$(PY) client/bench.py --threads $(THREADS)

bench-kernels: setup
	$(PY) client/bench_kernels.py

# On a GPU machine with nothing but the repository (no set-up: it may reach no package registry).
bench-gpu:
	$(if $(wildcard $(PY)),$(PY),python3) client/bench_gpu.py --out bench-gpu.md

compile-kernels: setup
	$(PY) scripts/compile_kernels.py

load: setup-serving
	@bash scripts/setup.sh --load
	.tools/genai-perf/bin/python client/load.py --grpc-port $(GRPC_PORT) --http-port $(HTTP_PORT) \
		--concurrency $(CONCURRENCY) --requests $(REQUESTS)

soak: setup-serving
	$(PY) client/soak.py --minutes $(MINUTES)

clean:
	rm -rf .venv .tools models artifacts
