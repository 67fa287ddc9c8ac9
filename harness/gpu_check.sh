#!/usr/bin/env bash
# What only a GPU can run, in one go (`make gpu-check`; about 4 minutes on one H200): the GPU tests,
# then GPT-2 small (--model gpt2, 124M parameters, on `make gpt-data`'s BPE shards, one process, batch 16 x
# 1024 tokens) in bf16, eager and compiled, 40 steps each: the log lines of steps 20 to 40 (ms/step,
# tokens/s, MFU) and the memory line (peak CUDA memory allocated). Everything goes to $OUT as well.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/gpu-check}
DATA=${DATA:-runs/gpt-data}
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu-check: torch sees no CUDA GPU here: nothing to check" >&2
  exit 2
fi
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpus.txt"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$OUT/gpus.txt"

# the GPU tests: the lessons on NCCL, the GPT's bf16 run, tp at world size 1 on NCCL, no wait in a step
timeout 360 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py \
  tests/test_gpt.py::test_on_gpus_it_trains_in_bf16_and_reports_mfu 2>&1 | tee "$OUT/tests.txt" || true

if [ ! -f "$DATA/manifest.json" ]; then
  "$PY" examples/gpt/prepare.py --out "$DATA" | tail -n 3
fi
for run in eager compile; do
  flags=()
  if [ "$run" = compile ]; then
    flags=(--compile)
  fi
  rm -rf "${OUT:?}/$run"
  timeout 240 "$PY" examples/gpt/train.py --model gpt2 --data "$DATA" --dtype bf16 --max_steps 40 \
    --eval_every 40 --log_every 10 --sample_chars 0 --snapshot_path "$OUT/$run" \
    --metrics_path "$OUT/$run.jsonl" "${flags[@]}" 2>&1 | tee "$OUT/$run.txt" |
    grep -E '^(model|step [234]0/|memory per rank)' || echo "gpu-check: the $run run failed: see $OUT/$run.txt"
done
