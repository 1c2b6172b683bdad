#!/usr/bin/env bash
# The GPU bring-up check, for a bare GPU machine with no network (one H100/H200).
#
#   bench/gpu/gpu_check.sh OUT_DIR --lease [STEP...]
#                                          a 15-minute lease (its machine's start included) in two calls:
#                                          the first (a 420 s deadline) registers, prompt tiles vs per-row
#                                          prompt rows, llama-1b decode steps at batch 1 and 64 against the floor,
#                                          greedy tokens graphs vs eager, every GPU test file, the kernel's
#                                          graph-timed rows, a kernel profile of decode steps,
#                                          host time; the second (`--lease scheduling`, a 240 s deadline, at once:
#                                          a warm machine is given back after 30 s idle) iteration- vs
#                                          request-level served at 8 ms/token
#   bench/gpu/gpu_check.sh OUT_DIR         registers and spills of the attention kernels (nvcc --resource-usage),
#                                          every GPU test file, quick benchmarks; fails fast: quick sizes first
#   bench/gpu/gpu_check.sh OUT_DIR --long [STEP...]
#                                          the measurements: bench_attention, bench_gpu at full size,
#                                          serve (a served dummy:llama-1b: SDK, bench_serving; 2 pipeline stages
#                                          and 2 tensor-parallel ranks on one GPU), scheduling (iteration- vs
#                                          request-level, served, at a fixed 8 ms/token); only the STEPs named
#
# A lent machine runs one command for at most 600 s, the wheels' install (~15 s) included. Where a session
# has 15 device-minutes, `--lease` is the plan; with more, every step below at full size takes four calls:
#   bench/gpu/gpu_check.sh $OUT                                  <= 540 s
#   bench/gpu/gpu_check.sh $OUT --long bench_attention serve     <= 330 s
#   bench/gpu/gpu_check.sh $OUT --long bench_gpu                 <= 540 s
#   bench/gpu/gpu_check.sh $OUT --long scheduling                <= 300 s
# (`--long` alone runs all four of its steps, up to 1170 s: for a machine without that limit.)
#
# It uses the machine's python3 (with its torch and CuPy) and installs what it lacks from the wheels in
# .whl/ (make them here with bench/gpu/gpu_wheels.sh, then carry .whl along). Logs and JSON files are
# written in a scratch folder and packed, after every step and on exit, into one archive:
# OUT_DIR/gpu_check-<mode>.tar.gz. One file, because a lent machine returns at most 8 files from $OUT;
# and the scripts rewrite their JSON after every measured row, so a step stopped by its limit still
# leaves what it measured in the archive. Each step's exit code and last lines are printed as it ends.
set -uo pipefail
OUT=${1:?usage: bench/gpu/gpu_check.sh OUT_DIR [--long [STEP...]]}
MODE=${2:-quick}
shift $(($# < 2 ? $# : 2))
ONLY=" $* "  # the --long or --lease steps to run; blank = all (--lease: all but scheduling)
cd "$(dirname "$0")/../.."  # the checkout's root
LABEL=$(case "$MODE" in --long | --lease) echo "${MODE#--}${*:+-}$(echo "$*" | tr ' ' '-')" ;; *) echo quick ;; esac)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
RUN=$SCRATCH/gpu_check-$LABEL  # the archive's one top folder
mkdir -p "$RUN"
ARCHIVE="$OUT/gpu_check-$LABEL.tar.gz"

# One deadline for the whole call, so that no step's cap can push the call past the lent machine's limit
# (a kill there loses what is not packed): --lease's first call 420 s, its scheduling call 240 s.
case "$MODE" in
    --lease) BUDGET=$([ "$ONLY" = "  " ] && echo 420 || echo 240) ;;
    --long) BUDGET=1170 ;;
    *) BUDGET=540 ;;
esac
BUDGET=${GPU_CHECK_SECONDS:-$BUDGET}
DEADLINE=$(($(date +%s) + BUDGET))

