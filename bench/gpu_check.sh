#!/usr/bin/env bash
# The GPU checks of one CUDA node, in under 10 minutes, from the repository root:
#
#     bash bench/gpu_check.sh            # logs, JSON and figures.txt in $OUT (default ./gpu-out)
#
# 1. the CUDA tests (test_cuda.py, the staging tests, the controller's CUDA cases), at most 90 s;
# 2. bench/bench_backbone.py --device cuda: h1024, h1024-bf16 and h2048, at most 400 s;
# 3. bench/bench_step.py --quick --device cuda (needs CIFAR-10: $ACTCACHE_DATA or ../shared/data), at most 100 s;
# each under `timeout`, and all within GPU_CHECK_BUDGET seconds (default 570): a step gets what is left.
# Wheels in .whl/ (bench/README.md says how to fetch them) are installed into a temp dir first, for a
# node whose Python lacks actcache's dependencies; the project runs from the checkout, not installed.
# ACTCACHE_DIR points to a temp dir under /tmp: no daemon of the node's user is touched.

set -u -o pipefail

OUT=${OUT:-./gpu-out}
PYTHON=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-570}
START=$(date +%s)
mkdir -p "$OUT"

if compgen -G ".whl/*.whl" >/dev/null; then
  SITE=$(mktemp -d)
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "installing .whl/ failed" | tee "$OUT/summary.txt"; exit 1; }
  export PYTHONPATH="$SITE:$PWD:$PWD/client"
else
  export PYTHONPATH="$PWD:$PWD/client${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
ACTCACHE_DIR=$(mktemp -d /tmp/actcache-gpu-check-XXXXXX)
export ACTCACHE_DIR
unset ACTCACHE_SOCKET

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  "$PYTHON" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
  "transformers", transformers.__version__); print(torch.cuda.get_device_name(0) if torch.cuda.is_available()
  else "no CUDA device")'
  nproc
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
: >"$OUT/summary.txt"

# step NAME LIMIT_S COMMAND...: run COMMAND under timeout (LIMIT_S, or what is left of the budget), log to $OUT/NAME.log
step() {
  local name=$1 limit=$2 left rc t0
  shift 2
  left=$((BUDGET - ($(date +%s) - START)))
  ((left < limit)) && limit=$left
  if ((limit < 20)); then
    echo "$name: skipped, ${left}s of the budget left" | tee -a "$OUT/summary.txt"
    return
  fi
  echo "== $name (at most ${limit}s)"
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc$( ((rc == 124)) && echo ' (timed out)') after $(($(date +%s) - t0))s" | tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$name.log"
}

step cuda_tests 90 "$PYTHON" -m pytest -q -x -p no:cacheprovider tests/integration/test_cuda.py \
  tests/client/test_device_staging.py tests/integration/test_controller_training.py -k "cuda or gpu or staging"
step bench_backbone 400 "$PYTHON" bench/bench_backbone.py --device cuda --json "$OUT/bench_backbone.json"
step bench_step 100 "$PYTHON" bench/bench_step.py --quick --device cuda --json "$OUT/bench_step.json"

grep -h "^figure:" "$OUT"/bench_*.log >"$OUT/figures.txt" 2>/dev/null
echo "== figures"
cat "$OUT/figures.txt"
cat "$OUT/summary.txt"
rm -rf "$ACTCACHE_DIR"
