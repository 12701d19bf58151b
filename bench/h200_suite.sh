#!/usr/bin/env bash
# One planned device run: GPU correctness tests and benchmark suites, each in its own process with its own
# time limit (a device error in one cannot take the others down), in the order given, all inside one overall
# budget. Results land in $K3NN_RESULTS_DIR (JSON per suite); the full log in $K3NN_RESULTS_DIR/log.txt.
#   K3NN_RESULTS_DIR=/tmp/out K3NN_SUITE_SECONDS=480 bash bench/h200_suite.sh [STEP ...]
# Named steps run in the order named; with no STEP, every step below runs in the listed order. `bash bench/h200_suite.sh --list` prints them.
set -u
cd "$(dirname "$0")/.."
# from the repository root: `python3 -m bench.X` finds the bench package; src/ first on the path runs this
# checkout's k3nn whether or not it is installed
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 K3NN_TEST_GPU=1 K3NN_DISABLE_PROGRESS_BARS=1
OUTDIR=${K3NN_RESULTS_DIR:-bench/results}
PY="python3"
# GPU tests compile a kernel per drawn shape: one config per kernel (no autotuning) keeps them inside their limits;
# the benchmark steps exercise the tuners
PYTEST="python3 -m pytest -m gpu -q -p no:cacheprovider"