pack() {  # the archive is replaced whole, never left half-written (the packer below may run at the same time)
    local part="$ARCHIVE.part.$BASHPID"
    tar czf "$part" -C "$(dirname "$RUN")" "$(basename "$RUN")" 2>/dev/null && mv -f "$part" "$ARCHIVE"
}
# Packed every 20 s as well: a step killed from outside still leaves the JSON it rewrote after each row.
(while sleep 20; do pack; done) &
PACKER=$!
trap 'kill $PACKER 2>/dev/null; pack; rm -rf "$SCRATCH"' EXIT
trap 'exit 143' TERM INT HUP  # so the EXIT trap packs what there is

export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SITE=/tmp/orcinus-site
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        || { echo "installing the carried wheels failed" | tee "$RUN/summary.log"; exit 1; }
fi
export PYTHONPATH="$SITE:$PWD"
# Every step imports these: stop now, in seconds, rather than fail each step in turn.
if ! $PY -c "import msgspec, gguf, starlette, uvicorn, engine.launch, gateway.app, cupy" >"$RUN/preflight.log" 2>&1; then
    { echo "preflight: the engine or the gateway does not import$(compgen -G '.whl/*.whl' >/dev/null ||
        echo ' (no .whl/: make the wheels with bench/gpu/gpu_wheels.sh and carry .whl)')"
      tail -n 5 "$RUN/preflight.log"; } | tee -a "$RUN/summary.log"
    exit 1
fi
FAILED=0

step() {  # step NAME SECONDS COMMAND...: run it with a time limit, its output to RUN/NAME.log
    local name=$1 limit=$2 start rc left
    shift 2
    if [ "$ONLY" != "  " ] && [[ "$ONLY" != *" $name "* ]]; then return; fi
    left=$((DEADLINE - $(date +%s) - 15))  # room to be killed (-k 10) and packed before the deadline
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        echo "== $name: skipped, the call's deadline is near" | tee -a "$RUN/summary.log"
        FAILED=1
        return
    fi
    echo "== $name (limit $limit s): $*" | tee -a "$RUN/summary.log"
    start=$(date +%s)
    timeout -k 10 "$limit" "$@" >"$RUN/$name.log" 2>&1
    rc=$?
    {
        echo "   exit $rc after $(($(date +%s) - start)) s$([ "$rc" -eq 124 ] && echo ": stopped at its time limit")"
        tail -n 6 "$RUN/$name.log" | sed 's/^/   | /'
    } | tee -a "$RUN/summary.log"
    [ "$rc" -eq 0 ] || FAILED=1
    pack
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader
    $PY -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cupy', cupy.__version__)"
    $PY -c "import triton; print('triton', triton.__version__)"
    nvcc --version | tail -n 2
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), mode $MODE $*"
} 2>&1 | tee "$RUN/env.log"
pack

resource_usage() {  # registers and spills of every attention kernel entry point (decode, prompt tiles), built as
    # NVRTC builds it (engine/kernels/nvrtc.py's NVRTC_OPTIONS, plus the -ftz=true CuPy adds), for this GPU's
    # architecture.
    local cap arch options
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')
    arch=sm_${cap:-90}
    options=$($PY -c 'from engine.kernels.nvrtc import NVRTC_OPTIONS; print(*NVRTC_OPTIONS)' \
        2>/dev/null || echo -std=c++17)
    step resource_usage "$1" bash -c "for k in paged_decode_attention paged_prompt_tiles; do
        nvcc -arch=$arch $options -ftz=true --resource-usage -cubin -o $RUN/\$k.$arch.cubin \
            engine/kernels/csrc/cuda/\$k.cu || exit 1; done"
}

# Every test file with GPU tests (marked `gpu`, or `needs_gpu` from test_cuda_kernels), kernels first.
KERNEL_TESTS="tests/test_cuda_kernels.py tests/test_varlen_prefill.py"
OTHER_TESTS=$(grep -lE 'mark\.gpu|needs_gpu' tests/test_*.py | grep -vxF -e tests/test_cuda_kernels.py \
    -e tests/test_varlen_prefill.py | tr '\n' ' ')
