#!/usr/bin/env bash
# Which steps make iteration-level slower at 160-240 req/s: mixed steps past the 512-token graphs run eagerly?
set -u
PY=python3; SITE=/tmp/orcinus-site
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/env.log
C=(loadtest/compare_scheduling.py --model dummy:llama-1b --input-len 32 512 --max-num-seqs 64
   --kv-cache-memory $((4 * 2**30)) --latency-target 0.008 --rates 160 240 --seconds 5)
timeout 130 $PY "${C[@]}" --max-num-batched-tokens 512 --out $R/budget512.json --plot $R/budget512.png > $R/budget512.log 2>&1
echo "budget512 exit $?"; sed 's/\r/\n/g' $R/budget512.log | grep -E 'rate|ratio'
timeout 150 $PY "${C[@]}" --cuda-graph-max-tokens 2048 --out $R/graphs2048.json --plot $R/graphs2048.png > $R/graphs2048.log 2>&1
echo "graphs2048 exit $?"; sed 's/\r/\n/g' $R/graphs2048.log | grep -E 'rate|ratio'
grep -h captured $R/*.server.log
cd $OUT && tar czf lease2.tar.gz r && rm -rf r