# name | limit (s) | command
STEPS=(
  "diag-decode|150|$PY -m bench.gpu.diag_decode"
  "diag-spec|150|$PY -m bench.gpu.diag_spec"
  "diag-decode-128|120|$PY -m bench.gpu.diag_decode --batches 1,8 --ctx 128 --prefill-backend auto"
  "attnres-sweep|140|$PY -m bench.gpu.attnres --budget 110 --tokens 8192"
  "mla-decode-variants|110|$PY -m bench.gpu.mla_decode"
  "moe-mx-variants|120|$PY -m bench.gpu.moe_mx"
  "moe-mx-k3|120|$PY -m bench.gpu.moe_mx --experts 896"
  "mx-updown|200|$PY -m bench.gpu.mx_updown --tokens 1,4,16 --budget 170"
  "stream-pattern|90|$PY -m bench.gpu.stream_pattern"
  "mx-ablate|300|$PY -m bench.gpu.mx_ablate --tokens 1,4,16 ${K3NN_MX_SOURCES:-}"
  "mx-next|200|$PY -m bench.gpu.mx_ablate --tokens 4,16 --no-ablations --config 4,2,2,0,1,2 --config 4,2,2,1,1,0 --block-m 4,8 --min-blocks 4"
  "mx-wgmma|240|$PY -m bench.gpu.mx_wgmma --tokens 1,4,16 --config 4,2,2,1,1 --config 4,2,2,1,4 --ablations no-loads"
  "attnres-variants|90|$PY -m bench.gpu.attnres"
  "kda-prefill|200|$PY -m bench.kda_prefill --quick"
  "kda-prefill-64k|200|$PY -m bench.kda_prefill --cases 65536:96:lower_bound,65536:32:softplus"
  "kda-decode|50|$PY -m bench.kda_decode --quick"
  "kda-decode-full|150|$PY -m bench.kda_decode"
  "mla-decode|120|$PY -m bench.mla_decode"
  "moe|60|$PY -m bench.moe --tokens 2048 8192 --mx-tokens 1 16"
  "moe-mx-official-k3|120|$PY -m bench.moe --experts 896 --skip-bf16 --mx-tokens 1 4 16"
  "attnres|45|$PY -m bench.attnres"
  "spec|150|$PY -m bench.spec --configs small,k3_slice --reps 2 --budget-s 110"
  "engine-spec|420|$PY -m bench.engine_spec --config k3_slice --conc 1,4,16 --reps 2 --budget-s 380"
  "fp32-exact|230|$PY -m bench.gpu.fp32_exact --budget 200"
  "vision-tower|200|$PY -m bench.gpu.vision_tower"
  "sampling-overhead|60|$PY -m bench.gpu.sampling_overhead"
  "engine-step|200|$PY -m bench.gpu.engine_step --config k3_slice --ctx 2048 --conc 1,16"
  "decode-host|150|$PY -m bench.gpu.decode_host --config k3_slice --ctx 128"
  "prefill|420|$PY -m bench.prefill"
  "prefill-short|300|$PY -m bench.prefill --lengths 512,2048,8192 --k3nn-only= --suite prefill-short"
  "prefill-profile|200|$PY -m bench.gpu.prefill_profile --T 512,2048 --top 25"
  "prefill-host|90|$PY -m bench.gpu.prefill_host"
  "prefill-profile-hf|240|$PY -m bench.gpu.prefill_profile --T 512,2048 --top 25 --from-transformers"
  "prefill-k3-1m|300|$PY -m bench.prefill --preset k3_slice --lengths 8192 --k3nn-only 524288,1048576"
  "fp32-exact-tests|60|$PYTEST tests/gpu/test_fp32_exact_gpu.py"
  "sampling-gpu-tests|40|$PYTEST tests/gpu/test_sampling_gpu.py"
  "vision-gpu-tests|150|$PYTEST tests/gpu/test_vision_gpu.py tests/vision/test_vision_flash_gpu.py"
  "prefix|100|$PY -m bench.prefix --max-seconds 70 --profile"
  "prefix-k3|90|$PY -m bench.prefix --config k3_slice --max-seconds 120 --profile"
  "budget|90|$PY -m bench.budget --max-seconds 60"
  "e2e|240|$PY -m bench.e2e --batches 1,8,64 --budget-s 200"
  "e2e-quick|150|$PY -m bench.e2e --batches 1,8 --modes eager,triton,triton+graphs,latency_specialized --budget-s 120"
  "decode-roofline|200|$PY -m bench.decode_roofline --variants default,torch-gemm --budget-s 170"
  "skinny-linear|90|$PY -m bench.gpu.skinny_linear --budget 70"
  "linear-gpu-tests|240|$PYTEST tests/gpu/test_linear_gpu.py tests/gpu/test_moe_align_gpu.py"
  "kda-gpu-tests|240|$PYTEST tests/gpu/test_kda_gpu.py"
  "kda-bwd-gpu-tests|150|$PYTEST -s tests/gpu/test_kda_bwd_gpu.py"
  "mla-cuda-tests|240|$PYTEST tests/gpu/test_mla_gpu.py -k cuda_"
  "mla-cuda-bench|150|$PY -m bench.gpu.mla_decode --cuda-only"
  "mla-splits|150|$PY -m bench.gpu.mla_splits"
  "mla-wgmma-tests|200|$PYTEST tests/gpu/test_mla_gpu.py -k wgmma"
  "mla-wgmma-sass|120|bash bench/gpu/ncu_sass.sh mla_wgmma_kernel -m bench.gpu.profile_mla_decode"
  "mla-wgmma-ncu|150|ncu --clock-control none --kernel-name regex:mla_wgmma_kernel|splitkv_mla --launch-skip 2 --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats $PY -m bench.gpu.profile_mla_decode"
  "mla-wgmma-cases-ncu|200|ncu --clock-control none --kernel-name regex:mla_wgmma_kernel|splitkv_mla --launch-count 18 --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --metrics lts__t_sector_hit_rate.pct $PY -m bench.gpu.profile_mla_decode --cases ${K3NN_NCU_CASES:-64,8192,64,1;64,8192,96,1;64,8192,64,2}"
  "mla-decode-ncu|150|ncu --clock-control none --kernel-name regex:_mla_decode_stage1|mla_wgmma_kernel|splitkv_mla --launch-count 9 --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section SourceCounters $PY -m bench.gpu.profile_mla_decode"
  "decode-gpu-tests|100|$PYTEST tests/gpu/test_decode_gpu.py"
  "attnres-gpu-tests|80|$PYTEST tests/gpu/test_attnres_gpu.py"
  "moe-gpu-tests|200|$PYTEST tests/gpu/test_moe_gpu.py"
  "mla-gpu-tests|150|$PYTEST tests/gpu/test_mla_gpu.py"
  "spec-gpu-tests|120|$PYTEST tests/gpu/test_spec_gpu.py"
  "engine-gpu-tests|200|$PYTEST tests/gpu/test_engine_gpu.py"
  "moe-align-gpu-tests|120|$PYTEST tests/gpu/test_moe_align_gpu.py"
  # two GPUs (nvidia-h200-x2): NCCL runs of DCP, EP and TP
  "nccl-probe|60|env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT $PY -m torch.distributed.run --nproc-per-node 2 -m bench.gpu.nccl_probe"
  "dcp-nccl-test|150|$PYTEST tests/gpu/test_mla_gpu.py -k dcp_nccl"
  "dcp-bench|150|$PY -m torch.distributed.run --nproc-per-node 2 -m bench.dcp --backend triton --cases 64,8192,64;1,131072,64;1,262144,64;1,524288,64"
  "dcp-bench-auto|150|$PY -m torch.distributed.run --nproc-per-node 2 -m bench.dcp --backend auto --cases 64,8192,64;64,8192,96;1,131072,64;1,524288,64"
  "dcp-bench-sharded|120|$PY -m torch.distributed.run --nproc-per-node 2 -m bench.dcp --backend triton --heads sharded --cases 64,8192,64;1,131072,64"
  "dcp-bench-profile|120|$PY -m torch.distributed.run --nproc-per-node 2 -m bench.dcp --backend triton --profile --cases 64,8192,64;1,131072,64"
  "ep-nccl|120|$PY -m torch.distributed.run --nproc-per-node 2 -m bench.ep --dim-scale 1 --experts 64 --topk 16 --tokens 64"
  "tp-e2e|240|$PY -m torch.distributed.run --nproc-per-node 2 -m bench.e2e --tp --batches 1,8 --modes eager,triton,triton+graphs,latency_specialized --budget-s 180"
)

