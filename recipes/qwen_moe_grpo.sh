#!/usr/bin/env bash
# The main moerl job: GRPO on a Qwen MoE model with a Megatron trainer and SGLang (or, without a GPU,
# the embedded) engines, Keep Routing (R3) and Keep Sampling Mask, in sync | periodic | async mode.
#
#   bash recipes/qwen_moe_grpo.sh                                  # CPU demo: tiny model, made once and cached
#   bash recipes/qwen_moe_grpo.sh run.steps=20 run.dir=/tmp/r run.mode=sync
#   bash recipes/qwen_moe_grpo.sh --config recipes/qwen3_30b_a3b.yaml model.path=/models/Qwen3-30B-A3B
#
# Arguments are omegaconf overrides (section.key=value) of recipes/qwen_moe_grpo.yaml, or of the file
# given with --config. The script launches the trainer ranks through torchrun; when torchrun (or a
# cluster launcher) already started it as one rank, e.g.
#   torchrun --no-python --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:PORT recipes/qwen_moe_grpo.sh ...
# it runs as that rank instead of launching again. --help lists the options, --show-config every key.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
here="$(cd "$(dirname "$0")" && pwd)"
args=("$@")
if [[ " ${args[*]:-} " != *" --config "* ]]; then
  args=(--config "$here/qwen_moe_grpo.yaml" "${args[@]}")
fi
if [ -n "${LOCAL_RANK:-}" ] && [ -n "${WORLD_SIZE:-}" ] || [[ " ${args[*]} " =~ " "(-h|--help|--show-config|--show-plan)" " ]]; then
  exec "$PYTHON" -m moerl.cli train "${args[@]}"
fi
if [[ " ${args[*]} " != *" run.dir="* ]]; then
  args+=("run.dir=runs/qwen_moe_grpo/$(date +%Y%m%d-%H%M%S)")  # a new directory per run unless one is named
fi
# Config, model, task and engine URLs are checked before any rank starts (a mistake is one error line); then, in the
# same process, torchrun --standalone --nproc-per-node N -m moerl.cli train ARGS starts the N ranks the run needs.
# MOERL_MAX_RESTARTS=N: torchrun starts the ranks again after a crash, up to N times (with run.resume=auto each
# start continues from the newest checkpoint).
exec "$PYTHON" -m moerl.cli train --launch "${args[@]}"
