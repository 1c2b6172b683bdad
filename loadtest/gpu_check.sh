#!/usr/bin/env bash
# The GPU bring-up check, for a bare GPU machine with no network (one H100/H200), in under 9 minutes.
#
#   loadtest/gpu_check.sh OUT_DIR          kernels, graphs, quick benchmarks (fails fast: quick sizes first)
#   loadtest/gpu_check.sh OUT_DIR --long [STEP...]
#                                          the measurements: bench_attention, bench_gpu at full size,
#                                          serve (a served dummy:llama-1b: SDK, bench_serving; 2 pipeline stages
#                                          and 2 tensor-parallel ranks on one GPU), scheduling (iteration- vs
#                                          request-level, served); only the STEPs named, if any
#
# It uses the machine's python3 (with its torch and CuPy) and installs what it lacks from the wheels in
# .whl/ (make them here with loadtest/gpu_wheels.sh, then carry .whl along). Every log and JSON goes
# to OUT_DIR; each step's exit code and its last lines are printed as it ends.
set -uo pipefail
OUT=${1:?usage: loadtest/gpu_check.sh OUT_DIR [--long]}
MODE=${2:-quick}
shift $(($# < 2 ? $# : 2))
ONLY=" $* "  # the --long steps to run; blank = all
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SITE=/tmp/orcinus-site
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || { echo "installing the carried wheels failed"; exit 1; }
fi
export PYTHONPATH="$SITE:$PWD"
FAILED=0

step() {  # step NAME SECONDS COMMAND...: run it with a time limit, its output to OUT/NAME.log
    local name=$1 limit=$2 start rc
    shift 2
    if [ "$ONLY" != "  " ] && [[ "$ONLY" != *" $name "* ]]; then return; fi
    echo "== $name: $*"
    start=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "   exit $rc after $(($(date +%s) - start)) s"
    tail -n 6 "$OUT/$name.log" | sed 's/^/   | /'
    [ "$rc" -eq 0 ] || FAILED=1
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cupy', cupy.__version__)"
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), mode $MODE"
} 2>&1 | tee "$OUT/env.log"

if [ "$MODE" = "--long" ]; then
    # Together at most 580 s, so one 10-minute call of a lent machine runs them all; name steps to split them.
    step bench_attention 70 $PY loadtest/bench_attention.py --out "$OUT/bench_attention.json"
    step bench_gpu 260 $PY loadtest/bench_gpu.py --out "$OUT/bench_gpu.json"
    step serve 140 $PY loadtest/gpu_serve_check.py --out "$OUT/serve.json"
    step scheduling 110 $PY loadtest/compare_scheduling.py --model dummy:llama-1b --rates 20 40 80 \
        --num-prompts 120 --input-len 32 512 --max-num-seqs 64 --kv-cache-memory $((4 * 2**30)) \
        --out "$OUT/scheduling.json" --plot "$OUT/scheduling.png"
else
    step kernels 120 $PY -m pytest -q -x --gpu tests/test_cuda_kernels.py tests/test_varlen_prefill.py
    step graphs 150 $PY -m pytest -q -x --gpu tests/test_cuda_graphs.py
    step bench_gpu_quick 120 $PY loadtest/bench_gpu.py --quick --device cuda --out "$OUT/bench_gpu_quick.json"
    step bench_attention_quick 90 $PY loadtest/bench_attention.py --iters 5 --out "$OUT/bench_attention_quick.json"
fi
exit $FAILED
