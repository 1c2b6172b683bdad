#!/usr/bin/env bash
# Fetch (here, with PyPI at hand) the wheels a bare GPU machine lacks, into .whl/ for gpu_check.sh.
# Such a machine has torch, CuPy, transformers, numpy, anyio, httpx, jinja2, tiktoken and
# prometheus-client, but not these (the openai SDK now needs httpx2, not httpx). Python 3.12, x86-64, as on the lent H100/H200 machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl
fetch() {  # no dependencies: the machine's own numpy, anyio... must not be shadowed by other versions
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$@"
}
fetch msgspec gguf starlette sse-starlette uvicorn openai httpx2 httpcore2 truststore pydantic jiter distro sniffio annotated-types \
    typing-inspection
# pydantic pins its core exactly: fetch the version it names.
core=$(unzip -p .whl/pydantic-[0-9]*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
fetch "pydantic-core==$core"
ls .whl
