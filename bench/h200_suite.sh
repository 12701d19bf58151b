#!/usr/bin/env bash
# One planned device run: GPU correctness tests and benchmark suites, each in its own process with its own
# time limit (a device error in one cannot take the others down), most important first, all inside one
# overall budget. Results land in $K3NN_RESULTS_DIR (JSON per suite); the full log in $K3NN_RESULTS_DIR/log.txt.
#   K3NN_RESULTS_DIR=/tmp/out K3NN_SUITE_SECONDS=480 bash bench/h200_suite.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 K3NN_TEST_GPU=1 K3NN_DISABLE_PROGRESS_BARS=1
OUTDIR=${K3NN_RESULTS_DIR:-bench/results}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/log.txt"
END=$(( SECONDS + ${K3NN_SUITE_SECONDS:-480} ))
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$LOG"

step() {  # step NAME LIMIT_S CMD...
  local name=$1 limit=$2 left; shift 2
  left=$(( END - SECONDS ))
  if (( left < 25 )); then echo "== $name: skipped (suite budget spent)" | tee -a "$LOG"; return; fi
  (( limit > left )) && limit=$left
  echo "== $name (limit ${limit}s, t=${SECONDS}s)" | tee -a "$LOG"
  timeout -s INT -k 15 "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "== $name: rc=$rc, t=${SECONDS}s" | tee -a "$LOG"
  # the last lines of each step (tables, test summary) also go to stdout
  tac "$LOG" | sed -n "1,/^== $name (limit/p" | tac | grep -vE "^\s*$" | tail -n 18
}

step kda-prefill     110 python3 -m k3nn.bench.kda_prefill --quick
step kda-gpu-tests    70 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_kda_gpu.py
step moe              90 python3 -m k3nn.bench.moe --tokens 2048 8192 --mx-tokens 1 16
step decode-gpu-tests 45 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_decode_gpu.py
step attnres-gpu-tests 35 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_attnres_gpu.py
step spec             60 python3 -m k3nn.bench.spec --configs small --reps 2 --budget-s 35
step prefix           45 python3 -m k3nn.bench.prefix --max-seconds 30
step moe-gpu-tests    50 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_moe_gpu.py
step mla-gpu-tests    40 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_mla_gpu.py -k "not nccl"
echo "== suite done at ${SECONDS}s" | tee -a "$LOG"
