#!/usr/bin/env bash
# Fetch (here, with PyPI at hand) the wheels a bare GPU machine lacks, into .whl/ for gpu_check.sh.
# Which ones: loadtest/gpu_wheels.txt. Python 3.12, x86-64, as on the lent H100/H200 machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl
fetch() {  # no dependencies: the machine's own numpy, anyio... must not be shadowed by other versions
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$@"
}
mapfile -t wheels < <(sed 's/#.*//; s/[[:space:]]//g; /^$/d' loadtest/gpu_wheels.txt)
fetch "${wheels[@]}"
# pydantic pins its core exactly: fetch the version it names.
core=$(unzip -p .whl/pydantic-[0-9]*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
fetch "pydantic-core==$core"
ls .whl
