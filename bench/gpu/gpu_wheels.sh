#!/usr/bin/env bash
# Fetch (here, with PyPI at hand) the wheels a bare GPU machine lacks, into .whl/ for gpu_check.sh.
# Which ones: bench/gpu/gpu_wheels.txt. Python 3.12, x86-64, as on the lent H100/H200 machines.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the checkout's root
PY=${PYTHON:-python3}
mkdir -p .whl
# The machine's glibc (benchmarks/results/gpu/bench_gpu.json records it); pip matches each manylinux tag exactly, and
# newer wheels (llguidance >= 1.7) are built for glibc 2.31 or later, so name the tags up to it.
PLATFORMS=()
for tag in manylinux2014 manylinux_2_17 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35 manylinux_2_39; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done
fetch() {  # no dependencies: the machine's own numpy, anyio... must not be shadowed by other versions
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
        -d .whl "$@"
}
mapfile -t wheels < <(sed 's/#.*//; s/[[:space:]]//g; /^$/d' bench/gpu/gpu_wheels.txt)
fetch "${wheels[@]}"
# pydantic pins its core exactly: fetch the version it names.
core=$(unzip -p .whl/pydantic-[0-9]*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
fetch "pydantic-core==$core"
ls .whl
