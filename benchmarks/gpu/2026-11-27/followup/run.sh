#!/usr/bin/env bash
# One-off follow-up on a lent GPU (session 2026-11-27): the compile fix, the async test, decode steps with fused segments.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=$(mktemp -d)/gpu_followup; mkdir -p $R
pack() { tar czf $OUT/gpu_followup.tar.gz -C $(dirname $R) gpu_followup; }
trap pack EXIT
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; git rev-parse --short HEAD; git status --short; } > $R/env.log 2>&1
step() { local n=$1 t=$2; shift 2; echo "== $n: $*" | tee -a $R/summary.log; s=$(date +%s)
  timeout $t "$@" > $R/$n.log 2>&1; echo "   exit $? after $(( $(date +%s) - s )) s" | tee -a $R/summary.log
  grep -v "^DEBUG" $R/$n.log | tail -n ${TAILN:-8} | sed 's/^/   | /' | tee -a $R/summary.log; pack; }
step gpu_tests 120 python3 -m pytest -q --gpu tests/test_compile.py tests/test_async_scheduling.py
TAILN=12 step bench_gpu 200 python3 loadtest/bench_gpu.py --shapes llama-1b --batches 1 64 --parts b c --out $R/bench_gpu.json
TAILN=6 step profile_compiled 90 python3 loadtest/profile_iteration.py --model dummy:llama-1b --device cuda --batches 1 64 --compile on --table --out $R/profile_compiled.json
