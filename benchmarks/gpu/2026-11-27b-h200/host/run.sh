set -u
PY=python3; SITE=/tmp/orcinus-site
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/env.log
git log -1 --format=%h >> $OUT/env.log 2>/dev/null
timeout 100 $PY loadtest/profile_host.py --batch 64 --out $OUT/host_b64.json > $OUT/host_b64.log 2>&1; echo "b64 exit $?"
grep '==' $OUT/host_b64.log
timeout 70 $PY loadtest/profile_host.py --batch 1 --out $OUT/host_b1.json > $OUT/host_b1.log 2>&1; echo "b1 exit $?"
grep '==' $OUT/host_b1.log