if [[ "${1:-}" == "--list" ]]; then printf '%s\n' "${STEPS[@]}"; exit 0; fi
mkdir -p "$OUTDIR"
LOG="$OUTDIR/log.txt"
END=$(( SECONDS + ${K3NN_SUITE_SECONDS:-480} ))
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$LOG"

step() {  # step NAME LIMIT CMD
  local name=$1 limit=$2 cmd=$3 left
  left=$(( END - SECONDS ))
  if (( left < 25 )); then echo "== $name: skipped (suite budget spent)" | tee -a "$LOG"; return; fi
  (( limit > left )) && limit=$left
  echo "== $name (limit ${limit}s, t=${SECONDS}s)" | tee -a "$LOG"
  timeout -s INT -k 15 "$limit" $cmd >> "$LOG" 2>&1
  local rc=$?
  echo "== $name: rc=$rc, t=${SECONDS}s" | tee -a "$LOG"
  # the last lines of each step (tables, test summary) also go to stdout
  tac "$LOG" | sed -n "1,/^== $name (limit/p" | tac | grep -vE "^\s*$" | tail -n "${K3NN_TAIL_LINES:-18}"
}

# the steps named on the command line, in that order (all of them, in the listed order, when none is named)
want=("$@")
(( ${#want[@]} )) || for s in "${STEPS[@]}"; do want+=("${s%%|*}"); done
for w in "${want[@]}"; do
  found=0
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<< "$s"
    if [[ "$name" == "$w" ]]; then step "$name" "$limit" "$cmd"; found=1; fi
  done
  (( found )) || echo "== $w: no such step" | tee -a "$LOG"
done
echo "== suite done at ${SECONDS}s" | tee -a "$LOG"
