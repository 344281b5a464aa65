#!/usr/bin/env bash
# Installs moerl (editable) into the current Python. Usage: tools/install.sh [EXTRA,...]   e.g. tools/install.sh dev
# Without a GPU, the CPU build of torch goes in first: a bare torch requirement would pull a multi-GB CUDA build.
#
# The extra "sglang" installs SGLang (moerl.engines.protocol.SGLANG_VERSION) into an environment of its own, not this
# one: $MOERL_SGLANG_VENV, default ~/.cache/moerl/sglang-<version>; the job finds it there (moerl.engines.sglang). On a
# machine without a GPU that is torch's CUDA build (which runs on a CPU) and the pinned server requirements of
# tools/sglang-cpu-requirements.txt, about 6.7 GB; with a GPU, SGLang with all of its own requirements.
# The extra "slurm" installs Slurm and munge from the distribution (Debian's slurm-wlm; root) for tests/slurm.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  if [ "$gpu" = 1 ]; then
    "$PYTHON" -m pip install --quiet torch
  else
    "$PYTHON" -m pip install --quiet torch==2.13.0
  fi
fi
extras=()
sglang=0
IFS=',' read -ra asked <<< "${1:-}"
for extra in "${asked[@]}"; do
  if [ "$extra" = sglang ]; then
    sglang=1
  elif [ "$extra" = slurm ]; then  # Slurm and munge for tests/slurm's local cluster (as root, from the distribution)
    command -v slurmctld >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >&2
  elif [ -n "$extra" ]; then
    extras+=("$extra")
  fi
done
spec="."
if [ "${#extras[@]}" -gt 0 ]; then spec=".[$(IFS=,; echo "${extras[*]}")]"; fi
"$PYTHON" -m pip install --quiet -e "$spec"
if [ "$sglang" = 1 ]; then
  version="$("$PYTHON" -c 'from moerl.engines.protocol import SGLANG_VERSION; print(SGLANG_VERSION)')"
  venv="${MOERL_SGLANG_VENV:-$HOME/.cache/moerl/sglang-$version}"
  if [ ! -f "$venv/.complete-$version" ]; then
    echo "installing SGLang $version into $venv (a few minutes)" >&2
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    if [ "$gpu" = 1 ]; then
      "$venv/bin/python" -m pip install --quiet "sglang==$version" sglang-router
    else
      "$venv/bin/python" -m pip install --quiet -r tools/sglang-cpu-requirements.txt
      "$venv/bin/python" -m pip install --quiet --no-deps "sglang==$version"
    fi
    touch "$venv/.complete-$version"
  fi
  echo "SGLang $version is installed in $venv" >&2
fi
