# `make test` and `make train` set up everything they need on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0

.PHONY: install test test-unit clean

install: $(VENV)/.installed

# torch is installed pinned first: an unpinned requirement would pull the newest
# CUDA build (several GB); with 2.13.0 present, `torch>=2.13` is already satisfied.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

test: install
	$(PY) -m pytest -q tests

test-unit: install
	$(PY) -m pytest -q tests/unit

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
