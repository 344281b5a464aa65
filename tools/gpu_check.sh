#!/usr/bin/env bash
# The GPU paths that CI cannot run, in one pass on one CUDA machine: the `gpu`-marked tests (NCCL parity, FlexAttention),
# the embedded engine on CUDA in bf16, and the main job as a user types it with its trainer rank on the same
# GPU (bf16, distributed optimizer, weights synced by disk: NCCL cannot pair two processes on one GPU): that
# run resumed from its checkpoint (the distributed optimizer's load), and a sync-mode run with an fp32 trainer.
# A LoRA run (adapters pushed alone) and its resume go first: its engine's base weights must still be the model's.
# Then a run with shared prompts, and one colocated (its own engine on the same GPU, weights handed over by CUDA IPC).
# Each check runs under its own time limit and the next one runs whatever happened; a summary line per
# check goes to stdout, every log and the runs' metrics into $OUT/gpu_check.tgz (OUT defaults to ./gpu_check),
# written again after each check, so a call cut off at its limit still brings back what ran.
#
# On one H100 (2026-11-26, STEPS=4): imports 21 s, pytest_gpu 116 s, tiny_model 27 s, engine_up 21 s, job_async 89 s,
# job_lora 105-142 s (its first Megatron conversion of a fresh model takes some 60 s of that), job_lora_resume 79 s,
# job_sync_fp32 82 s. On one H200 (2026-11-28, STEPS=3): job_shared_prompt 93 s, job_colocated 66 s. The whole script
# needs about 15 minutes: within a 15-minute device budget, split it over two calls with ONLY.
#
#   bash tools/gpu_check.sh            # on a machine with a GPU, moerl's dependencies importable
#   STEPS=4 bash tools/gpu_check.sh    # shorter main-job runs
#   ONLY="tiny_model engine_up job_async job_resume" bash tools/gpu_check.sh   # only these checks (a rerun)
set -uo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
out="$work/logs"
mkdir -p "$out" "${OUT:=gpu_check}"
steps="${STEPS:-8}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
device="$(python3 -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')"
summary=()

check() {  # check NAME SECONDS COMMAND...: one line of summary, the log in $out/NAME.log
  local name="$1" limit="$2" t0=$SECONDS rc
  shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
    return
  fi
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  summary+=("$(printf '%-22s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
  echo "${summary[-1]}"
  [ "$rc" = 0 ] || grep -E "(Error|Exception|FAILED|ERROR)\b" "$out/$name.log" | grep -vE "ChildFailedError|Warning|^ *raise " | head -n 12
  save
}

save() {  # the logs, the runs' metrics and everything small of the runs, into $OUT/gpu_check.tgz
  printf '%s\n' "${summary[@]}" >"$out/summary.txt"
  tar -czf "$OUT/gpu_check.tgz" -C "$work" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.distcp' . 2>/dev/null
}

{
  nvidia-smi -L 2>/dev/null || true
  python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")'
  python3 -c 'import megatron.core; print("megatron-core", megatron.core.__version__)'
} 2>&1 | tee "$out/machine.txt"

check imports 120 python3 -c 'import moerl.megatron.model, moerl.trainer.trainer, moerl.engines.embedded.engine, moerl.engines.embedded.server, moerl.cli.train, moerl.orchestrator.job'
# pytest.ini's -n (the unit tier's pytest-xdist) left out: a device machine may not have pytest-xdist
check pytest_gpu 240 python3 -m pytest -o addopts="-q -ra --strict-markers" -m gpu -p no:cacheprovider
check tiny_model 120 python3 -c "from moerl.tasks.tiny import save_warm_tiny_model; save_warm_tiny_model('$work/model')"

port=30123
python3 -m moerl.cli serve --model "$work/model" --device "$device" --dtype bfloat16 --port "$port" >"$out/engine.log" 2>&1 &
engine=$!
check engine_up 120 bash -c "until curl -sf http://127.0.0.1:$port/health >/dev/null; do sleep 1; done"
check job_lora "${JOB_LIMIT:-240}" bash recipes/qwen_moe_grpo.sh model.path="$work/model" "engines.urls=[http://127.0.0.1:$port]" engines.dtype=bfloat16 \
  trainer.ep=1 sync.method=disk sync.verify=true sync.verify_tolerance=0.5 lora.enabled=true run.steps="$steps" run.dir="$work/lora" \
  run.progress=false
check job_lora_resume "${JOB_LIMIT:-240}" bash recipes/qwen_moe_grpo.sh model.path="$work/model" "engines.urls=[http://127.0.0.1:$port]" \
  engines.dtype=bfloat16 trainer.ep=1 sync.method=disk sync.verify=true sync.verify_tolerance=0.5 lora.enabled=true \
  run.steps="$((steps + 2))" run.dir="$work/lora" run.progress=false run.resume=true
check job_async "${JOB_LIMIT:-240}" bash recipes/qwen_moe_grpo.sh model.path="$work/model" "engines.urls=[http://127.0.0.1:$port]" engines.dtype=bfloat16 \
  trainer.ep=1 sync.method=disk sync.verify=true sync.verify_tolerance=0.5 run.steps="$steps" run.dir="$work/async" run.progress=false
check job_resume "${JOB_LIMIT:-240}" bash recipes/qwen_moe_grpo.sh model.path="$work/model" "engines.urls=[http://127.0.0.1:$port]" engines.dtype=bfloat16 \
  trainer.ep=1 sync.method=disk sync.verify=true sync.verify_tolerance=0.5 run.steps="$((steps + 2))" run.dir="$work/async" run.progress=false \
  run.resume=true
check job_sync_fp32 "${JOB_LIMIT:-240}" bash recipes/qwen_moe_grpo.sh model.path="$work/model" "engines.urls=[http://127.0.0.1:$port]" engines.dtype=bfloat16 \
  trainer.ep=1 trainer.dtype=float32 trainer.optim.distributed_optimizer=false run.mode=sync sync.method=disk \
  run.steps="$steps" run.dir="$work/sync" run.progress=false
# trainer.shared_prompt: every forward of the step through FlexAttention's kernel, in bf16
check job_shared_prompt "${JOB_LIMIT:-240}" bash recipes/qwen_moe_grpo.sh model.path="$work/model" "engines.urls=[http://127.0.0.1:$port]" \
  engines.dtype=bfloat16 trainer.ep=1 sync.method=disk sync.verify=true sync.verify_tolerance=0.5 trainer.micro_batch_format=packed \
  trainer.shared_prompt=true run.steps="$steps" run.dir="$work/shared" run.progress=false
kill "$engine" 2>/dev/null
wait "$engine" 2>/dev/null
# colocated: the job's own engine on the trainer's GPU, released while it trains, weights handed over by CUDA IPC
check job_colocated "${JOB_LIMIT:-240}" bash recipes/qwen_moe_grpo.sh model.path="$work/model" engines.dtype=bfloat16 trainer.ep=1 \
  run.placement=colocated run.mode=sync sync.verify=true sync.verify_tolerance=0.5 run.steps="$steps" run.dir="$work/colocated" \
  run.progress=false
save
