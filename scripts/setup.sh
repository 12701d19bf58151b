# Sourced by demo.sh and test.sh: a virtualenv with k3nn installed (editable) and its test/demo extras.
# On a machine without torch it installs the pinned CPU wheel (torch==2.13.0); an existing torch is kept.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -d .venv ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
PIP="python -m pip --disable-pip-version-check -q"
if ! python -c "import torch" 2>/dev/null; then
  $PIP install "torch==2.13.0"
fi
$PIP install -e ".[test,demo,parity,hf,serve,docs]"
