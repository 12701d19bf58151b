#!/usr/bin/env bash
# The decode-roofline device run: named steps in the order given, each in its own process under its own time limit,
# all inside K3NN_SUITE_SECONDS. Results (JSON) and the full log land in $K3NN_RESULTS_DIR (default bench/results).
#   K3NN_RESULTS_DIR=$OUT K3NN_SUITE_SECONDS=200 bash bench/gpu/roofline_run.sh sweep map tests
# Steps:
#   sweep      skinny GEMM vs torch's GEMM on every k3_slice projection shape (bench.gpu.skinny_linear)
#   map        decode-roofline at B=1,4,16,64, torch's GEMMs (before) and the library defaults, the latter with the
#              sweep's launch shapes when a sweep result is in the results folder (else the committed table)
#   map-after  decode-roofline at B=1,4,16, the library defaults only
#   tests      GPU tests of the skinny GEMM and the model invariants with it on
#   model-tests  the one-launch MoE alignment and the model invariants only (the kernel tests skipped)
#   e2e        bench.e2e at B=1,8 (CUDA graphs, latency-specialised)
#   decode-tests  the existing decode / MoE GPU tests
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 K3NN_TEST_GPU=1 K3NN_DISABLE_PROGRESS_BARS=1
OUTDIR=${K3NN_RESULTS_DIR:-bench/results}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/log.txt"
END=$(( SECONDS + ${K3NN_SUITE_SECONDS:-300} ))
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$LOG"

step() {  # step NAME LIMIT CMD...
  local name=$1 limit=$2; shift 2
  local left=$(( END - SECONDS ))
  if (( left < 20 )); then echo "== $name: skipped (budget spent)" | tee -a "$LOG"; return; fi
  (( limit > left )) && limit=$left
  echo "== $name (limit ${limit}s, t=${SECONDS}s)" | tee -a "$LOG"
  timeout -s INT -k 10 "$limit" "$@" >> "$LOG" 2>&1
  echo "== $name: rc=$?, t=${SECONDS}s" | tee -a "$LOG"
  tac "$LOG" | sed -n "1,/^== $name (limit/p" | tac | grep -vE "^\s*$" | tail -n "${K3NN_TAIL_LINES:-24}"
}

table_arg() {
  local f
  f=$(ls -t "$OUTDIR"/skinny-linear-*.json 2>/dev/null | head -1)
  [[ -n "$f" ]] && echo "--skinny-table $f"
}

for s in "$@"; do
  case "$s" in
    sweep) step sweep 60 python3 -m bench.gpu.skinny_linear --budget 45 ;;
    map) step map 130 python3 -m bench.decode_roofline --variants torch-gemm,default --replays 10 --profile-replays 2 \
           --budget-s 105 $(table_arg) ;;
    map-after) step map-after 90 python3 -m bench.decode_roofline --variants default --batches 1,4,16 --replays 10 \
           --profile-replays 2 --budget-s 70 ;;
    model-tests) step model-tests 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_moe_align_gpu.py \
           tests/gpu/test_linear_gpu.py -k "not skinny_matches_fp64 and not k3_slice_shapes and not capture" ;;
    tests) step tests 80 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_linear_gpu.py ;;
    decode-tests) step decode-tests 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_decode_gpu.py tests/gpu/test_moe_gpu.py ;;
    e2e) step e2e 150 python3 -m bench.e2e --batches 1,8 --modes triton+graphs,latency_specialized --budget-s 100 ;;
    *) echo "== $s: no such step" | tee -a "$LOG" ;;
  esac
done
echo "== done at ${SECONDS}s" | tee -a "$LOG"
