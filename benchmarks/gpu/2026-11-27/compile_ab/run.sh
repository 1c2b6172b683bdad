#!/usr/bin/env bash
# One-off (session 2026-11-27): decode steps with compiled segments (K/V write as a custom op) vs eager segments.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$(mktemp -d)/gpu_compile_ab; mkdir -p $R
pack() { tar czf $OUT/gpu_compile_ab.tar.gz -C $(dirname $R) gpu_compile_ab; }
trap pack EXIT
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; git rev-parse --short HEAD; git status --short; } > $R/env.log 2>&1
step() { local n=$1 t=$2; shift 2; echo "== $n: $*" | tee -a $R/summary.log; s=$(date +%s)
  timeout $t "$@" > $R/$n.log 2>&1; echo "   exit $? after $(( $(date +%s) - s )) s" | tee -a $R/summary.log
  grep -v "^DEBUG" $R/$n.log | grep "batch \|passed\|failed\|Error" | tail -n 6 | sed 's/^/   | /' | tee -a $R/summary.log; pack; }
P="python3 loadtest/profile_iteration.py --model dummy:llama-1b --device cuda --batches 1 64 --steps 12 --table"
step compile_on 100 $P --compile on --out $R/compile_on.json
step compile_off 60 $P --compile off --out $R/compile_off.json
step compile_gpu_test 70 python3 -m pytest -q --gpu tests/test_compile.py -k gpu
