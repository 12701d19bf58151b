#!/usr/bin/env bash
# The test suite as CI runs it: CPU tests (Triton kernels under the interpreter); GPU and slow tests excluded.
source "$(dirname "$0")/setup.sh"
export TRITON_INTERPRET=1 PYTHONHASHSEED=0 K3NN_DISABLE_PROGRESS_BARS=1
exec python -m pytest -m "not gpu and not slow" "$@"
