#!/usr/bin/env bash
# Installs moerl (editable) into the current Python. Usage: tools/install.sh [EXTRA,...]   e.g. tools/install.sh dev
# Without a GPU, the CPU build of torch goes in first: a bare torch requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet torch
  else
    "$PYTHON" -m pip install --quiet torch==2.13.0
  fi
fi
spec="."
if [ -n "${1:-}" ]; then spec=".[$1]"; fi
"$PYTHON" -m pip install --quiet -e "$spec"
