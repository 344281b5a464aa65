#!/usr/bin/env bash
# Main moerl job. Until the GRPO trainer lands (issues 4-5) it exercises the foundation end to end:
# a tiny Qwen MoE model (or your own HF directory in HF_MODEL) is converted to a Megatron checkpoint,
# verified against transformers at a tensor+expert parallel layout, and converted back.
#   HF_MODEL=/path/to/Qwen3-30B-A3B TP=2 EP=2 PP=1 bash recipes/qwen_moe_grpo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
RUN_DIR="${RUN_DIR:-runs/qwen_moe_grpo/$(date +%Y%m%d-%H%M%S)}"
TP="${TP:-2}" EP="${EP:-2}" PP="${PP:-1}"
mkdir -p "$RUN_DIR"

if [ -z "${HF_MODEL:-}" ]; then
  HF_MODEL="$RUN_DIR/hf"
  "$PYTHON" -m moerl.models.tiny --arch "${ARCH:-Qwen3MoeForCausalLM}" --out "$HF_MODEL"
fi
"$PYTHON" tools/convert_ckpt.py hf-to-mcore --hf "$HF_MODEL" --out "$RUN_DIR/mcore"
"$PYTHON" tools/convert_ckpt.py verify --hf "$HF_MODEL" --mcore "$RUN_DIR/mcore" --tp "$TP" --ep "$EP" --pp "$PP"
"$PYTHON" tools/convert_ckpt.py mcore-to-hf --mcore "$RUN_DIR/mcore" --out "$RUN_DIR/hf-roundtrip"
echo "done: $RUN_DIR"