# Both modes at each rate back to back, compared at a fixed p50 of 8 ms per output token.
# A 512-token budget keeps every step inside a whole-step graph (at most 512 rows): what is compared is the
# scheduling, not how often a step falls back to piecewise graphs (each point counts its steps by path).
SCHEDULING=(-m bench.serving.compare_scheduling --model dummy:llama-1b --input-len 32 512 --max-num-seqs 64
    --max-num-batched-tokens 512 --kv-cache-memory $((4 * 2**30)) --latency-target 0.008
    --out "$RUN/scheduling.json" --plot "$RUN/scheduling.png")

if [ "$MODE" = "--lease" ]; then
    # The decode-step goals first, then the rest, each step capped and all under the call's deadline; the
    # served comparison only when named (the second call, at once).
    [ "$ONLY" = "  " ] && ONLY=" resource_usage kernels prompt_tiles bench_gpu gpu_tests bench_attention profile host "
    resource_usage 45
    step kernels 60 $PY -m pytest -q --maxfail=5 --gpu $KERNEL_TESTS
    # A mixed step's attention (llama-1b heads), prompt rows by tiles vs one decode query a row, graph-timed.
    step prompt_tiles 40 $PY -m bench.gpu.bench_prompt_tiles --iters 10 --out "$RUN/prompt_tiles.json"
    # (b) decode steps against the floor, then (a) float32 greedy tokens, eager vs piecewise vs whole-step graphs
    # with staggered arrivals (mixed steps); each part isolated from the other's failure.
    step bench_gpu 150 $PY -m bench.gpu.bench_gpu --shapes llama-1b --batches 1 64 --parts b a \
        --out "$RUN/bench_gpu.json"
    step gpu_tests 120 $PY -m pytest -q --gpu $OTHER_TESTS
    # With a build of the decode kernel that fits more blocks on an SM (batch 64 ran in two waves).
    step bench_attention 90 $PY -m bench.kernels.bench_attention --iters 10 --out "$RUN/bench_attention.json" \
        --variant u2b4=-DORCINUS_DECODE_UNROLL=2,-DORCINUS_DECODE_MIN_BLOCKS=4
    # Where a decode step's GPU time goes: kernels per step, compiled segments in graphs (JSON: the top 40).
    step profile 90 $PY -m bench.offline.profile_iteration --model dummy:llama-1b --device cuda --batches 1 64 \
        --table --out "$RUN/profile.json"
    # Host time of decode and mixed steps (a 400-token prompt joining 63 decodes), whole-step graphs vs piecewise.
    step host 90 $PY -m bench.gpu.profile_host --batch 64 --out "$RUN/host.json"
    step scheduling 240 $PY "${SCHEDULING[@]}" --rates 80 160 240 320 480 --seconds 5
elif [ "$MODE" = "--long" ]; then
    step bench_attention 150 $PY -m bench.kernels.bench_attention --out "$RUN/bench_attention.json"
    step serve 180 $PY -m bench.gpu.gpu_serve_check --out "$RUN/serve.json"
    step bench_gpu 540 $PY -m bench.gpu.bench_gpu --out "$RUN/bench_gpu.json"
    step scheduling 300 $PY "${SCHEDULING[@]}" --rates 20 40 80 120 160 200 240 --seconds 3
else
    resource_usage 60
    step kernels 90 $PY -m pytest -q -x --gpu $KERNEL_TESTS
    step prompt_tiles 40 $PY -m bench.gpu.bench_prompt_tiles --iters 10 --out "$RUN/prompt_tiles.json"
    step gpu_tests 150 $PY -m pytest -q -x --gpu $OTHER_TESTS
    step bench_gpu_quick 120 $PY -m bench.gpu.bench_gpu --quick --device cuda --out "$RUN/bench_gpu_quick.json"
    step bench_attention_quick 120 $PY -m bench.kernels.bench_attention --iters 5 --graph-iters 10 \
        --out "$RUN/bench_attention_quick.json"
fi
echo "packed into $ARCHIVE" | tee -a "$RUN/summary.log"
exit $FAILED
