"""k3nn's benchmarks: the package of the repository's ``bench/`` folder, run from the repository root with k3nn
importable (the editable install of ``scripts/setup.sh``, or ``PYTHONPATH=src``).

* Suites (``bench/<suite>.py``, listed in :data:`SUITES`): ``python -m bench.<suite_with_underscores> [ARGS]``
  or ``k3nn bench <suite> [ARGS]``; each times k3nn against its anchor side by side and writes
  ``bench/results/<suite>-<date>.json`` (or under ``$K3NN_RESULTS_DIR``) in the schema of PERF.md.
* Two-rank suites, under ``torchrun`` / ``python -m torch.distributed.run --nproc-per-node 2``:
  ``-m bench.dcp --bench B,L,H`` (decode context parallelism), ``-m bench.ep`` (expert parallelism),
  ``-m bench.e2e --tp`` (tensor parallelism).
* ``bench/gpu/``: per-kernel variant sweeps and diagnostics, ``python -m bench.gpu.<name>``.
* :mod:`bench.common`: timing, errors, tables and result files; :mod:`bench.models`: seeded random-weight models;
  :mod:`bench.report`: the README's performance table from ``bench/results/*.json``
  (``python scripts/make_readme.py``).
* ``bench/h200_suite.sh``: named GPU test and benchmark steps, each in its own process under a time limit.
"""

#: ``k3nn bench`` suite name -> what it times (module ``bench.<name with underscores>``)
SUITES = {
    "kda-prefill": "KDA chunk prefill vs fla chunk_kda",
    "kda-decode": "fused KDA decode step vs fla fused_recurrent_kda",
    "mla-decode": "MLA paged latent decode vs plain PyTorch and FlashMLA",
    "moe": "fused MoE vs a torch._grouped_mm composition; MXFP4 expert weight bandwidth",
    "attnres": "AttnRes depth mix bandwidth; two-phase form vs per-sublayer mixing",
    "spec": "DSpark speculative decoding vs plain decoding, B=1",
    "engine-spec": "DSpark speculation inside the Engine vs the same engine without it",
    "prefix": "prefix-cache TTFT vs the same prompt cold",
    "budget": "adaptive vs fixed scheduled-token budget: TTFT at concurrency 1-4",
    "e2e": "whole-model decode tokens/s per mode (eager, Triton, CUDA graphs, fused decode)",
    "prefill": "whole-model prefill (TTFT) vs transformers' Kimi Linear",
    "decode-roofline": "k3_slice decode step per kernel class vs its HBM bound (bytes, time, TB/s, launches)",
    "serving": "the Engine at concurrency 1-64 (TTFT, TPOT, per-user and total tok/s) vs generate() and the HBM bound",
    "serve": "k3nn serve under HTTP load (TTFT / TPOT / ITL, throughput) vs the same workload in-process",
}
